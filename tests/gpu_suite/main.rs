//! The CUDA test files as one binary for the GPU machine (`bench/prepare_gpu.sh` packs it;
//! `bench/gpu_session.sh` runs it): each file is a module here, so the engine is linked once
//! instead of once per file, and a module runs alone by its name as a filter
//! (`gpu_suite cuda_parity::`). Not built by a plain `cargo test` (`test = false` in
//! Cargo.toml: CI runs the files as their own binaries); `cargo test --release --test
//! gpu_suite` builds and runs it.
//!
//! Run it with `--test-threads 1`: the files hold process-wide switches (TF32, cuDNN's
//! benchmark and deterministic modes, the batch-norm and fusion switches, the recompute
//! policy, the profiler), each behind a lock of its own, which serialises a file's tests
//! but not two files' against each other. hostile_input's counting allocator becomes the
//! whole binary's (it counts per thread and forwards every call to the system's).
//! cuda_capture checks first uses (a kernel module, the library handles): it runs alone, as
//! a process of its own (`gpu_suite cuda_capture::`), before the others load them.

// Each file declares its own `mod common;` (the shared helpers of tests/common), as a test
// binary of its own must: here that module is compiled once per file that uses it.
#![allow(clippy::duplicate_mod)]

#[path = "../attention_masks.rs"]
mod attention_masks;
#[path = "../batch_size.rs"]
mod batch_size;
#[path = "../cuda_capture.rs"]
mod cuda_capture;
#[path = "../cuda_determinism.rs"]
mod cuda_determinism;
#[path = "../cuda_fusions.rs"]
mod cuda_fusions;
#[path = "../cuda_graph.rs"]
mod cuda_graph;
#[path = "../cuda_kernels.rs"]
mod cuda_kernels;
#[path = "../cuda_limits.rs"]
mod cuda_limits;
#[path = "../cuda_parity.rs"]
mod cuda_parity;
#[path = "../cuda_semantics.rs"]
mod cuda_semantics;
#[path = "../cuda_tf32.rs"]
mod cuda_tf32;
#[path = "../cuda_transfer.rs"]
mod cuda_transfer;
#[path = "../cudnn_attention.rs"]
mod cudnn_attention;
#[path = "../data.rs"]
mod data;
#[path = "../data_parallel.rs"]
mod data_parallel;
#[path = "../data_parallel_buckets.rs"]
mod data_parallel_buckets;
#[path = "../flash_attention.rs"]
mod flash_attention;
#[path = "../fused_classifier.rs"]
mod fused_classifier;
#[path = "../fuzz_api.rs"]
mod fuzz_api;
#[path = "../gemm_epilogues.rs"]
mod gemm_epilogues;
#[path = "../gpt.rs"]
mod gpt;
#[path = "../gpt_ops.rs"]
mod gpt_ops;
#[path = "../hostile_input.rs"]
mod hostile_input;
#[path = "../integer_arithmetic.rs"]
mod integer_arithmetic;
#[path = "../packed_attention.rs"]
mod packed_attention;
#[path = "../profiler.rs"]
mod profiler;
#[path = "../recompute.rs"]
mod recompute;
#[path = "../residual_layer_norm.rs"]
mod residual_layer_norm;
#[path = "../rnn_variants.rs"]
mod rnn_variants;
#[path = "../torch_reference.rs"]
mod torch_reference;
