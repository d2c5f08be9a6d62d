//! `packed_attention` (attention over the heads of one `[B, T, 3C]` q/k/v product, heads
//! merged back to `[B, T, C]`) against the composition a GPT writes (`split`, heads as
//! transposed views, `scaled_dot_product_attention`, heads merged): the same bits forward
//! and backward, on the fused op (one node whose backward concatenates the three gradients:
//! no `narrow` backward) and on the composition it falls back to (a mask), under autocast
//! too; on the CPU and, where there is one, the CUDA device (the emulated one in CI). Bad
//! shapes are refused by name.

mod common;
use common::vals;
use mantissa::profiler;
use mantissa::*;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The CPU, and the CUDA device when there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(g) => d.push(g),
        Err(e) => eprintln!("skipped on CUDA: no CUDA device ({e})"),
    }
    d
}

/// The composition: q, k and v split off `qkv`, as `[B, heads, T, e]` views.
fn composed(qkv: &Tensor, heads: usize, o: AttentionOptions<'_>) -> Result<Tensor> {
    let (b, t, c) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let parts: Vec<Tensor> = qkv
        .split(c, 2)?
        .iter()
        .map(|x| x.reshape(&[b, t, heads, c / heads])?.transpose(1, 2))
        .collect::<Result<_>>()?;
    let y = parts[0].scaled_dot_product_attention(&parts[1], &parts[2], o)?;
    y.transpose(1, 2)?.reshape(&[b, t, c])
}

/// `y` and the gradient of `sum(y * w)` for `qkv [B, T, 3C]` of `dt` on `d` through `f`, with
/// the names of the ops the profile saw.
fn run(
    d: Device,
    dt: DType,
    (b, t, c): (usize, usize, usize),
    f: impl Fn(&Tensor) -> Result<Tensor>,
) -> (Vec<f64>, Vec<f64>, Vec<String>) {
    let mut g = Generator::new((b * t + c) as u64);
    let qkv = Tensor::randn_with(&[b, t, 3 * c], 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
        .and_then(|x| x.to_dtype(dt))
        .and_then(|x| x.to_device(d))
        .and_then(|x| x.requires_grad(true))
        .unwrap();
    let w = Tensor::randn_with(&[b, t, c], 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
        .and_then(|x| x.to_device(d))
        .unwrap();
    let (y, p) = profiler::profile(|_| {
        let y = f(&qkv).unwrap();
        let loss = y
            .to_dtype(DType::F32)
            .unwrap()
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap();
        loss.backward().unwrap();
        y
    })
    .unwrap();
    let ops = p.ops().iter().map(|o| o.name.clone()).collect();
    (vals(&y), vals(&qkv.grad().unwrap()), ops)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn packed_attention_is_the_split_composition_bit_for_bit() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    set_attention_kernel(AttentionKernel::Fused);
    for d in devices() {
        let dts: &[DType] = if d == Device::Cpu {
            &[DType::F32]
        } else {
            &[DType::BF16, DType::F16, DType::F32]
        };
        for &dt in dts {
            // Head 64 (the tensor-core kernels and cuDNN on CUDA), head 16 (the tiled kernel).
            for (sizes, heads) in [((2, 128, 128), 2), ((2, 37, 48), 3)] {
                for causal in [true, false] {
                    let what = format!("{d:?} {dt:?} {sizes:?} heads {heads} causal {causal}");
                    let o = AttentionOptions {
                        is_causal: causal,
                        ..Default::default()
                    };
                    let (y, gp, ops) = run(d, dt, sizes, |x| x.packed_attention(heads, o));
                    let (yc, gc, ops_c) = run(d, dt, sizes, |x| composed(x, heads, o));
                    assert_eq!(bits(&y), bits(&yc), "{what}: y");
                    assert_eq!(bits(&gp), bits(&gc), "{what}: the gradient");
                    let has = |ops: &[String], name: &str| ops.iter().any(|o| o == name);
                    assert!(!has(&ops, "narrow.backward"), "{what}: {ops:?}");
                    assert!(has(&ops, "packed_attention.backward"), "{what}: {ops:?}");
                    assert!(has(&ops_c, "narrow.backward"), "{what}: {ops_c:?}");
                }
            }
        }
    }
    set_attention_kernel(AttentionKernel::Auto);
}

/// With a mask (which the fused op does not take) it is the composition itself, and under
/// bf16 autocast from f32 the fused op's gradient comes back in f32, bit for bit as the
/// composition's.
#[test]
fn masks_fall_back_and_autocast_casts_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for d in devices() {
        let sizes = (2, 16, 32);
        let mask = Tensor::ones(&[16, 16], DType::U8, d)
            .unwrap()
            .tril(0)
            .unwrap();
        let o = AttentionOptions {
            attn_mask: Some(&mask),
            ..Default::default()
        };
        let (y, g, ops) = run(d, DType::F32, sizes, |x| x.packed_attention(2, o));
        let (yc, gc, _) = run(d, DType::F32, sizes, |x| composed(x, 2, o));
        assert_eq!((bits(&y), bits(&g)), (bits(&yc), bits(&gc)), "{d:?} masked");
        assert!(
            !ops.iter().any(|o| o == "packed_attention.backward"),
            "{ops:?}"
        );
        if d == Device::Cpu || !d.supports_bf16().unwrap_or(false) {
            continue;
        }
        set_attention_kernel(AttentionKernel::Fused);
        let o = AttentionOptions {
            is_causal: true,
            ..Default::default()
        };
        let packed = |x: &Tensor| {
            let _bf16 = amp::autocast(DType::BF16)?;
            x.packed_attention(2, o)
        };
        let comp = |x: &Tensor| {
            let _bf16 = amp::autocast(DType::BF16)?;
            composed(x, 2, o)
        };
        let (y, g, ops) = run(d, DType::F32, (2, 128, 128), packed);
        let (yc, gc, _) = run(d, DType::F32, (2, 128, 128), comp);
        set_attention_kernel(AttentionKernel::Auto);
        assert!(
            ops.iter().any(|o| o == "packed_attention.backward"),
            "{ops:?}"
        );
        assert_eq!((bits(&y), bits(&g)), (bits(&yc), bits(&gc)), "autocast");
    }
}

#[test]
fn bad_shapes_are_refused_by_name() {
    let x = Tensor::zeros(&[2, 3, 10], DType::F32, Device::Cpu).unwrap();
    let o = AttentionOptions::default();
    for (t, heads) in [
        (&x, 2),
        (&x.narrow(2, 0, 9).unwrap(), 2),
        (&x.narrow(2, 0, 6).unwrap(), 4),
    ] {
        let err = t.packed_attention(heads, o).unwrap_err().to_string();
        assert!(err.contains("packed_attention"), "{err}");
    }
    let e = x
        .narrow(2, 0, 6)
        .unwrap()
        .packed_attention(0, o)
        .unwrap_err();
    assert!(e.to_string().contains("packed_attention"), "{e}");
}
