//! The data-parallel wrapper's buckets on the CUDA device (the emulated one in CI, with
//! `MANTISSA_EMU_DEVICES=4`; ranks as threads, as in `tests/data_parallel.rs`): each
//! gradient is a view of its bucket's buffer, the same storage every step, which the loss
//! scaler, clipping and the fused optimizer read and write where it lies (the list kernels
//! walk ranges of the bucket), with the same numbers as without the wrapper; parameters and
//! buffers go from rank 0 to every rank in one collective per dtype. Without enough devices
//! each test prints `skipped` and passes.
#![cfg(feature = "cuda-backend")]

use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::distributed::{DistributedDataParallel, LaunchEnv, Launcher, ProcessGroup};
use mantissa::optim::{clip_grad_norm, Optimizer, Sgd, SgdConfig};
use mantissa::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One test at a time: the ranks of a test use devices 0..world, and the profiler is global.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// True when there are `n` CUDA devices; else says the test is skipped.
fn devices(n: usize) -> bool {
    match Device::cuda(n - 1) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: {n} CUDA devices needed ({e})");
            false
        }
    }
}

/// `world` ranks as threads, rank r on `cuda:r`, joined through the rendezvous on a free
/// loopback port; each runs `f`. `None` (skipped) without `world` devices.
fn ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(ProcessGroup) -> Result<R> + Send + Sync + 'static,
) -> Option<Vec<Result<R>>> {
    if !devices(world) {
        return None;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let f = Arc::new(f);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let env = LaunchEnv {
                    launcher: Launcher::Torchrun,
                    rank,
                    world_size: world,
                    local_rank: rank,
                    master_addr: "127.0.0.1".into(),
                    port,
                    job: "data_parallel_buckets".into(),
                };
                let pg = ProcessGroup::init(&env, Device::Cuda(rank), Duration::from_secs(30))?;
                f(pg)
            })
        })
        .collect();
    Some(threads.into_iter().map(|t| t.join().unwrap()).collect())
}

/// A channels-last convolution weight and its bias, a vector, and a parameter no loss
/// reaches, on `d`; `shift` moves every value (a rank's own start before the broadcast).
fn params(d: Device, shift: f64) -> Vec<Tensor> {
    let g = &mut Generator::new(9);
    let mut randn = |shape: &[usize]| {
        Tensor::randn_with(shape, 0.0, 1.0, DType::F32, Device::Cpu, g)
            .unwrap()
            .add(shift)
            .unwrap()
            .to_device(d)
            .unwrap()
    };
    let w = randn(&[4, 3, 3, 3])
        .to_memory_format(MemoryFormat::ChannelsLast)
        .unwrap();
    let ps = [w, randn(&[4]), randn(&[5]), randn(&[3])];
    ps.into_iter()
        .map(|t| t.requires_grad(true).unwrap())
        .collect()
}

/// A channels-last batch of 2 for step `k` of rank `rank`.
fn input(d: Device, rank: usize, k: usize) -> Tensor {
    let g = &mut Generator::new(100 + 10 * rank as u64 + k as u64);
    Tensor::randn_with(&[2, 3, 5, 5], 0.0, 1.0, DType::F32, Device::Cpu, g)
        .unwrap()
        .to_device(d)
        .unwrap()
        .to_memory_format(MemoryFormat::ChannelsLast)
        .unwrap()
}

fn loss(p: &[Tensor], x: &Tensor) -> Result<Tensor> {
    let y = x.conv2d(&p[0], Some(&p[1]), Default::default())?;
    y.sqr()?.sum_all()?.mul(&p[2].sum_all()?)
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

/// One step: the scaled backward, unscale, clipping and the scaler's step.
fn step(
    p: &[Tensor],
    opt: &mut Sgd,
    scaler: &mut GradScaler,
    x: &Tensor,
    after: &mut dyn FnMut(&str),
) -> Result<()> {
    opt.zero_grad();
    scaler.scale(&loss(p, x)?)?.backward()?;
    after("backward");
    scaler.unscale_(opt)?;
    after("unscale_");
    clip_grad_norm(p, 0.5)?;
    after("clip_grad_norm");
    scaler.step(opt)?;
    scaler.update()?;
    after("the step");
    Ok(())
}

fn optimizer(p: &[Tensor]) -> (Sgd, GradScaler) {
    let cfg = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.05)
    };
    let scaler = GradScaler::new(GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    });
    (Sgd::new(p.to_vec(), cfg).unwrap(), scaler.unwrap())
}

