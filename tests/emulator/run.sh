#!/usr/bin/env bash
# Runs tests against the emulated CUDA driver and NVRTC (driver.cpp, nvrtc.cpp): the CUDA
# backend's host side and our kernels, on the CPU, without a GPU; cuBLAS(Lt) is emulated by a
# naive GEMM (blas.cpp), cuDNN's convolutions by naive loops (dnn.cpp).
#   bash tests/emulator/run.sh [cargo test arguments]   (default: --test cuda_parity)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/target/emulator
mkdir -p "$out"
cxx=${CXX:-c++}
"$cxx" -std=c++20 -O1 -shared -fPIC -Wl,-soname,libcuda.so.1 "$root/tests/emulator/driver.cpp" \
    -o "$out/libcuda.so.1"
ln -sf libcuda.so.1 "$out/libcuda.so"
"$cxx" -std=c++20 -O1 -shared -fPIC -Wl,-soname,libnvrtc.so.13 "$root/tests/emulator/nvrtc.cpp" \
    -o "$out/libnvrtc.so.13"
"$cxx" -std=c++20 -O1 -shared -fPIC -DEMU_CUDA12 -Wl,-soname,libnvrtc.so.12 \
    "$root/tests/emulator/nvrtc.cpp" -o "$out/libnvrtc.so.12"
ln -sf libnvrtc.so.13 "$out/libnvrtc.so"
for lib in libcublas libcublasLt; do
    for major in 12 13; do
        "$cxx" -std=c++20 -O2 -shared -fPIC -Wl,-soname,$lib.so.$major \
            "$root/tests/emulator/blas.cpp" -o "$out/$lib.so.$major"
    done
done
"$cxx" -std=c++20 -O3 -shared -fPIC -Wl,-soname,libcudnn.so.9 "$root/tests/emulator/dnn.cpp" \
    -o "$out/libcudnn.so.9"
cache=$(mktemp -d)
trap 'rm -rf "$cache" /tmp/mantissa-emu-*' EXIT
export LD_LIBRARY_PATH=$out${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MANTISSA_EMU_SHIM=$root/cuda/host_shim.h MANTISSA_CACHE_DIR=$cache
cd "$root"
if [ $# -eq 0 ]; then set -- --test cuda_parity; fi
cargo test "$@"
