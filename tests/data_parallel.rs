//! Data-parallel training ([`mantissa::distributed`]) with ranks as threads of one process,
//! each on its own device: on the emulated device (tests/emulator, `MANTISSA_EMU_DEVICES=4`)
//! the ranks meet in the emulated NCCL's collectives, through the real code path (the TCP
//! rendezvous on loopback, the communicator, the communication stream and its events, the
//! gradient buckets launched from backward). Checked: the collectives' values; training
//! with the wrapper equals one process on the full batch to f32 rounding (relative error
//! below 1e-5; the ranks' sums are taken in another order) in fp32, with accumulation under
//! `no_sync`, with gradient checkpointing, and in fp16 with the loss scaler (an inf on one
//! rank skips the step on all); every rank holds the same parameters, bit for bit, after
//! every step; buckets are launched while backward still runs (profiler order); a rank that
//! fails or leaves makes the others error, not hang; a checkpoint saved by 2 ranks resumes on
//! 4 as it would on 2. Without enough devices each test prints `skipped` and passes.
#![cfg(feature = "cuda-backend")]

use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::distributed::{DistributedDataParallel, LaunchEnv, Launcher, ProcessGroup, ReduceOp};
use mantissa::nn::{Activation, Checkpointed, Linear, Module, Sequential};
use mantissa::optim::{Optimizer, Sgd, SgdConfig};
use mantissa::train::classify_step;
use mantissa::*;
use std::sync::{Arc, Barrier, Mutex};
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
    ranks_within(world, Duration::from_secs(30), f)
}

/// [`ranks`] with the group's `timeout` (the rendezvous, the communicator's creation and
/// each collective).
fn ranks_within<R: Send + 'static>(
    world: usize,
    timeout: Duration,
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
                    job: "data_parallel".into(),
                };
                let pg = ProcessGroup::init(&env, Device::Cuda(rank), timeout)?;
                f(pg)
            })
        })
        .collect();
    Some(threads.into_iter().map(|t| t.join().unwrap()).collect())
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    let rel = (num / den.max(1e-30)).sqrt();
    assert!(
        rel < tol,
        "{what}: relative error {rel:e} (tolerance {tol:e})"
    );
}

#[test]
fn collectives_give_every_rank_the_combined_values() {
    let _s = serial();
    for world in [2usize, 4] {
        let Some(out) = ranks(world, move |pg| {
            let r = pg.rank() as f32;
            let d = pg.device();
            let vals = |k: f32| vec![r + 1.0, -(r * k), 0.5 * r + k];
            let mut seen = Vec::new();
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let t = Tensor::from_vec(vals(2.0), &[3], d)?.to_dtype(dt)?;
                pg.all_reduce(&t, ReduceOp::Sum)?;
                seen.push(t.to_dtype(DType::F32)?.to_vec::<f32>()?);
                let t = Tensor::from_vec(vals(2.0), &[3], d)?.to_dtype(dt)?;
                pg.all_reduce(&t, ReduceOp::Mean)?;
                seen.push(t.to_dtype(DType::F32)?.to_vec::<f32>()?);
            }
            let t = Tensor::from_vec(vals(3.0), &[3], d)?;
            pg.all_reduce(&t, ReduceOp::Max)?;
            seen.push(t.to_vec::<f32>()?);
            let t = Tensor::from_vec(vals(3.0), &[3], d)?;
            pg.broadcast(&t, 1)?;
            seen.push(t.to_vec::<f32>()?);
            let t = Tensor::from_vec(vals(1.0), &[1, 3], d)?;
            let g = pg.all_gather(&t)?;
            assert_eq!(g.shape(), &[pg.world_size(), 3]);
            seen.push(g.to_vec::<f32>()?);
            let w = pg.world_size();
            let t = Tensor::from_vec(
                (0..2 * w).map(|i| i as f32 * (r + 1.0)).collect(),
                &[w, 2],
                d,
            )?;
            let part = pg.reduce_scatter(&t, ReduceOp::Sum)?;
            assert_eq!(part.shape(), &[1, 2]);
            seen.push(part.to_vec::<f32>()?);
            pg.barrier()?;
            Ok(seen)
        }) else {
            return;
        };
        let out: Vec<Vec<Vec<f32>>> = out.into_iter().map(|r| r.unwrap()).collect();
        let w = world as f32;
        let s1: f32 = (0..world).map(|r| r as f32 + 1.0).sum();
        let s2: f32 = (0..world).map(|r| -(r as f32) * 2.0).sum();
        let s3: f32 = (0..world).map(|r| 0.5 * r as f32 + 2.0).sum();
        let top = w - 1.0;
        for (rank, seen) in out.iter().enumerate() {
            for k in 0..3 {
                assert_eq!(seen[2 * k], vec![s1, s2, s3], "sum, dtype {k}, rank {rank}");
                close("mean", &seen[2 * k + 1], &[s1 / w, s2 / w, s3 / w], 4e-3);
            }
            assert_eq!(seen[6], vec![top + 1.0, 0.0, 0.5 * top + 3.0], "max");
            assert_eq!(seen[7], vec![2.0, -3.0, 3.5], "broadcast from rank 1");
            let gathered: Vec<f32> = (0..world)
                .flat_map(|r| [r as f32 + 1.0, -(r as f32), 0.5 * r as f32 + 1.0])
                .collect();
            assert_eq!(seen[8], gathered, "all_gather");
            let total: f32 = (0..world).map(|r| r as f32 + 1.0).sum();
            let part: Vec<f32> = (2 * rank..2 * rank + 2).map(|i| i as f32 * total).collect();
            assert_eq!(seen[9], part, "reduce_scatter, rank {rank}");
        }
    }
}

