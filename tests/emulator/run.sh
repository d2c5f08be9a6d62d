#!/usr/bin/env bash
# Runs tests against the emulated CUDA driver and NVRTC (driver.cpp, nvrtc.cpp): the CUDA
# backend's host side and our kernels, on the CPU, without a GPU; cuBLAS(Lt) is emulated by a
# naive GEMM (blas.cpp), cuDNN's convolutions by naive loops (dnn.cpp), its batch norm
# (dnn_norm.cpp), the graph API's convolution with channel sums (dnn_graph.cpp) and its
# scaled dot-product attention (dnn_sdpa.cpp); NCCL by threads that meet in each collective
# (nccl.cpp).
#   bash tests/emulator/run.sh [cargo test arguments]   (default: --test cuda_parity)
#   bash tests/emulator/run.sh run [cargo run arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/target/emulator
mkdir -p "$out"
cxx=${CXX:-c++}
# The libraries are rebuilt when a file of tests/emulator (or this script) is newer than
# the one built last (each run of this script would otherwise compile them all again).
stamp=$out/.built
if [ ! -e "$stamp" ] || [ -n "$(find "$root/tests/emulator" -newer "$stamp" -print -quit)" ]; then
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
        "$root/tests/emulator/dnn_norm.cpp" "$root/tests/emulator/dnn_graph.cpp" \
        "$root/tests/emulator/dnn_sdpa.cpp" -o "$out/libcudnn.so.9"
    "$cxx" -std=c++20 -O2 -shared -fPIC -Wl,-soname,libnccl.so.2 "$root/tests/emulator/nccl.cpp" \
        -o "$out/libnccl.so.2"
    touch "$stamp"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/cache"
export LD_LIBRARY_PATH=$out${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MANTISSA_EMU_SHIM=$root/tests/emulator/host_shim.h MANTISSA_CACHE_DIR=$work/cache MANTISSA_EMU_TMP=$work
cd "$root"
# MANTISSA_EMU_SANITIZE=1: the kernels built with AddressSanitizer and UBSan, the test
# binaries run with their runtimes preloaded, so that a kernel that reads or writes past its
# device allocation (as the launcher called it) fails the test. With
# MANTISSA_NO_CUDA_MEMORY_CACHING=1 each tensor has an allocation of its own size.
if [ "${MANTISSA_EMU_SANITIZE:-0}" = 1 ]; then
    asan=$("$cxx" -print-file-name=libasan.so)
    ubsan=$("$cxx" -print-file-name=libubsan.so)
    if [ ! -f "$asan" ] || [ ! -f "$ubsan" ]; then
        echo "MANTISSA_EMU_SANITIZE=1: $cxx has no libasan/libubsan" >&2
        exit 1
    fi
    export MANTISSA_EMU_CXXFLAGS="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all"
    # allocator_may_return_null: a refused allocation returns null, as the system allocator
    # does, so the engine's out-of-memory errors for sizes past memory are tested here too
    # (ASan's default aborts on any request past 1 TiB).
    export ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0:allocator_may_return_null=1
    export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env LD_PRELOAD=$asan:$ubsan"
fi
if [ $# -eq 0 ]; then set -- --test cuda_parity; fi
if [ "$1" = run ]; then # run an example: run.sh run --release --example gpu_check -- --quick
    shift
    cargo run "$@"
else
    cargo test "$@"
fi
