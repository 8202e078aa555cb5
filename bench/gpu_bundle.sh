#!/bin/bash
# Packs a built loom for a GPU node that lacks loom's libraries (a cloud or test node with the CUDA
# driver and toolkit but no MPICH, HDF5, Kokkos, Boost, OpenBLAS or oneDNN), with MPICH's launcher:
#
#   bash bench/gpu_bundle.sh build gpu-bundle.tar.xz            # here, after building loom with CUDA
#   bash bench/gpu_session.sh gpu-bundle.tar.xz OUTDIR checks   # there: bench/gpu_session.sh says what runs
#
# The bundle: bin/ holds loom, the GPU test programs and MPICH's hydra launcher, each behind a
# wrapper that puts the bundle's lib/ (then the node's CUDA libraries, LOOM_CUDA_LIB_DIRS, then the
# caller's LD_LIBRARY_PATH) on the library path of that program alone, so the node's own programs
# (python3, PyTorch) keep theirs; lib/ holds loom's libraries and plugins and every library they
# need but the C runtime, the C++ runtime (the node's newer one serves), the CUDA driver and CUDA's
# own libraries (too large: the node has its own, which bench/gpu_session.sh finds).
set -euo pipefail
usage="usage: bash bench/gpu_bundle.sh BUILD_DIR BUNDLE.tar.xz"
build=${1:?$usage}
bundle=${2:?$usage}
for f in loom loom_cuda_tests lib/libloom_cuda.so; do
  [ -e "$build/$f" ] || { echo "gpu_bundle: $build/$f is missing: build loom with CUDA first (LOOM_ENABLE_CUDA)" >&2; exit 2; }
done
for f in /usr/bin/mpiexec.hydra /usr/bin/hydra_pmi_proxy; do
  [ -e "$f" ] || { echo "gpu_bundle: $f is missing: the bundle carries MPICH's hydra launcher (Debian: mpich)" >&2; exit 2; }
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/loom-gpu-bundle
mkdir -p "$root/bin" "$root/lib"
programs=("$build/loom" "$build/loom_cuda_tests" /usr/bin/mpiexec.hydra /usr/bin/hydra_pmi_proxy)
[ ! -e "$build/loom_nccl_tests" ] || programs+=("$build/loom_nccl_tests")  # built where nccl.h was found
[ ! -e "$build/bench/attention_gpu" ] || programs+=("$build/bench/attention_gpu")  # attention alone (bench/)
cp "$build"/lib/*.so "$root/lib/"

# Each program as NAME.real behind a wrapper NAME.
for p in "${programs[@]}"; do
  name=$(basename "$p")
  cp -L "$p" "$root/bin/$name.real"
  cat > "$root/bin/$name" <<WRAPPER
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/../lib\${LOOM_CUDA_LIB_DIRS:+:\$LOOM_CUDA_LIB_DIRS}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/$name.real" "\$@"
WRAPPER
  chmod +x "$root/bin/$name"
done
ln -s mpiexec.hydra "$root/bin/mpiexec"

# The libraries they need, but those the node has in a compatible (newer) version or its own: the C
# and C++ runtimes, the CUDA driver, and CUDA's libraries wherever they were found here.
keep_out='/libc\.so|/libm\.so|/libdl\.so|/libpthread\.so|/librt\.so|/libresolv\.so|ld-linux|/libstdc\+\+\.so|/libgcc_s\.so|/libcuda\.so|/libnvidia|/libcublas|/libcudart|/libnccl|/libcudnn|/libnvrtc|/libnvJitLink'
for f in "${programs[@]}" "$build"/lib/*.so; do ldd "$f"; done | awk '/=> \// {print $3}' | sort -u |
  grep -v -E "$keep_out" | grep -v "^$(readlink -f "$build")/" | while read -r lib; do cp -L "$lib" "$root/lib/"; done
# Every library the bundle's programs and libraries need resolves inside it, or is one the node has.
outside=$(for f in "$root"/bin/*.real "$root"/lib/*.so*; do LD_LIBRARY_PATH="$root/lib" ldd "$f" 2>/dev/null; done |
  awk '/=>/ {print $1 " => " $3}' | grep -v -E "=> $root/lib/" | grep -v -E "$keep_out" | sort -u || true)
[ -z "$outside" ] || { echo "gpu_bundle: libraries the bundle lacks:" >&2; echo "$outside" >&2; exit 1; }

# LOOM_BUNDLE_XZ_LEVEL: xz's preset, 6 unless set (the suite's bundle case packs at 0: about a tenth
# of the time, 40% larger).
tar -C "$stage" -cf - loom-gpu-bundle | xz -T2 "-${LOOM_BUNDLE_XZ_LEVEL:-6}" > "$bundle"
echo "gpu_bundle: $bundle, $(du -h "$bundle" | cut -f1) ($(ls "$root/lib" | wc -l) libraries, $(du -sh "$root" | cut -f1) unpacked)"