#[test]
fn a_world_of_one_on_a_device_has_an_nccl_communicator() {
    let _s = serial();
    let Some(out) = ranks(1, |pg| {
        let t = Tensor::from_vec(vec![1.5f32, -2.0], &[2], pg.device())?;
        pg.all_reduce(&t, ReduceOp::Mean)?;
        pg.barrier()?;
        Ok((pg.backend(), t.to_vec::<f32>()?))
    }) else {
        return;
    };
    let (backend, v) = out.into_iter().next().unwrap().unwrap();
    assert!(backend.starts_with("NCCL "), "{backend}");
    assert_eq!(v, vec![1.5, -2.0]);
}

/// Linear 12 -> 24, ReLU, linear 24 -> 5 (the first layer checkpointed with `ckpt`).
fn mlp(d: Device, ckpt: bool) -> Box<dyn Module> {
    let mut g = Generator::new(4);
    let first = Linear::new(12, 24, true, &mut g).unwrap();
    let second = Linear::new(24, 5, true, &mut g).unwrap();
    let mut net: Box<dyn Module> = match ckpt {
        true => Box::new(
            Sequential::new()
                .push(Checkpointed::new(
                    Sequential::new().push(first).push(Activation::Relu),
                ))
                .push(second),
        ),
        false => Box::new(
            Sequential::new()
                .push(first)
                .push(Activation::Relu)
                .push(second),
        ),
    };
    net.to_device(d).unwrap();
    net
}

/// The full batch of step `k`: [16, 12] inputs, 5 classes.
fn batch(k: usize, d: Device) -> (Tensor, Tensor) {
    let mut g = Generator::new(50 + k as u64);
    let x: Vec<f32> = g.normal(16 * 12).iter().map(|v| *v as f32).collect();
    let y: Vec<i64> = g.next_u32s(16).iter().map(|v| (v % 5) as i64).collect();
    (
        Tensor::from_vec(x, &[16, 12], d).unwrap(),
        Tensor::from_vec(y, &[16], d).unwrap(),
    )
}

/// How a data-parallel run trains.
#[derive(Clone, Copy, Default)]
struct Setup {
    /// Micro-batches per step (the first ones under `no_sync`).
    micro: usize,
    ckpt: bool,
    fp16: bool,
    /// Rank 1's batch of this step holds an inf.
    inf_at: Option<usize>,
    cap: usize,
}

const STEPS: usize = 3;

fn params_f32(net: &dyn Module) -> Vec<Vec<f32>> {
    net.parameters()
        .iter()
        .map(|p| p.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap())
        .collect()
}

