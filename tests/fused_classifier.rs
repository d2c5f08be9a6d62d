//! The cross-entropy over a vocabulary as a GPT's loss uses it, on the CPU and, where there
//! is one, the CUDA device (the emulated one in CI): under autocast, f16/bf16 logits are read
//! as they are, with the loss and gradient of the f32 cast PyTorch's autocast makes, bit for
//! bit; the logits' gradient is written over the logits when nothing else holds them (less
//! memory at the peak), and never when something does (the logits are unchanged), when the
//! graph is kept, or when they were written in place after the forward.

use mantissa::*;

/// The CPU, and the CUDA device when there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(g) => d.push(g),
        Err(e) => eprintln!("skipped on CUDA: no CUDA device ({e})"),
    }
    d
}

/// Logits `[b, t, v]` of normal values times 3 in `dtype` on `d`, a leaf requiring grad.
fn logits(shape: &[usize], dtype: DType, d: Device, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn_with(shape, 0.0, 3.0, DType::F32, Device::Cpu, &mut g)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(d)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// Targets `[b, t]` in `[0, v)`, every fifth one `ignore`.
fn targets(b: usize, t: usize, v: usize, ignore: i64, d: Device) -> Tensor {
    let ids: Vec<i64> = (0..b * t)
        .map(|i| match i % 5 {
            4 => ignore,
            _ => ((i * 7919 + 13) % v) as i64,
        })
        .collect();
    Tensor::from_vec(ids, &[b, t], d).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn under_autocast_half_logits_give_the_loss_and_gradient_of_their_f32_cast() {
    let opts = CrossEntropyOptions {
        ignore_index: -1,
        label_smoothing: 0.1,
        ..Default::default()
    };
    for d in devices() {
        for low in [DType::BF16, DType::F16] {
            let (b, t, v) = (3, 5, 37);
            let y = targets(b, t, v, -1, d);
            // What autocast did before: the logits cast to f32, the loss taken of those, the
            // cast's backward rounding the f32 gradient to the logits' dtype.
            let a = logits(&[b, t, v], low, d, 7);
            let want = a
                .to_dtype(DType::F32)
                .unwrap()
                .cross_entropy(&y, opts)
                .unwrap();
            want.backward().unwrap();
            let x = logits(&[b, t, v], low, d, 7);
            let got = amp::with_autocast(low, || x.cross_entropy(&y, opts))
                .unwrap()
                .unwrap();
            assert_eq!(
                got.dtype(),
                DType::F32,
                "{d:?} {low:?}: autocast's loss is f32"
            );
            assert_eq!(bits(&got), bits(&want), "{d:?} {low:?}: loss");
            got.backward().unwrap();
            let (gx, ga) = (x.grad().unwrap(), a.grad().unwrap());
            assert_eq!(gx.dtype(), low, "{d:?} {low:?}: the gradient's dtype");
            assert_eq!(bits(&gx), bits(&ga), "{d:?} {low:?}: gradient");
            // Outside autocast a half loss stays half, as PyTorch's does.
            let plain = x.cross_entropy(&y, opts).unwrap();
            assert_eq!(plain.dtype(), low, "{d:?} {low:?}: outside autocast");
        }
    }
}

/// `h [rows, c] @ w [c, v]` as `[b, t, v]` logits: their producer's backward reads `h` and
/// `w`, not the logits, so the loss's backward is their only reader.
fn head(d: Device, (b, t, c, v): (usize, usize, usize, usize)) -> (Tensor, Tensor, Tensor) {
    let h = logits(&[b * t, c], DType::F32, d, 1);
    let w = logits(&[c, v], DType::F32, d, 2).mul(0.2).unwrap();
    let w = w.detach().requires_grad(true).unwrap();
    let z = h.matmul(&w).unwrap().reshape(&[b, t, v]).unwrap();
    (h, w, z)
}

/// One backward of the loss of `head`'s logits, with the logits held by the caller through
/// it or dropped before: the gradients of `h` and `w`, and the most memory the backward had
/// allocated above what there was before it (0 on the CPU).
fn backward_of_head(d: Device, shape: (usize, usize, usize, usize), hold: bool) -> [Tensor; 3] {
    let (b, t, _, v) = shape;
    let y = targets(b, t, v, -100, d);
    let (h, w, z) = head(d, shape);
    let before = bits(&z);
    let loss = z.cross_entropy(&y, Default::default()).unwrap();
    let held = hold.then_some(z);
    if d != Device::Cpu {
        memory::reset_peak_memory_stats(d).unwrap();
    }
    let base = memory_now(d);
    loss.backward().unwrap();
    let peak = peak_since(d, base);
    if let Some(z) = held {
        assert_eq!(bits(&z), before, "{d:?}: held logits changed by backward");
    }
    let peak = Tensor::scalar(peak as f64, DType::F64, Device::Cpu).unwrap();
    [h.grad().unwrap(), w.grad().unwrap(), peak]
}

#[test]
fn the_gradient_is_written_over_logits_only_the_loss_holds() {
    let shape = (2, 32, 16, 4096);
    let (b, t, _, v) = shape;
    let logit_bytes = (b * t * v * 4) as f64;
    for d in devices() {
        // A first round for what the device allocates once (library workspaces).
        backward_of_head(d, shape, true);
        let held = backward_of_head(d, shape, true);
        let dropped = backward_of_head(d, shape, false);
        for (i, what) in [(0, "h"), (1, "w")] {
            assert_eq!(
                bits(&held[i]),
                bits(&dropped[i]),
                "{d:?}: gradient of {what}"
            );
        }
        if d != Device::Cpu {
            // One [tokens, vocabulary] buffer fewer at the peak.
            let (hp, dp) = (held[2].item().unwrap(), dropped[2].item().unwrap());
            assert!(
                hp >= dp + logit_bytes * 0.9,
                "{d:?}: peak above the start {hp} B held, {dp} B dropped (logits \
                 {logit_bytes} B)"
            );
        }
    }
}

fn memory_now(d: Device) -> usize {
    match d != Device::Cpu {
        true => memory::memory_allocated(d).unwrap(),
        false => 0,
    }
}

fn peak_since(d: Device, base: usize) -> usize {
    match d != Device::Cpu {
        true => memory::max_memory_allocated(d).unwrap() - base,
        false => 0,
    }
}

#[test]
fn a_kept_graph_keeps_the_logits_for_its_second_backward() {
    let shape = (2, 4, 8, 33);
    for d in devices() {
        let y = targets(2, 4, 33, -100, d);
        let (h, _w, z) = head(d, shape);
        let loss = z.cross_entropy(&y, Default::default()).unwrap();
        drop(z);
        loss.backward_retain_graph().unwrap();
        let once: Vec<f32> = h.grad().unwrap().to_vec().unwrap();
        loss.backward().unwrap();
        let twice: Vec<f32> = h.grad().unwrap().to_vec().unwrap();
        let doubled: Vec<f32> = once.iter().map(|g| g * 2.0).collect();
        assert_eq!(twice, doubled, "{d:?}: the second backward's gradient");
    }
}

#[test]
fn logits_written_in_place_after_the_forward_are_refused_in_backward() {
    for d in devices() {
        let y = targets(2, 4, 33, -100, d);
        let (_h, _w, z) = head(d, (2, 4, 8, 33));
        let loss = z.cross_entropy(&y, Default::default()).unwrap();
        no_grad(|| z.fill_(0.5)).unwrap();
        drop(z);
        let e = loss.backward().unwrap_err().to_string();
        assert!(
            e.contains("cross_entropy") && e.contains("modified in place"),
            "{d:?}: {e}"
        );
    }
}
