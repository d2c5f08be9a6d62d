//! The tensor-core attention kernels (`cuda/flash.cu`, FlashAttention-2's arrangement on
//! `mma.sync`) against the composition in f32: f16 and bf16, head sizes 64 and 128, causal
//! and not, with query and key counts that are not multiples of a tile and either larger.
//! The output and the three gradients are compared with the f32 composition of the same
//! rounded inputs on the CPU; the profiler shows that the flash kernels ran (not the
//! one-thread-per-row fallback), and a second backward repeats the first bit for bit (no
//! atomics). Other head sizes keep the fallback. cuDNN's fused attention, which would take
//! these problems first, is switched off here (its tests: cudnn_attention.rs). On the
//! emulated device in CI (its `mma.sync`
//! exchanges a warp's fragments through memory, tests/emulator/host_shim.h); without a
//! CUDA device each test prints `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]

mod common;
use common::attention::{
    attend, band, check_against_reference, elementwise, packed_heads, reference, FusedKernel,
};
use common::parity::{gpu, input};
use common::{assert_close, vals};
use mantissa::profiler;
use mantissa::*;

fn tname(dt: DType) -> &'static str {
    if dt == DType::F16 {
        "f16"
    } else {
        "bf16"
    }
}

#[test]
fn flash_attention_matches_the_f32_composition() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(false);
    // More keys than a tile and fewer queries; more queries than keys (causal rows past the
    // last key see every key); one query; at head 64 (64 keys a tile) also three and four
    // key tiles, so that the forward's and dq's two stages are each filled again.
    let shapes = [
        (37, 70, true),
        (130, 77, false),
        (77, 45, true),
        (1, 9, false),
    ];
    let wide = [(70, 200, false), (200, 200, true)];
    for dt in [DType::BF16, DType::F16] {
        for e in [64, 128] {
            let more = if e == 64 { &wide[..] } else { &[] };
            for &(l, s, causal) in shapes.iter().chain(more) {
                let what = format!("{dt:?} head {e}, {l} queries x {s} keys, causal {causal}");
                let kernels = check_against_reference(d, dt, (l, s, e), causal);
                for kernel in ["flash_forward_", "flash_backward_kv_", "flash_backward_q_"] {
                    let name = format!("{kernel}{}_{e}", tname(dt));
                    assert!(
                        kernels.iter().any(|k| k.starts_with(&name)),
                        "{what}: {name} did not run: {kernels:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn flash_backward_repeats_bit_for_bit() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(false);
    let a = attend(d, DType::BF16, (100, 130, 64), true);
    let b = attend(d, DType::BF16, (100, 130, 64), true);
    for (x, y) in a.values.iter().zip(&b.values) {
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(x), bits(y));
    }
}

#[test]
fn other_head_sizes_and_f32_keep_the_one_row_a_thread_kernels() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(false);
    for (dt, e) in [(DType::BF16, 96), (DType::F32, 64)] {
        let got = attend(d, dt, (20, 30, e), true);
        let flash = got
            .kernels
            .iter()
            .filter(|k| k.starts_with("flash_"))
            .count();
        assert_eq!(flash, 0, "{dt:?} head {e}: {:?}", got.kernels);
        assert!(
            got.kernels.iter().any(|k| k.starts_with("attn_forward_")),
            "{dt:?} head {e}: {:?}",
            got.kernels
        );
        let want = reference(dt, (20, 30, e), true);
        let tol = if dt == DType::F32 { 1e-5 } else { band(dt) };
        assert_close(&got.values[0], &want[0], tol, &format!("{dt:?} head {e}"));
    }
}

/// The heads of one packed `[B, T, 3 H e]` product, as a GPT splits them: q, k and v are
/// transposed `[B, H, T, e]` views, which the kernels read where they lie, and the output
/// comes laid out as `[B, T, H, e]`, so that merging the heads back is a view too: the
/// forward is the flash kernel alone, no copy. Values and the product's gradient match the
/// f32 composition.
#[test]
fn the_heads_of_a_packed_product_are_read_and_written_in_place() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(false);
    let (b, t, h, e) = (2, 70, 2, 64);
    for causal in [true, false] {
        let got = packed_heads(d, DType::BF16, (b, t, h, e), causal, 31);
        assert_eq!(got.forward, ["flash_forward_bf16_64"], "causal {causal}");
        let (got, want) = (
            got.values,
            packed_heads(Device::Cpu, DType::F32, (b, t, h, e), causal, 31).values,
        );
        assert_close(
            &got[0],
            &want[0],
            band(DType::BF16),
            &format!("causal {causal}: y"),
        );
        let what = format!("causal {causal}: the packed product's gradient");
        assert_close(&got[1], &want[1], band(DType::BF16), &what);
    }
}

/// Views the kernels cannot read in place (rows not 16-byte aligned: narrows of 65-wide
/// tensors) are copied first, and three-dimensional `[B, T, e]` inputs give a contiguous
/// output: both match the f32 composition, on the flash kernels.
#[test]
fn unaligned_and_three_dimensional_inputs() {
    let Some(d) = gpu() else {
        return;
    };
    let _k = FusedKernel::take(false);
    let (b, l, s) = (3, 40, 50);
    let run = |d: Device, dt: DType| -> (Vec<Vec<f64>>, Vec<String>) {
        let make = |rows: usize, seed: u64| {
            input(&[b, rows, 65], DType::BF16, seed)
                .to_dtype(dt)
                .unwrap()
                .to_device(d)
                .unwrap()
                .copy()
                .unwrap()
                .requires_grad(true)
                .unwrap()
        };
        let (q, kv) = (make(l, 41), make(s, 42));
        // q: columns 1..65 (offset 1); k and v: columns 0..64 of one tensor (rows 65 apart).
        let qv = q.narrow(2, 1, 64).unwrap();
        let kv64 = kv.narrow(2, 0, 64).unwrap();
        let w = input(&[b, l, 64], DType::BF16, 43).to_dtype(dt).unwrap();
        let w = w.to_device(d).unwrap();
        if dt == DType::F32 {
            set_attention_kernel(AttentionKernel::Composed);
        }
        let opts = AttentionOptions {
            is_causal: true,
            ..Default::default()
        };
        let (y, p) = profiler::profile(|_| {
            let y = qv.scaled_dot_product_attention(&kv64, &kv64, opts).unwrap();
            y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            y
        })
        .unwrap();
        set_attention_kernel(AttentionKernel::Fused);
        assert!(
            y.is_contiguous(),
            "{dt:?}: a three-dimensional output is contiguous"
        );
        let kernels = p.kernels().iter().map(|k| k.name.clone()).collect();
        let values = vec![
            vals(&y),
            vals(&q.grad().unwrap()),
            vals(&kv.grad().unwrap()),
        ];
        (values, kernels)
    };
    let (got, kernels) = run(d, DType::BF16);
    for name in ["flash_forward_bf16_64", "flash_backward_q_bf16_64"] {
        assert!(kernels.iter().any(|k| k == name), "{name}: {kernels:?}");
    }
    let (want, _) = run(Device::Cpu, DType::F32);
    for (i, name) in ["y", "dq", "dk + dv"].iter().enumerate() {
        assert_close(&got[i], &want[i], band(DType::BF16), name);
        elementwise(&got[i], &want[i], band(DType::BF16), name);
    }
}
