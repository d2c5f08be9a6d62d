//! Batch norm outputs made again in backward instead of kept (`autograd::set_recompute`): the
//! gradients equal the kept run's bit for bit (f32, fp16 autocast, NCHW and channels-last),
//! the forward keeps less by exactly the recomputed outputs' bytes, an in-place write to a
//! batch norm's input is refused, and on a GPU (the emulated device in CI) the default policy
//! recomputes there. A binary of its own, its tests one at a time: the policy is process-wide.

mod common;
use mantissa::autograd::{recompute, set_recompute, Recompute};
use mantissa::nn::{Activation, BatchNorm2d, Checkpointed, Conv2d, Module, Sequential};
use mantissa::*;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the lock and puts the default policy back when dropped.
struct Policy(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl Policy {
    fn take() -> Policy {
        Policy(SERIAL.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        set_recompute(Recompute::Gpu);
    }
}

/// conv 3x3 -> batch norm + ReLU -> conv 3x3 -> batch norm -> conv 1x1: two batch norm
/// outputs that a convolution reads in backward (the ReLU fused into the first).
fn net(device: Device, format: MemoryFormat) -> Result<Sequential> {
    let mut g = Generator::new(3);
    let pad = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    let mut m = Sequential::new()
        .push(Conv2d::new(3, 8, 3, pad, false, &mut g)?)
        .push(BatchNorm2d::new(8)?)
        .push(Activation::Relu)
        .push(Conv2d::new(8, 8, 3, pad, false, &mut g)?)
        .push(BatchNorm2d::new(8)?)
        .push(Conv2d::new(
            8,
            5,
            1,
            Conv2dOptions::default(),
            true,
            &mut g,
        )?);
    m.to_device(device)?;
    m.to_memory_format(format)?;
    Ok(m)
}

/// One forward and backward under `policy`: the bytes the forward kept (live storage after
/// the loss minus before the forward), the loss and every gradient (parameters, then input).
fn run(
    device: Device,
    format: MemoryFormat,
    policy: Recompute,
    autocast: Option<DType>,
) -> Result<(i64, Vec<f32>, Vec<Vec<f32>>)> {
    run_net(device, format, policy, autocast, false)
}

/// [`run`], with the network under gradient checkpointing when `checkpointed`.
fn run_net(
    device: Device,
    format: MemoryFormat,
    policy: Recompute,
    autocast: Option<DType>,
    checkpointed: bool,
) -> Result<(i64, Vec<f32>, Vec<Vec<f32>>)> {
    set_recompute(policy);
    let m: Box<dyn Module> = match checkpointed {
        true => Box::new(Checkpointed::new(net(device, format)?)),
        false => Box::new(net(device, format)?),
    };
    let mut g = Generator::new(4);
    let x = Tensor::randn_with(&[2, 3, 6, 7], 0.0, 1.0, DType::F32, device, &mut g)?
        .to_memory_format(format)?
        .requires_grad(true)?;
    let w = Tensor::randn_with(&[2, 5, 6, 7], 0.0, 1.0, DType::F32, device, &mut g)?;
    let before = live_storage_bytes() as i64;
    let loss = {
        let _ac = autocast.map(amp::autocast).transpose()?;
        m.forward(&x)?.to_dtype(DType::F32)?.mul(&w)?.sum_all()?
    };
    let kept = live_storage_bytes() as i64 - before;
    loss.backward()?;
    let mut grads = Vec::new();
    for p in m.parameters().iter().chain([&x]) {
        let g = p
            .grad()
            .expect("every parameter and the input get a gradient");
        grads.push(g.to_dtype(DType::F32)?.contiguous()?.to_vec::<f32>()?);
    }
    Ok((kept, loss.to_vec::<f32>()?, grads))
}

fn check_same_gradients(device: Device, on: Recompute) {
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        for autocast in [None, Some(DType::F16)] {
            let what = format!("{device:?} {format:?} autocast {autocast:?}");
            let (kept_all, loss_a, grads_a) =
                run(device, format, Recompute::Never, autocast).unwrap();
            let (kept_less, loss_b, grads_b) = run(device, format, on, autocast).unwrap();
            assert_eq!(loss_a, loss_b, "{what}: loss");
            assert_eq!(grads_a.len(), grads_b.len());
            for (i, (a, b)) in grads_a.iter().zip(&grads_b).enumerate() {
                assert!(a.iter().any(|v| *v != 0.0), "{what}: gradient {i} is zero");
                assert_eq!(a, b, "{what}: gradient {i} differs when recomputed");
            }
            // The two batch norm outputs, [2, 8, 6, 7] each, in the dtype the convolution
            // reads (f16 under autocast: the batch norm keeps its input's dtype).
            let size = if autocast.is_some() { 2 } else { 4 };
            assert_eq!(
                kept_all - kept_less,
                2 * 2 * 8 * 6 * 7 * size,
                "{what}: bytes kept ({kept_all} kept, {kept_less} recomputed)"
            );
        }
    }
}

#[test]
fn recomputed_outputs_give_the_kept_gradients_and_free_their_bytes() {
    let _p = Policy::take();
    check_same_gradients(Device::Cpu, Recompute::Always);
}

#[test]
fn a_checkpointed_network_gets_the_same_gradients_recomputed_or_kept() {
    let _p = Policy::take();
    let f = MemoryFormat::ChannelsLast;
    let (_, loss, plain) = run_net(Device::Cpu, f, Recompute::Never, None, false).unwrap();
    for policy in [Recompute::Never, Recompute::Always] {
        let (_, l, g) = run_net(Device::Cpu, f, policy, None, true).unwrap();
        assert_eq!(l, loss, "{policy:?}: loss");
        assert_eq!(g, plain, "{policy:?}: gradients under checkpointing");
    }
}

#[test]
fn the_default_keeps_everything_on_the_cpu() {
    let _p = Policy::take();
    assert_eq!(recompute(), Recompute::Gpu);
    let (kept_default, _, _) =
        run(Device::Cpu, MemoryFormat::Contiguous, Recompute::Gpu, None).unwrap();
    let (kept_all, _, _) = run(
        Device::Cpu,
        MemoryFormat::Contiguous,
        Recompute::Never,
        None,
    )
    .unwrap();
    assert_eq!(kept_default, kept_all);
}

#[test]
fn the_default_recomputes_on_a_gpu() {
    let _p = Policy::take();
    let Some(d) = common::parity::gpu() else {
        return;
    };
    // Bit for bit only through cuDNN's deterministic algorithms (the emulated device's
    // others sum in another order each run).
    let _deterministic = common::parity::CudnnDeterministic::on();
    check_same_gradients(d, Recompute::Gpu);
}

#[test]
fn an_in_place_write_to_the_batch_norms_input_is_refused() {
    let _p = Policy::take();
    set_recompute(Recompute::Always);
    let mut g = Generator::new(5);
    let x = Tensor::randn_with(&[2, 4, 3, 3], 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let w = Tensor::randn_with(&[4, 4, 1, 1], 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    // h is the batch norm's input; the convolution reads the batch norm's output.
    let h = x.mul(2.0).unwrap();
    let y = h
        .batch_norm(None, None, None, None, true, 0.1, 1e-5)
        .unwrap()
        .conv2d(&w, None, Conv2dOptions::default())
        .unwrap();
    no_grad(|| h.copy_(&h.add(1.0)?)).unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(
        e.contains("batch_norm") && e.contains("made again") && e.contains("modified in place"),
        "{e}"
    );
}
