#!/bin/bash
# Runs loom's GPU checks and benchmarks on a GPU node from a bundle (bench/gpu_bundle.sh), from the
# repository's root (the regression scripts, decks and data come from there):
#
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR checks   # the gpu-labelled tests (~5 min on an H100)
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR bench    # bench/gpu.py, unfused and flash, and profiles
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR all      # both, in the order of what is least known
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR smoke    # one kernel test and the refusals (seconds)
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR 'matches_host bench_flash'   # these steps only
#
# checks: loom_cuda_tests and loom_nccl_tests (every CUDA kernel against its host twin, the fused
#   attention against the fp64 reference and the twin), regression/gpu_checks.py refusal,
#   matches_host, decks, cuda_layouts and plan_memory (as `ctest -L gpu` runs them) -> OUTDIR/checks.log
# bench: bench/attention_gpu.py (attention alone: loom's flash, cuDNN's through loom, PyTorch's SDPA),
#   bench/gpu.py (GPT-2 124M in bf16 against PyTorch) with model.attention = cudnn and flash (PyTorch's
#   scaled_dot_product_attention) and unfused (PyTorch's attention written out), the Llama block of the
#   same shape with flash (bench_llama: its MFU beside GPT-2's), then 10 steps of each
#   under LOOM_CUDA_PROFILE (GPU time per operation) -> OUTDIR/bench.log
# all: every step of checks and bench in one call, what has never run on a GPU first (cuDNN's
#   attention tests and benchmarks, matches_host, then the rest), so that a lease that ends early has
#   brought back the most -> OUTDIR/all.log
# smoke: CudaBackend.EncoderForwardAndBackward and regression/gpu_checks.py refusal -> OUTDIR/smoke.log
#   (regression.gpu.bundle runs it on every CUDA build).
# 'STEP ...': those steps, by the names in known_items below -> OUTDIR/steps.log. One is in no mode:
#   ncu_flash, Nsight Compute's sections (occupancy, warp stalls, pipes, memory) for one launch of
#   each fused attention kernel, where ncu is on the node.
# Two commits' profiles side by side (issue 44's before and after): run profile_flash with each
#   commit's bundle into its own OUTDIR, then python3 bench/profile_diff.py OLD/steps.log NEW/steps.log --steps 10.
# Each: the device and the CUDA libraries found -> OUTDIR/node.log; a line per step with its exit
#   status and seconds -> OUTDIR/summary.log (both started afresh; the logs are written as each step
#   ends). A step still running after LOOM_GPU_STEP_TIMEOUT seconds (default 300; 0: no limit) is
#   stopped, it and its children (exit 124, noted), so that a hung kernel or rank costs one step, not
#   the lease; a signal to the session stops the running step, then the session. Exit
#   0 when every step passed: on a GPU node a skipped test is a failure (it says the GPU, or a
#   library, was not found), 2 on a bad call.
set -uo pipefail
usage="usage: bash bench/gpu_session.sh BUNDLE.tar.xz OUTDIR checks|bench|all|smoke|'STEP ...'"
bundle=${1:?$usage}
out=${2:?$usage}
what=${3:?$usage}
known_items="cuda_tests cudnn_tests nccl_tests refusal matches_host decks cuda_layouts plan_memory bench_unfused bench_flash bench_llama bench_cudnn bench_attention profile_unfused profile_flash profile_cudnn smoke_kernel ncu_flash"
case "$what" in
  checks|bench|all|smoke) ;;
  *)  # a list of steps by name, e.g. to run again the ones that failed
    [ -n "${what// /}" ] || { echo "$usage" >&2; exit 2; }
    for item in $what; do
      case " $known_items " in *" $item "*) ;; *)
        echo "gpu_session: the third argument is checks, bench, all or smoke, or steps among: $known_items; not '$item'" >&2
        exit 2 ;;
      esac
    done ;;
