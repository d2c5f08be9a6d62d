//! Attention through cuDNN's fused attention graphs (src/backend/cuda/dnn_sdpa.rs) against
//! the composition in f32: f16 and bf16, head sizes 64, 128 and 40 (which the tensor-core
//! kernels do not take), causal and not, more or fewer queries than keys. The profiler shows
//! one cuDNN call each way and no kernel of ours. Where cuDNN does not take a problem the
//! engine's kernels run, with the same results: a backward whose key count is not a multiple
//! of 128 on a runtime up to 9.15 (the forward stays cuDNN's, the flash backward reads its
//! log-sum-exp), head sizes that are not a multiple of 8, f32, the switch off, and a plan
//! cuDNN refuses to run, which is then not asked again. On the emulated device in CI (its
//! cuDNN interprets the graph operation by operation: tests/emulator/dnn_sdpa.cpp); without a
//! CUDA device each test prints `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]

mod common;
use common::assert_close;
use common::attention::{band, check_against_reference, packed_heads, FusedKernel};
use common::parity::{emulated, gpu};
use mantissa::*;

/// How many of `kernels` start with `prefix`.
fn count(kernels: &[String], prefix: &str) -> usize {
    kernels.iter().filter(|k| k.starts_with(prefix)).count()
}

/// cuDNN ran the forward (and the backward, with `backward`), and no attention kernel of ours
/// ran where it did.
fn cudnn_ran(kernels: &[String], backward: bool, what: &str) {
    assert_eq!(count(kernels, "cudnn sdpa fwd"), 1, "{what}: {kernels:?}");
    assert_eq!(count(kernels, "flash_forward"), 0, "{what}: {kernels:?}");
    assert_eq!(count(kernels, "attn_forward"), 0, "{what}: {kernels:?}");
    if backward {
        assert_eq!(count(kernels, "cudnn sdpa bwd"), 1, "{what}: {kernels:?}");
        assert_eq!(count(kernels, "flash_"), 0, "{what}: {kernels:?}");
        assert_eq!(count(kernels, "attn_"), 0, "{what}: {kernels:?}");
    }
}

#[test]
fn cudnn_attention_matches_the_f32_composition() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(true);
    // Key counts that are multiples of 128 (the backward's rule up to 9.15); fewer queries
    // than keys, more, and two.
    let shapes = [
        (128, 128, true),
        (37, 256, false),
        (200, 128, true),
        (2, 128, false),
    ];
    for dt in [DType::BF16, DType::F16] {
        for e in [64, 128, 40] {
            for &(l, s, causal) in &shapes {
                let what = format!("{dt:?} head {e}, {l} x {s}, causal {causal}");
                let kernels = check_against_reference(d, dt, (l, s, e), causal);
                cudnn_ran(&kernels, true, &what);
            }
        }
    }
}

/// A backward cuDNN is not asked for (77 keys on the emulated 9.1 runtime) runs on the flash
/// kernels from cuDNN's output and log-sum-exp; one query (a decoding step, whose key count
/// changes at every call), a head size of 36 (not a multiple of 8) and f32 never reach cuDNN.
#[test]
fn problems_cudnn_does_not_take_run_on_the_kernels() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(true);
    let kernels = check_against_reference(d, DType::BF16, (50, 77, 64), true);
    cudnn_ran(&kernels, false, "77 keys");
    assert_eq!(count(&kernels, "cudnn sdpa bwd"), 0, "{kernels:?}");
    assert_eq!(
        count(&kernels, "flash_backward_q_bf16_64"),
        1,
        "{kernels:?}"
    );
    let kernels = check_against_reference(d, DType::BF16, (1, 128, 64), false);
    assert_eq!(count(&kernels, "cudnn sdpa"), 0, "one query: {kernels:?}");
    assert_eq!(count(&kernels, "flash_forward_bf16_64"), 1, "{kernels:?}");
    let kernels = check_against_reference(d, DType::F16, (20, 128, 36), false);
    assert_eq!(count(&kernels, "cudnn sdpa"), 0, "head 36: {kernels:?}");
    assert_eq!(
        count(&kernels, "attn_forward_f16"),
        1,
        "head 36: {kernels:?}"
    );
    let kernels = check_against_reference(d, DType::F32, (20, 128, 64), false);
    assert_eq!(count(&kernels, "cudnn sdpa"), 0, "f32: {kernels:?}");
}

/// With the switch off the flash kernels run the problems cuDNN would take.
#[test]
fn the_switch_off_keeps_the_engines_kernels() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(false);
    assert!(!cudnn_attention());
    let kernels = check_against_reference(d, DType::BF16, (64, 128, 64), true);
    assert_eq!(count(&kernels, "cudnn sdpa"), 0, "{kernels:?}");
    assert_eq!(count(&kernels, "flash_forward_bf16_64"), 1, "{kernels:?}");
}

/// A plan cuDNN finalized but refuses to run (the emulated cuDNN does so with
/// MANTISSA_EMU_GRAPH_EXECUTE=not-supported) falls back to the flash kernels with the same
/// results, and the problem is not asked again once cuDNN would run it.
#[test]
fn a_plan_refused_at_run_time_falls_back_and_is_remembered() {
    let Some(d) = gpu() else {
        return;
    };
    if !emulated(d) {
        eprintln!("skipped: the refusal is the emulated cuDNN's");
        return;
    }
    let _k = FusedKernel::take(true);
    // A shape no other test uses: plans, and refusals, are remembered per problem.
    let sizes = (96, 256, 64);
    std::env::set_var("MANTISSA_EMU_GRAPH_EXECUTE", "not-supported");
    let refused = check_against_reference(d, DType::BF16, sizes, true);
    std::env::remove_var("MANTISSA_EMU_GRAPH_EXECUTE");
    let again = check_against_reference(d, DType::BF16, sizes, true);
    for kernels in [refused, again] {
        assert_eq!(count(&kernels, "cudnn sdpa"), 0, "{kernels:?}");
        assert_eq!(count(&kernels, "flash_forward_bf16_64"), 1, "{kernels:?}");
        assert_eq!(
            count(&kernels, "flash_backward_kv_bf16_64"),
            1,
            "{kernels:?}"
        );
    }
}

/// The heads of one packed `[B, T, 3 H e]` product (as a GPT splits them) go to cuDNN where
/// they lie: the forward is the one cuDNN call, no copy; values and the product's gradient
/// match the f32 composition.
#[test]
fn the_heads_of_a_packed_product_reach_cudnn_in_place() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(true);
    let (b, t, h, e) = (2, 128, 2, 64);
    for causal in [true, false] {
        let got = packed_heads(d, DType::BF16, (b, t, h, e), causal, 51);
        let (forward, backward) = (got.forward, got.backward);
        let got = got.values;
        let mask = if causal { " causal" } else { "" };
        let call = format!("cudnn sdpa fwd b{b} h{h} l{t} s{t} e{e} BF16{mask}");
        assert_eq!(forward, [call], "causal {causal}");
        assert_eq!(count(&backward, "cudnn sdpa bwd"), 1, "{backward:?}");
        let want = packed_heads(Device::Cpu, DType::F32, (b, t, h, e), causal, 51).values;
        let what = format!("causal {causal}");
        assert_close(&got[0], &want[0], band(DType::BF16), &format!("{what}: y"));
        let what = format!("{what}: the packed product's gradient");
        assert_close(&got[1], &want[1], band(DType::BF16), &what);
    }
}
