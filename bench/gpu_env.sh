# Sourced on the GPU machine: puts the CUDA libraries (driver, NVRTC, cuBLAS, cuDNN, NCCL) on the
# loader path and points the kernel cache and MNIST at places that exist there.
dirs=$(find / \( -name 'libcudnn.so.9' -o -name 'libcublasLt.so.13' -o -name 'libcublas.so.13' \
    -o -name 'libnvrtc.so.13' -o -name 'libnccl.so.2' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:-}"
export MANTISSA_CACHE_DIR=/tmp/mantissa-kernels
export MNIST_DIR=$PWD/.gpu/data
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