esac
step_timeout=${LOOM_GPU_STEP_TIMEOUT:-300}
[ -f regression/gpu_checks.py ] || { echo "gpu_session: run from loom's repository root" >&2; exit 2; }
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
log_name=$what
case "$what" in checks|bench|all|smoke) ;; *) log_name=steps ;; esac
rm -f "$out/node.log" "$out/summary.log" "$out/$log_name.log"
work=$(mktemp -d /tmp/loom-gpu-session.XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$bundle" || { echo "gpu_session: cannot unpack $bundle" >&2; exit 2; }
b=$work/loom-gpu-bundle

# The node's CUDA libraries that libloom_cuda.so needs (cuBLASLt, ...) and NCCL (opened when a job
# needs it): the toolkit's folders, else anywhere under the usual roots and Python's prefixes (PyTorch
# brings nvidia-* wheels).
py=$(command -v python3 || true)
roots="/usr /opt $HOME"
[ -z "$py" ] || roots="$roots $("$py" -c 'import site, sys; print(" ".join([sys.prefix] + site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)"
needed=$(readelf -d "$b/lib/libloom_cuda.so" | sed -n 's/.*(NEEDED).*\[\(lib\(cublas\|cudart\|nvJitLink\|nvrtc\)[^]]*\)\].*/\1/p')
dirs=""
for lib in $needed libnccl.so.2 libcudnn.so.9 libnvrtc.so.13; do
  found=$(ls /usr/local/cuda/lib64/$lib /usr/local/cuda/lib/$lib /usr/local/cuda/targets/x86_64-linux/lib/$lib 2>/dev/null | head -1)
  # shellcheck disable=SC2086
  [ -n "$found" ] || found=$(find $roots -name "$lib" 2>/dev/null | head -1)
  if [ -z "$found" ]; then
    echo "gpu_session: $lib not found on this node (under /usr/local/cuda, $roots)" | tee -a "$out/node.log" >&2
    # NCCL only matters to jobs across GPUs; cuDNN (and NVRTC, which its runtime-compiled engines load)
    # to model.attention = cudnn (refused without them, saying so)
    case "$lib" in libnccl.so.2|libcudnn.so.9|libnvrtc.so.13) ;; *) exit 2 ;; esac
    continue
  fi
  case ":$dirs:" in *":$(dirname "$found"):"*) ;; *) dirs="$dirs${dirs:+:}$(dirname "$found")" ;; esac
done
export LOOM_CUDA_LIB_DIRS=$dirs LOOM_PLUGIN_PATH=$b/lib PATH=$b/bin:$PATH
{
  date -u
  nvidia-smi -L 2>&1
  echo "CUDA libraries needed: $needed (and libnccl.so.2, libcudnn.so.9, libnvrtc.so.13), from $LOOM_CUDA_LIB_DIRS"
  LD_LIBRARY_PATH=$LOOM_CUDA_LIB_DIRS "${py:-false}" -c 'import ctypes; print("cuDNN", ctypes.CDLL("libcudnn.so.9").cudnnGetVersion())' 2>&1 | tail -1
  echo "python3: $py ($("${py:-false}" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1))"
  "$b/bin/loom" --version 2>&1 | head -3
} >> "$out/node.log" 2>&1

status=0
log=$out/$log_name.log
# Ctrl-C or a TERM to this session stops the running step (in a process group of its own) first.
step_pid=""
stop_step() {
  if [ -n "$step_pid" ]; then
    kill -TERM "$step_pid" 2>/dev/null
    wait "$step_pid" 2>/dev/null
  fi
  echo "gpu_session: stopped by a signal" | tee -a "$out/summary.log" >&2
  exit 130
}
trap stop_step INT TERM
step() {  # step NAME COMMAND...: runs it, appending to the log, and notes its exit status
  local name=$1
  shift
  local t0=$SECONDS
  echo "=== $name: $*" >> "$log"
  # timeout runs the step in a process group of its own and stops the whole group (mpiexec's ranks
  # too); in the background, so that a signal to this session reaches it (stop_step).
  timeout --kill-after=10 "$step_timeout" "$@" > "$work/step.log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  local rc=$?
  step_pid=""
  cat "$work/step.log" >> "$log"
  local note=""
  if [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ "$step_timeout" != 0 ] && [ $((SECONDS - t0)) -ge "${step_timeout%.*}" ]; }; then
    note=" (timed out: stopped after LOOM_GPU_STEP_TIMEOUT = $step_timeout s)"
  elif [ $rc -eq 137 ]; then
    note=" (killed by SIGKILL before its time was up: out of memory?)"
  # A skip here says the GPU (or a library it needs) was not found: a failure on a GPU node.
  elif [ $rc -eq 77 ] || grep -q -E '^\[  SKIPPED \] [0-9]+ test' "$work/step.log"; then
    note=" (skipped: no GPU seen, or a library missing; the log says which)"
    [ $rc -ne 0 ] || rc=77
  fi
  echo "$name: exit $rc$note, $((SECONDS - t0)) s" | tee -a "$out/summary.log"
  [ "$rc" -eq 0 ] || status=1
}
gpu_case() {  # gpu_case CASE: a case of regression/gpu_checks.py through the bundle's loom and mpiexec
  step "gpu_checks $1" "$py" regression/gpu_checks.py --loom "$b/bin/loom" --workdir "$work/gpu-checks" \
    --mpirun "$b/bin/mpiexec" "$1"
}

