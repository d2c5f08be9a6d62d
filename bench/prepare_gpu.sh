#!/usr/bin/env bash
# Builds what bench/gpu_session.sh runs on the GPU machine into .gpu/ (git-ignored): the
# gpu_check, mnist, resnet, lstm and gpt examples, MNIST, and the CUDA test files as one binary
# (tests/gpu_suite: each file a module, the engine linked once), stripped, packed as
# .gpu/bin.tar.gz. The package travels in a carry of 64 MiB at most: this script prints its
# size and fails at 40 MiB or more, to leave room.
set -eu
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/tests
cargo build --release --example gpu_check --example mnist --example resnet --example lstm \
    --example gpt
cp target/release/examples/gpu_check target/release/examples/mnist target/release/examples/resnet \
    target/release/examples/lstm target/release/examples/gpt .gpu/
# The GPU machine has no network: MNIST travels gzip-compressed (MNIST_DIR=.gpu/data there).
mkdir -p .gpu/data
for f in data/mnist/*-ubyte; do gzip -c "$f" > ".gpu/data/$(basename "$f").gz"; done
# Shakespeare's works for the GPT runs (fetched here by the example on first use).
[ -f data/shakespeare/input.txt ] || target/release/examples/gpt --steps 0 --generate 0 --device cpu
gzip -c data/shakespeare/input.txt > .gpu/data/shakespeare.txt.gz
# The test files of tests/gpu_suite/main.rs (cuda_kernels cuda_parity cuda_semantics
# cuda_transfer cuda_fusions cuda_determinism data fuzz_api torch_reference hostile_input
# profiler cuda_tf32 cuda_limits batch_size recompute cuda_graph data_parallel), one binary;
# run one file's tests with its module as the filter: `.gpu/tests/gpu_suite cuda_parity::`.
bin=$(cargo test --release --test gpu_suite --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("profile", {}).get("test") and m.get("executable"): print(m["executable"])' | tail -n1)
[ -n "$bin" ] || { echo "prepare_gpu.sh: the gpu_suite test binary did not build" >&2; exit 1; }
cp "$bin" .gpu/tests/gpu_suite
strip .gpu/gpu_check .gpu/mnist .gpu/resnet .gpu/lstm .gpu/gpt .gpu/tests/*
# The commit the binaries were built from, for the session's summary.
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' (with changes)')" \
    > .gpu/commit
# The binaries travel gzip-compressed; gpu_session.sh unpacks them.
tar -czf .gpu/bin.tar.gz -C .gpu gpu_check mnist resnet lstm gpt tests
rm -rf .gpu/gpu_check .gpu/mnist .gpu/resnet .gpu/lstm .gpu/gpt .gpu/tests
bytes=$(du -sb .gpu | cut -f1)
mib=$(python3 -c "print(f'{$bytes / 2**20:.1f}')")
echo "package .gpu: $mib MiB ($bytes bytes; a carry holds 64 MiB, this script allows under 40)"
du -sh .gpu/* | sed 's/^/  /'
if [ "$bytes" -ge $((40 << 20)) ]; then
    echo "prepare_gpu.sh: the package is $mib MiB, 40 MiB or more" >&2
    exit 1
fi
