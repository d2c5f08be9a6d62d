#!/usr/bin/env bash
# Builds what bench/gpu_session.sh runs on the GPU machine into .gpu/ (git-ignored): the
# gpu_check and mnist examples, MNIST, and the test binaries that touch CUDA, stripped.
set -eu
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/tests
cargo build --release --example gpu_check --example mnist --example resnet --example lstm
cp target/release/examples/gpu_check target/release/examples/mnist target/release/examples/resnet \
    target/release/examples/lstm .gpu/
# The GPU machine has no network: MNIST travels gzip-compressed (MNIST_DIR=.gpu/data there).
mkdir -p .gpu/data
for f in data/mnist/*-ubyte; do gzip -c "$f" > ".gpu/data/$(basename "$f").gz"; done
for t in cuda_kernels cuda_parity cuda_semantics cuda_transfer cuda_fusions data fuzz_api \
    torch_reference hostile_input profiler cuda_tf32 cuda_limits batch_size recompute cuda_graph; do
    bin=$(cargo test --release --test "$t" --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("profile", {}).get("test") and m.get("executable"): print(m["executable"])' | tail -n1)
    cp "$bin" ".gpu/tests/$t"
done
strip .gpu/gpu_check .gpu/mnist .gpu/resnet .gpu/lstm .gpu/tests/*
# The binaries travel gzip-compressed (a carry is 64 MiB at most); gpu_session.sh unpacks them.
tar -czf .gpu/bin.tar.gz -C .gpu gpu_check mnist resnet lstm tests
rm -rf .gpu/gpu_check .gpu/mnist .gpu/resnet .gpu/lstm .gpu/tests
du -sh .gpu