/// Whether each gradient of bucket `b` shares the storage of the first one's.
fn in_buckets(p: &[Tensor], buckets: &[Vec<usize>]) -> bool {
    buckets.iter().all(|b| {
        let first = p[b[0]].grad().unwrap();
        b.iter()
            .all(|&i| p[i].grad().unwrap().shares_storage(&first))
    })
}

#[test]
fn a_world_of_one_reads_gradients_in_their_bucket_with_the_same_numbers() {
    let _s = serial();
    if !devices(1) {
        return;
    }
    let d = Device::Cuda(0);
    let plain = params(d, 0.0);
    let wrapped = params(d, 0.0);
    // One bucket for all four, in reverse order: gradients 3, 2, 1 and 0 at offsets 0, 3, 8
    // and 12 of its buffer.
    let pg = ProcessGroup::single(d);
    let ddp = DistributedDataParallel::with_bucket_cap(&pg, &wrapped, 4096).unwrap();
    let buckets = ddp.bucket_params();
    assert_eq!(buckets, vec![vec![3, 2, 1, 0]]);
    let (mut opt_p, mut sc_p) = optimizer(&plain);
    let (mut opt_w, mut sc_w) = optimizer(&wrapped);
    let mut first: Option<Tensor> = None;
    // Launches (and library calls) of the second step, without and with the wrapper.
    let mut launches = [0u64; 2];
    let count = |f: &mut dyn FnMut() -> Result<()>| {
        let prof = mantissa::profiler::Profiler::start().unwrap();
        f().unwrap();
        prof.step();
        let s = prof.stop().unwrap().steps()[0];
        s.launches + s.library_calls
    };
    for k in 0..2 {
        let x = input(d, 0, k);
        launches[0] = count(&mut || step(&plain, &mut opt_p, &mut sc_p, &x, &mut |_| {}));
        let mut check = |when: &str| {
            assert!(in_buckets(&wrapped, &buckets), "step {k}, after {when}");
            let g = wrapped[0].grad().unwrap();
            assert!(g.is_channels_last(), "step {k}, after {when}");
            // The same buffer every step.
            let kept = first.get_or_insert_with(|| g.clone());
            assert!(
                g.shares_storage(kept),
                "step {k}, after {when}: a new buffer"
            );
        };
        launches[1] = count(&mut || step(&wrapped, &mut opt_w, &mut sc_w, &x, &mut check));
        // Bit for bit: the list kernels read the bucket's ranges as they read whole tensors.
        for (i, (a, b)) in plain.iter().zip(&wrapped).enumerate() {
            assert_eq!(host(a), host(b), "step {k}: parameter {i}");
        }
        for i in 0..3 {
            let (a, b) = (plain[i].grad().unwrap(), wrapped[i].grad().unwrap());
            assert_eq!(host(&a), host(&b), "step {k}: gradient {i}");
        }
        assert_eq!(host(&wrapped[3].grad().unwrap()), vec![0.0; 3]);
    }
    eprintln!("second step: {launches:?} launches without and with the wrapper");
    // The wrapper adds one launch to the step: the copy of the gradients into the bucket, in
    // one list (the zeros of the parameter backward does not reach are a memset). The
    // scaler, clipping and the optimizer copy nothing, and take the unused parameter in the
    // launches they make anyway.
    assert!(
        launches[1] <= launches[0] + 1,
        "{} launches with the wrapper, {} without",
        launches[1],
        launches[0]
    );
}