# The steps by name; each mode is a list of them.
run_item() {
  case "$1" in
    cuda_tests) step loom_cuda_tests "$b/bin/loom_cuda_tests" ;;
    cudnn_tests) step "loom_cuda_tests cudnn" "$b/bin/loom_cuda_tests" --gtest_filter='*Cudnn*' ;;
    bench_attention)  # attention alone: loom's flash, cuDNN through loom, PyTorch's SDPA, same shapes
      step "attention_gpu.py" "$py" bench/attention_gpu.py --bench "$b/bin/attention_gpu" ;;
    bench_cudnn)
      step "gpu.py cudnn" "$py" bench/gpu.py --loom "$b/bin/loom" --workdir "$work/gpu-bench" \
        --set model.attention=cudnn --torch-attention sdpa --torch-compile ;;
    nccl_tests) if [ -e "$b/bin/loom_nccl_tests" ]; then step loom_nccl_tests "$b/bin/loom_nccl_tests"; fi ;;
    bench_unfused) step "gpu.py unfused" "$py" bench/gpu.py --loom "$b/bin/loom" --workdir "$work/gpu-bench" ;;
    bench_flash)
      step "gpu.py flash" "$py" bench/gpu.py --loom "$b/bin/loom" --workdir "$work/gpu-bench" \
        --set model.attention=flash --torch-attention sdpa --torch-compile ;;
    bench_llama)  # issue 46: the Llama block at GPT-2 124M's width, depth and heads, beside bench_flash's GPT-2
      step "gpu.py llama flash" "$py" bench/gpu.py --loom "$b/bin/loom" --workdir "$work/gpu-bench" \
        --set model.arch=llama --set model.attention=flash --torch-attention sdpa ;;
    profile_*)
      local a=${1#profile_}
      step "profile $a" env LOOM_CUDA_PROFILE=1 "$b/bin/loom" run bench/gpu.deck --set train.steps=10 \
        --set model.attention="$a" --set run.dir="$work/profile-$a" ;;
    smoke_kernel) step loom_cuda_tests "$b/bin/loom_cuda_tests" --gtest_filter=CudaBackend.EncoderForwardAndBackward ;;
    ncu_flash)  # Nsight Compute on one launch of each fused attention kernel of bench/gpu.deck's step
      local ncu k
      ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1)
      if [ -z "$ncu" ]; then
        echo "ncu_flash: no ncu (Nsight Compute) on this node" | tee -a "$out/summary.log"
        status=1
        return
      fi
      # ncu exits 0 when no launch matched: the step fails unless a section was printed.
      for k in attention_forward_kernel attention_backward_kv_kernel attention_backward_q_kernel; do
        step "ncu $k" bash -c '"$@" > "$0" 2>&1; rc=$?; cat "$0"; [ $rc -eq 0 ] || exit $rc
          grep -q "Section: GPU Speed Of Light" "$0" || { echo "ncu_flash: ncu profiled no launch"; exit 1; }' \
          "$work/ncu.out" "$ncu" -k "regex:$k" -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis "$b/bin/loom" run bench/gpu.deck --set train.steps=1 \
          --set model.attention=flash --set run.peak_tflops=1 --set run.dir="$work/ncu-$k"
      done ;;
    *) gpu_case "$1" ;;  # a case of regression/gpu_checks.py
  esac
}
case "$what" in
  checks) items="cuda_tests nccl_tests refusal matches_host decks cuda_layouts plan_memory" ;;
  bench) items="bench_attention bench_cudnn bench_flash bench_llama bench_unfused profile_cudnn profile_flash profile_unfused" ;;
  all) items="cudnn_tests bench_attention bench_cudnn matches_host cuda_tests bench_flash bench_llama refusal nccl_tests cuda_layouts decks plan_memory profile_cudnn profile_flash bench_unfused profile_unfused" ;;
  smoke) items="smoke_kernel refusal" ;;
  *) items=$what ;;
esac
for item in $items; do run_item "$item"; done
exit $status