/// One step on `(x, y)` (micro-batches accumulated with the loss divided by their count).
fn step(
    (net, opt, scaler): (&dyn Module, &mut dyn Optimizer, &mut GradScaler),
    low: Option<DType>,
    ddp: Option<&DistributedDataParallel>,
    (x, y): (&Tensor, &Tensor),
    micro: usize,
) -> Result<()> {
    opt.zero_grad();
    let xs = x.chunk_rows(micro)?;
    let ys = y.chunk_rows(micro)?;
    for (i, (xb, yb)) in xs.iter().zip(&ys).enumerate() {
        let mut run = || -> Result<()> {
            let loss = mantissa::train::autocast_maybe(low, || {
                net.forward(xb)?
                    .cross_entropy(yb, CrossEntropyOptions::default())
            })?;
            scaler.scale(&loss.div(micro as f64)?)?.backward()
        };
        match (ddp, i + 1 < micro) {
            (Some(ddp), true) => ddp.no_sync(run)?,
            _ => run()?,
        }
    }
    scaler.step(opt)?;
    scaler.update()
}

trait ChunkRows {
    fn chunk_rows(&self, n: usize) -> Result<Vec<Tensor>>;
}
impl ChunkRows for Tensor {
    fn chunk_rows(&self, n: usize) -> Result<Vec<Tensor>> {
        self.split(self.shape()[0] / n, 0)
    }
}

fn scaler(fp16: bool) -> GradScaler {
    GradScaler::new(GradScalerConfig {
        enabled: fp16,
        init_scale: 1024.0,
        ..Default::default()
    })
    .unwrap()
}

/// One process on the full batches: the parameters after each step, and the scale.
fn single(d: Device, s: Setup) -> Run {
    let net = mlp(d, s.ckpt);
    let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1)).unwrap();
    let mut sc = scaler(s.fp16);
    let low = s.fp16.then_some(DType::F16);
    let mut after = Vec::new();
    for k in 0..STEPS {
        let (x, y) = batch(k, d);
        step((&*net, &mut opt, &mut sc), low, None, (&x, &y), 1).unwrap();
        after.push(params_f32(&*net));
    }
    (after, sc.current_scale().unwrap())
}

/// Parameters after each step, and the final loss scale.
type Run = (Vec<Vec<Vec<f32>>>, Option<f64>);

/// Each rank on its slice of the full batches, through the wrapper.
fn data_parallel(world: usize, s: Setup) -> Option<Vec<Run>> {
    let out = ranks(world, move |pg| {
        let d = pg.device();
        let net = mlp(d, s.ckpt);
        let ddp = DistributedDataParallel::with_bucket_cap(&pg, &net.parameters(), s.cap)?;
        let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1))?;
        let mut sc = scaler(s.fp16);
        let low = s.fp16.then_some(DType::F16);
        let per = 16 / pg.world_size();
        let mut after = Vec::new();
        for k in 0..STEPS {
            let (x, y) = batch(k, d);
            let mut x = x.narrow(0, pg.rank() * per, per)?.contiguous()?;
            if s.inf_at == Some(k) && pg.rank() == 1 {
                let mut v = x.to_vec::<f32>()?;
                v[3] = f32::INFINITY;
                x = Tensor::from_vec(v, x.shape(), d)?;
            }
            let y = y.narrow(0, pg.rank() * per, per)?.contiguous()?;
            let parts = (&*net, &mut opt as &mut dyn Optimizer, &mut sc);
            step(parts, low, Some(&ddp), (&x, &y), s.micro.max(1))?;
            after.push(params_f32(&*net));
        }
        Ok((after, sc.current_scale()?))
    })?;
    Some(out.into_iter().map(|r| r.unwrap()).collect())
}

fn equals_full_batch(what: &str, world: usize, s: Setup) {
    let _s = serial();
    let Some(runs) = data_parallel(world, s) else {
        return;
    };
    let (want, scale) = single(Device::Cuda(0), s);
    for (rank, (after, sc)) in runs.iter().enumerate() {
        // Every rank holds rank 0's parameters, bit for bit, after every step.
        assert_eq!(after, &runs[0].0, "{what}: rank {rank} differs from rank 0");
        assert_eq!(*sc, scale, "{what}: rank {rank}'s loss scale");
    }
    for (k, (got, want)) in runs[0].0.iter().zip(&want).enumerate() {
        let tol = if s.fp16 { 2e-3 } else { 1e-5 };
        close(
            &format!("{what}: step {k}"),
            &got.concat(),
            &want.concat(),
            tol,
        );
    }
}

