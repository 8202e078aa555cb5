#!/bin/bash
# Runs loom's GPU checks and benchmarks on a GPU node from a bundle (bench/gpu_bundle.sh), from the
# repository's root (the regression scripts, decks and data come from there):
#
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR checks   # the gpu-labelled tests (~5 min on an H100)
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR bench    # bench/gpu.py, unfused and flash, and profiles
#
# checks: loom_cuda_tests and loom_nccl_tests (every CUDA kernel against its host twin, the fused
#   attention against the fp64 reference and the twin), regression/gpu_checks.py refusal,
#   matches_host, decks and cuda_layouts (as `ctest -L gpu` runs them) -> OUTDIR/checks.log
# bench: bench/gpu.py (GPT-2 124M in bf16 against PyTorch) with model.attention = unfused (PyTorch's
#   attention written out) and flash (PyTorch's scaled_dot_product_attention),
#   then 10 steps of each under LOOM_CUDA_PROFILE (GPU time per operation) -> OUTDIR/bench.log
# Both: the device and what was found -> OUTDIR/node.log; a line per step with its exit status ->
#   OUTDIR/summary.log. Exit 0 when every step passed (a skipped gpu case counts as a failure here:
#   this script is for a node with a GPU).
set -uo pipefail
bundle=${1:?usage: bash bench/gpu_session.sh BUNDLE.tar.xz OUTDIR checks|bench}
out=${2:?usage: bash bench/gpu_session.sh BUNDLE.tar.xz OUTDIR checks|bench}
what=${3:?usage: bash bench/gpu_session.sh BUNDLE.tar.xz OUTDIR checks|bench}
case "$what" in checks|bench) ;; *) echo "gpu_session: the third argument is checks or bench, not '$what'" >&2; exit 2 ;; esac
[ -f regression/gpu_checks.py ] || { echo "gpu_session: run from loom's repository root" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/loom-gpu-session.XXXXXX)
tar -C "$work" -xJf "$bundle" || { echo "gpu_session: cannot unpack $bundle" >&2; exit 2; }
b=$work/loom-gpu-bundle

# The node's CUDA runtime, cuBLASLt and NCCL: the toolkit's folders, else a Python package's (PyTorch
# brings nvidia-* wheels), found by name.
dirs=""
for lib in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do
  found=$(ls /usr/local/cuda/lib64/$lib /usr/local/cuda/lib/$lib /usr/local/cuda/targets/x86_64-linux/lib/$lib 2>/dev/null | head -1)
  [ -n "$found" ] || found=$(find /usr /opt -name "$lib" 2>/dev/null | head -1)
  [ -n "$found" ] || { echo "gpu_session: $lib not found on this node" >&2; continue; }
  case ":$dirs:" in *":$(dirname "$found"):"*) ;; *) dirs="$dirs${dirs:+:}$(dirname "$found")" ;; esac
done
export LOOM_CUDA_LIB_DIRS=$dirs LOOM_PLUGIN_PATH=$b/lib PATH=$b/bin:$PATH
py=$(command -v python3)
{
  date -u
  nvidia-smi -L 2>&1
  echo "CUDA library folders: $LOOM_CUDA_LIB_DIRS"
  echo "python3: $py ($($py -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1))"
  "$b/bin/loom" --version 2>&1 | head -3
} > "$out/node.log" 2>&1

status=0
step() {  # step NAME LOG COMMAND...: runs it, appending to LOG, and notes its exit status
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >> "$log"
  "$@" > "$work/step.log" 2>&1
  local rc=$?
  cat "$work/step.log" >> "$log"
  local note=""
  # On a GPU node nothing may be skipped: a skip says the GPU was not seen.
  if [ $rc -eq 77 ] || grep -q -E '^\[  SKIPPED \] [0-9]+ test' "$work/step.log"; then
    note=" (skipped: no GPU seen)"
    [ $rc -ne 0 ] || rc=77
  fi
  echo "$name: exit $rc$note, $((SECONDS - t0)) s" | tee -a "$out/summary.log"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$what" = checks ]; then
  log=$out/checks.log
  step loom_cuda_tests "$log" "$b/bin/loom_cuda_tests"
  step loom_nccl_tests "$log" "$b/bin/loom_nccl_tests"
  for c in refusal matches_host decks cuda_layouts; do
    step "gpu_checks $c" "$log" "$py" regression/gpu_checks.py --loom "$b/bin/loom" --workdir "$work/gpu-checks" \
      --mpirun "$b/bin/mpiexec" "$c"
  done
else
  log=$out/bench.log
  step "gpu.py unfused" "$log" "$py" bench/gpu.py --loom "$b/bin/loom"
  step "gpu.py flash" "$log" "$py" bench/gpu.py --loom "$b/bin/loom" --set model.attention=flash --torch-attention sdpa
  for a in unfused flash; do
    step "profile $a" "$log" env LOOM_CUDA_PROFILE=1 "$b/bin/loom" run bench/gpu.deck --set train.steps=10 \
      --set model.attention=$a --set run.dir="$work/profile-$a"
  done
fi
rm -rf "$work"
exit $status
