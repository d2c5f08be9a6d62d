#!/usr/bin/env bash
# Builds what bench/gpu_session.sh runs on the GPU machine into .gpu/ (git-ignored): the
# gpu_check example and the test binaries that touch CUDA, stripped.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/tests
cargo build --release --example gpu_check
cp target/release/examples/gpu_check .gpu/
for t in cuda_kernels cuda_parity; do
    bin=$(cargo test --release --test "$t" --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("profile", {}).get("test") and m.get("executable"): print(m["executable"])' | tail -n1)
    cp "$bin" ".gpu/tests/$t"
done
strip .gpu/gpu_check .gpu/tests/*
du -sh .gpu