#[test]
fn gradients_are_views_of_one_bucket_buffer_on_every_rank() {
    let _s = serial();
    let Some(out) = ranks(2, |pg| {
        let d = pg.device();
        let p = params(d, pg.rank() as f64);
        // Small buckets: [3, 2, 1] and [0].
        let ddp = DistributedDataParallel::with_bucket_cap(&pg, &p, 64)?;
        let buckets = ddp.bucket_params();
        assert_eq!(buckets, vec![vec![3, 2, 1], vec![0]]);
        let (mut opt, mut sc) = optimizer(&p);
        let mut kept: Vec<Tensor> = Vec::new();
        for k in 0..2 {
            let x = input(d, pg.rank(), k);
            step(&p, &mut opt, &mut sc, &x, &mut |when| {
                assert!(in_buckets(&p, &buckets), "step {k}, after {when}");
                if k == 1 {
                    for (g, p) in kept.iter().zip(&p) {
                        assert!(g.shares_storage(&p.grad().unwrap()), "after {when}");
                    }
                }
            })?;
            kept = p.iter().map(|t| t.grad().unwrap()).collect();
            assert!(kept[0].is_channels_last());
        }
        let grads: Vec<Vec<f32>> = kept.iter().map(host).collect();
        Ok((p.iter().map(host).collect::<Vec<_>>(), grads))
    }) else {
        return;
    };
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    // Every rank holds the same (averaged) gradients and parameters, bit for bit.
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o, &out[0], "rank {rank} differs from rank 0");
    }
}

#[test]
fn parameters_and_buffers_go_from_rank_0_in_one_broadcast_per_dtype() {
    let _s = serial();
    if !devices(4) {
        return;
    }
    // Each rank's own values: rank r's are shifted by r.
    let make = |d: Device, r: usize| -> (Vec<Tensor>, Vec<Tensor>) {
        let shift = r as f64;
        let p = params(d, shift);
        let half = Tensor::full(&[6], 1.5 + shift, DType::F16, d)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let mut ps = p;
        ps.push(half);
        let mean = Tensor::full(&[3], 0.25 + shift, DType::F32, d).unwrap();
        // A transposed buffer (copied back through its strides), an i64 count and a bf16.
        let var = Tensor::arange(0.0, 6.0, 1.0, DType::F32, d)
            .unwrap()
            .add(shift)
            .unwrap()
            .reshape(&[2, 3])
            .unwrap()
            .t()
            .unwrap();
        let count = Tensor::from_vec(vec![7 + r as i64], &[1], d).unwrap();
        let low = Tensor::full(&[2], -2.0 - shift, DType::BF16, d).unwrap();
        (ps, vec![mean, var, count, low])
    };
    let prof = mantissa::profiler::Profiler::start().unwrap();
    let out = ranks(4, move |pg| {
        let (ps, bufs) = make(pg.device(), pg.rank());
        let ddp = DistributedDataParallel::new(&pg, &ps)?;
        ddp.broadcast_buffers(&bufs)?;
        let all: Vec<Vec<f64>> = ps
            .iter()
            .chain(&bufs)
            .map(|t| t.to_vec_f64())
            .collect::<Result<_>>()?;
        Ok(all)
    })
    .unwrap();
    let profile = prof.stop().unwrap();
    let (ps0, bufs0) = make(Device::Cuda(0), 0);
    let want: Vec<Vec<f64>> = ps0
        .iter()
        .chain(&bufs0)
        .map(|t| t.to_vec_f64().unwrap())
        .collect();
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(
            r.unwrap(),
            want,
            "rank {rank} holds other values than rank 0's"
        );
    }
    // Per rank: parameters in f32 and f16 (two), buffers in f32, i64 and bf16 (three).
    let broadcasts = profile.op("ddp.broadcast").map_or(0, |o| o.count);
    assert_eq!(broadcasts, 4 * 5, "collectives over 4 ranks");
}
