#!/usr/bin/env bash
# One call on the GPU machine (the device tool): puts the CUDA libraries on the loader path,
# then runs gpu_check, the CUDA tests and the M1 peer, writing logs under $OUT.
# Prepare here first with `bash bench/prepare_gpu.sh`, then run with `.gpu` carried:
#   bash bench/gpu_session.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
dirs=$(find / \( -name 'libcudnn.so.9' -o -name 'libcublasLt.so.13' -o -name 'libcublas.so.13' \
    -o -name 'libnvrtc.so.13' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:-}"
export MANTISSA_CACHE_DIR=/tmp/mantissa-kernels
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee "$OUT/env.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/env.log"
run() { # name, command...
    local name=$1; shift
    echo "== $name"
    ( "$@" ) >"$OUT/$name.log" 2>&1
    echo "rc=$?" >>"$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
}
run gpu_check .gpu/gpu_check
for t in .gpu/tests/*; do run "test-$(basename "$t")" "$t" --test-threads 1; done
run matmul_peer python3 bench/matmul_peer_cuda.py --n 8192