#[test]
fn training_equals_one_process_on_the_full_batch() {
    let cap = 1 << 20;
    equals_full_batch(
        "2 ranks",
        2,
        Setup {
            cap,
            ..Setup::default()
        },
    );
    // Buckets of 256 bytes: one per parameter, launched one by one.
    equals_full_batch(
        "4 ranks, small buckets",
        4,
        Setup {
            cap: 256,
            ..Setup::default()
        },
    );
}

#[test]
fn accumulation_checkpointing_and_the_scaler_work_with_the_wrapper() {
    equals_full_batch(
        "no_sync micro-steps",
        2,
        Setup {
            micro: 2,
            cap: 512,
            ..Setup::default()
        },
    );
    equals_full_batch(
        "checkpointed layer",
        2,
        Setup {
            ckpt: true,
            cap: 512,
            ..Setup::default()
        },
    );
    equals_full_batch(
        "fp16 with the scaler",
        2,
        Setup {
            fp16: true,
            cap: 512,
            ..Setup::default()
        },
    );
}

#[test]
fn an_inf_on_one_rank_skips_the_step_on_every_rank() {
    let _s = serial();
    let s = Setup {
        fp16: true,
        inf_at: Some(1),
        cap: 512,
        ..Setup::default()
    };
    let Some(runs) = data_parallel(2, s) else {
        return;
    };
    for (rank, (after, scale)) in runs.iter().enumerate() {
        assert_eq!(after[1], after[0], "rank {rank} stepped on the inf");
        assert_ne!(after[2], after[1], "rank {rank} did not step after it");
        // 1024, halved once on the inf (growth comes after 2000 good steps).
        assert_eq!(*scale, Some(512.0), "rank {rank}");
    }
    assert_eq!(runs[0].0, runs[1].0);
}

#[test]
fn buckets_are_launched_while_backward_runs() {
    let _s = serial();
    if !devices(2) {
        return;
    }
    let prof = mantissa::profiler::Profiler::start().unwrap();
    let out = ranks(2, |pg| {
        let d = pg.device();
        // Four layers, a bucket each: the last layer's all-reduce goes before the first
        // layer's backward runs.
        let mut g = Generator::new(3);
        let mut net = Sequential::new();
        for _ in 0..4 {
            net = net
                .push(Linear::new(16, 16, true, &mut g)?)
                .push(Activation::Relu);
        }
        let mut net: Box<dyn Module> = Box::new(net);
        net.to_device(d)?;
        let ddp = DistributedDataParallel::with_bucket_cap(&pg, &net.parameters(), 1100)?;
        assert_eq!(ddp.buckets(), 4);
        let x = Tensor::randn(&[8, 16], DType::F32, d)?;
        net.forward(&x)?.sum_all()?.backward()
    })
    .unwrap();
    for r in out {
        r.unwrap();
    }
    let profile = prof.stop().unwrap();
    let trace: serde_json::Value = serde_json::from_str(&profile.chrome_trace_json()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut by_thread: std::collections::BTreeMap<u64, (Vec<f64>, Vec<f64>)> = Default::default();
    for e in events {
        let (Some(name), Some(ts), Some(tid)) =
            (e["name"].as_str(), e["ts"].as_f64(), e["tid"].as_u64())
        else {
            continue;
        };
        if e["cat"].as_str() != Some("op") {
            continue;
        }
        let entry = by_thread.entry(tid).or_default();
        if name == "ddp.all_reduce" {
            entry.0.push(ts);
        } else if name.ends_with(".backward") {
            entry.1.push(ts);
        }
    }
    let ranks: Vec<_> = by_thread.values().filter(|(a, _)| !a.is_empty()).collect();
    assert_eq!(ranks.len(), 2, "both ranks' threads launched buckets");
    for (launches, backward) in ranks {
        assert_eq!(launches.len(), 4, "one launch per bucket");
        let first_launch = launches.iter().cloned().fold(f64::MAX, f64::min);
        let last_backward = backward.iter().cloned().fold(0.0, f64::max);
        assert!(
            first_launch < last_backward,
            "the first bucket went at {first_launch} us, after backward's last op at {last_backward} us"
        );
        // Three of the four buckets go before the last backward op starts.
        let early = launches.iter().filter(|t| **t < last_backward).count();
        assert!(early >= 3, "{early} of 4 buckets launched during backward");
    }
}

/// Asserts that `e` is rank 0's error for `op`, past the deadline, naming rank 1.
fn missed_deadline(e: &Error, op: &str) {
    let msg = e.to_string();
    assert!(msg.starts_with(&format!("{op} (rank 0 of 2)")), "{msg}");
    assert!(
        msg.contains("did not complete within 2s") && msg.contains("rank 1"),
        "{msg}"
    );
}

#[test]
fn a_rank_that_fails_or_leaves_makes_the_others_error_at_the_deadline() {
    let _s = serial();
    // As on one machine with NCCL: a rank's abort or exit is not seen by its peers, whose
    // collectives wait until their watchdog's deadline (2 s here) aborts their communicator.
    let limit = Duration::from_secs(2);
    // The same steps with every rank present first, under the usual timeout: the kernels are
    // compiled and loaded then, so that no healthy collective below waits past 2 s for a
    // peer that is compiling.
    let Some(warm) = ranks(2, |pg| {
        let net = mlp(pg.device(), false);
        let _ddp = DistributedDataParallel::new(&pg, &net.parameters())?;
        let (x, y) = batch(0, pg.device());
        net.forward(&x)?
            .cross_entropy(&y, CrossEntropyOptions::default())?
            .backward()?;
        let one = Tensor::ones(&[4], DType::F32, pg.device())?;
        pg.all_reduce(&one, ReduceOp::Sum)?;
        net.parameters()[0].grad().unwrap().to_vec::<f32>()?;
        one.to_vec::<f32>()
    }) else {
        return;
    };
    assert!(warm
        .iter()
        .all(|r| r.as_ref().is_ok_and(|v| v == &[2.0; 4])));
    let t = std::time::Instant::now();
    // Rank 1 gives up (abort) before the all-reduce: rank 0's read of the result fails.
    let Some(out) = ranks_within(2, limit, |pg| {
        if pg.rank() == 1 {
            pg.abort("rank 1 hit an error");
            return Ok(());
        }
        let x = Tensor::ones(&[4], DType::F32, pg.device())?;
        pg.all_reduce(&x, ReduceOp::Sum)?;
        x.to_vec::<f32>().map(|_| ())
    }) else {
        return;
    };
    missed_deadline(out[0].as_ref().unwrap_err(), "ncclAllReduce");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t.elapsed()
    );
    // Rank 1 leaves mid-training (its group dropped, as a process that ends): rank 0's
    // backward queues its bucket's all-reduce, and reading a gradient fails; the group is
    // broken for good.
    let barrier = Arc::new(Barrier::new(2));
    let t = std::time::Instant::now();
    let out = ranks_within(2, limit, move |pg| {
        let net = mlp(pg.device(), false);
        let ddp = DistributedDataParallel::new(&pg, &net.parameters())?;
        barrier.wait();
        if pg.rank() == 1 {
            drop(ddp);
            drop(pg);
            return Ok(None);
        }
        let (x, y) = batch(0, pg.device());
        net.forward(&x)?
            .cross_entropy(&y, CrossEntropyOptions::default())?
            .backward()?;
        let read = net.parameters()[0].grad().unwrap().to_vec::<f32>();
        let later = pg.all_reduce(&Tensor::ones(&[1], DType::F32, pg.device())?, ReduceOp::Sum);
        Ok(Some((read, later)))
    })
    .unwrap();
    let (read, later) = out[0].as_ref().unwrap().as_ref().unwrap();
    missed_deadline(read.as_ref().unwrap_err(), "ncclAllReduce");
    let later = later.as_ref().unwrap_err().to_string();
    assert!(later.contains("broke earlier"), "{later}");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_rank_that_never_joins_fails_the_others_creation_at_the_deadline() {
    let _s = serial();
    if !devices(2) {
        return;
    }
    // The emulated NCCL's rank 1 dies between the rendezvous and NCCL's init (on a GPU: a
    // process killed there); rank 0's communicator never becomes ready.
    std::env::set_var("MANTISSA_EMU_NCCL_LOST_RANK", "1");
    let t = std::time::Instant::now();
    let out = ranks_within(2, Duration::from_secs(2), |pg| Ok(pg.rank())).unwrap();
    std::env::remove_var("MANTISSA_EMU_NCCL_LOST_RANK");
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(
        e.starts_with("ncclCommInitRankConfig (rank 0 of 2)")
            && e.contains("not every rank joined within 2s"),
        "{e}"
    );
    assert!(out[1].is_err());
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_collective_inside_a_cuda_graph_capture_is_refused_by_name() {
    let _s = serial();
    let Some(out) = ranks(1, |pg| {
        let net = mlp(pg.device(), false);
        let ddp = DistributedDataParallel::new(&pg, &net.parameters())?;
        let mut step = mantissa::graph::CapturedStep::new(pg.device(), |b: &[Tensor]| {
            let loss = net
                .forward(&b[0])?
                .cross_entropy(&b[1], CrossEntropyOptions::default())?;
            loss.backward()?;
            Ok(vec![loss])
        })?
        .with_warmup(1);
        let (x, y) = batch(0, pg.device());
        step.run(&[x.clone(), y.clone()])?;
        let refused = step.run(&[x, y]).map(|_| ());
        // The group still works after the refused capture.
        let t = Tensor::ones(&[2], DType::F32, pg.device())?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        drop(ddp);
        Ok((refused, t.to_vec::<f32>()?))
    }) else {
        return;
    };
    let (refused, after) = out.into_iter().next().unwrap().unwrap();
    match refused {
        Err(Error::NotCapturable { op, .. }) => assert_eq!(op, "ncclAllReduce"),
        other => panic!("expected NotCapturable naming ncclAllReduce, got {other:?}"),
    }
    assert_eq!(after, vec![1.0, 1.0]);
}

#[test]
fn a_checkpoint_of_two_ranks_resumes_on_four() {
    let _s = serial();
    if !devices(4) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("mantissa-ddp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("two.safetensors");
    // Two ranks train two steps; rank 0 alone writes the checkpoint; then one more step.
    let p2 = path.clone();
    let two = ranks(2, move |pg| {
        let d = pg.device();
        let net = mlp(d, false);
        let ddp = DistributedDataParallel::new(&pg, &net.parameters())?;
        let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1))?;
        let mut sc = scaler(false);
        let per = 16 / pg.world_size();
        for k in 0..3 {
            if k == 2 && pg.is_main() {
                mantissa::checkpoint::save(&p2, &*net, Some(&opt), &[])?;
            }
            pg.barrier()?;
            let (x, y) = batch(k, d);
            let x = x.narrow(0, pg.rank() * per, per)?.contiguous()?;
            let y = y.narrow(0, pg.rank() * per, per)?.contiguous()?;
            classify_step(&*net, &mut opt, &mut sc, None, &x, &y)?;
        }
        drop(ddp);
        Ok(params_f32(&*net))
    })
    .unwrap();
    let two: Vec<_> = two.into_iter().map(|r| r.unwrap()).collect();
    // Four ranks load it and take the third step on the same full batch.
    let p4 = path.clone();
    let four = ranks(4, move |pg| {
        let d = pg.device();
        let mut net = mlp(d, false);
        let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1))?;
        mantissa::checkpoint::load(&p4, &mut *net, Some(&mut opt))?;
        let _ddp = DistributedDataParallel::new(&pg, &net.parameters())?;
        let mut sc = scaler(false);
        let per = 16 / pg.world_size();
        let (x, y) = batch(2, d);
        let x = x.narrow(0, pg.rank() * per, per)?.contiguous()?;
        let y = y.narrow(0, pg.rank() * per, per)?.contiguous()?;
        classify_step(&*net, &mut opt, &mut sc, None, &x, &y)?;
        Ok(params_f32(&*net))
    })
    .unwrap();
    for r in four {
        close("resumed on 4", &r.unwrap().concat(), &two[0].concat(), 1e-5);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
