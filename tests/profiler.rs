//! The profiler: exact op and launch counts of a known step on the CPU and on the CUDA
//! device (the emulated one in CI, whose own launch trace is the reference), the Chrome
//! trace's shape, the memory at the peak, and that nothing is recorded when it is off.

mod common;
use common::parity::gpu;
use mantissa::optim::{Optimizer, Sgd, SgdConfig};
use mantissa::profiler::{self, Profile, Profiler, SortBy};
use mantissa::*;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// A profile records every thread's ops: the tests here run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Linear(6 -> 4) + ReLU + cross-entropy + SGD on a batch of 5.
struct Step {
    w: Tensor,
    b: Tensor,
    x: Tensor,
    t: Tensor,
    opt: Sgd,
}

impl Step {
    fn new(device: Device) -> Step {
        let mut g = Generator::new(7);
        let param = |shape: &[usize], g: &mut Generator| {
            Tensor::randn_with(shape, 0.0, 0.5, DType::F32, device, g)
                .unwrap()
                .requires_grad(true)
                .unwrap()
        };
        let (w, b) = (param(&[4, 6], &mut g), param(&[4], &mut g));
        let x = Tensor::randn_with(&[5, 6], 0.0, 1.0, DType::F32, device, &mut g).unwrap();
        let t = Tensor::from_vec(vec![0i64, 3, 1, 2, 3], &[5], Device::Cpu)
            .unwrap()
            .to_device(device)
            .unwrap();
        let opt = Sgd::new(vec![w.clone(), b.clone()], SgdConfig::new(0.1)).unwrap();
        Step { w, b, x, t, opt }
    }

    fn run(&mut self) -> Result<()> {
        let logits = self.x.linear(&self.w, Some(&self.b))?.relu()?;
        let loss = logits.cross_entropy(&self.t, CrossEntropyOptions::default())?;
        loss.backward()?;
        self.opt.step()?;
        self.opt.zero_grad();
        Ok(())
    }
}

fn counts(p: &Profile) -> BTreeMap<String, u64> {
    p.ops().iter().map(|o| (o.name.clone(), o.count)).collect()
}

/// The ops of one `Step::run` after the first (whose optimizer makes its state), with how
/// many times each runs, read off the code:
/// - forward: `linear` (one fused product with the bias), `relu`, `cross_entropy`, which
///   finds the targets not ignored with `ne` (`compare`, its scalar made by `full`),
///   `to_dtype`, and takes the mean as `sum` of the weights, `sum` of the rows and `div`;
/// - backward: `full` (the seed of ones), then one backward per graph node: `div`
///   (whose input gradient is one more `div`), `sum`, `cross_entropy`, `relu`,
///   `linear` (the weight's gradient a `matmul`, the bias's a `sum`; the input needs none);
/// - `sgd.step`: one fused update per parameter, no ops.
fn expected_ops() -> BTreeMap<String, u64> {
    let per_step = [
        ("linear", 1),
        ("relu", 1),
        ("cross_entropy", 1),
        ("compare", 1),
        ("full", 2),
        ("to_dtype", 1),
        ("sum", 3),
        ("div", 2),
        ("div.backward", 1),
        ("sum.backward", 1),
        ("cross_entropy.backward", 1),
        ("relu.backward", 1),
        ("linear.backward", 1),
        ("matmul", 1),
        ("sgd.step", 1),
    ];
    per_step.iter().map(|(k, n)| (k.to_string(), *n)).collect()
}

#[test]
fn cpu_step_op_counts_are_exact() {
    let _s = serial();
    let mut step = Step::new(Device::Cpu);
    step.run().unwrap(); // warm-up, not profiled
    let prof = Profiler::start().unwrap();
    for _ in 0..3 {
        step.run().unwrap();
        prof.step();
    }
    let p = prof.stop().unwrap();
    let want: BTreeMap<String, u64> = expected_ops()
        .into_iter()
        .map(|(k, n)| (k, 3 * n))
        .collect();
    assert_eq!(counts(&p), want, "\n{}", p.table(SortBy::Count, 40));
    assert_eq!(p.steps().len(), 3);
    assert_eq!(p.launches(), 0, "the CPU launches no kernels");
    assert!(p.kernels().is_empty());
    for s in p.steps() {
        assert!(s.host_ns > 0);
        assert_eq!((s.h2d_copies, s.d2h_copies, s.device_busy_ns), (0, 0, 0));
    }
    // Host time: an op's span holds the ops inside it. `compare` and `to_dtype` run only
    // inside `cross_entropy` (the weights of the targets not ignored), so its spans hold
    // theirs; `sum` would not do, as the bias gradient's sum runs outside it.
    let ce = p.op("cross_entropy").unwrap();
    let inner = ["compare", "to_dtype"].map(|n| p.op(n).unwrap().host.total_ns);
    assert!(
        ce.host.total_ns >= inner.iter().sum::<u64>(),
        "cross_entropy {} ns holds compare + to_dtype {inner:?} ns",
        ce.host.total_ns
    );
    assert!(ce.host.min_ns <= ce.host.max_ns && ce.host.count == 3);
    let table = p.table(SortBy::HostTime, 5);
    assert_eq!(table.lines().count(), 1 + 5, "{table}");
}

#[test]
fn off_records_nothing_and_one_profile_runs_at_a_time() {
    let _s = serial();
    let mut step = Step::new(Device::Cpu);
    step.run().unwrap(); // no profile: nothing to record into
    let prof = Profiler::start().unwrap();
    let err = Profiler::start()
        .err()
        .expect("a second profile is refused");
    assert!(err.to_string().contains("already running"), "{err}");
    let p = prof.stop().unwrap();
    assert!(p.ops().is_empty() && p.steps().is_empty() && p.kernels().is_empty());
    // A dropped profile records nothing more, and a new one starts clean.
    let dropped = Profiler::start().unwrap();
    step.run().unwrap();
    drop(dropped);
    let (_, p) = profiler::profile(|_| Tensor::ones(&[3], DType::F32, Device::Cpu)).unwrap();
    assert_eq!(counts(&p), BTreeMap::from([("full".to_string(), 1)]));
    assert_eq!(
        p.steps().len(),
        1,
        "work after the last mark is one more step"
    );
}

/// The trace's events as JSON values, checked for the fields every event must have.
fn trace_events(p: &Profile) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&p.chrome_trace_json()).expect("valid JSON");
    let events = v["traceEvents"].as_array().expect("traceEvents").clone();
    for e in &events {
        assert!(e["name"].is_string(), "{e}");
        assert!(e["ts"].is_number() && e["dur"].is_number(), "{e}");
        assert!(e["pid"].is_u64() && e["tid"].is_u64(), "{e}");
        assert!(e["dur"].as_f64().unwrap() >= 0.0, "{e}");
    }
    events
}

/// Launch events lie inside the span of the op named in their args on their thread.
fn launches_nest_in_their_ops(events: &[serde_json::Value]) -> usize {
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["cat"] == "op").collect();
    let mut checked = 0;
    for l in events.iter().filter(|e| e["cat"] == "launch") {
        let Some(op) = l["args"]["op"].as_str() else {
            continue;
        };
        let (ts, end) = (
            l["ts"].as_f64().unwrap(),
            l["ts"].as_f64().unwrap() + l["dur"].as_f64().unwrap(),
        );
        let inside = spans.iter().any(|s| {
            let (a, d) = (s["ts"].as_f64().unwrap(), s["dur"].as_f64().unwrap());
            s["name"] == op && s["tid"] == l["tid"] && a <= ts && end <= a + d + 1e-3
        });
        assert!(inside, "launch {l} is outside every `{op}` span");
        checked += 1;
    }
    checked
}

#[test]
fn cpu_trace_has_ops_per_thread() {
    let _s = serial();
    let mut step = Step::new(Device::Cpu);
    let ((), p) = profiler::profile(|prof| {
        step.run().unwrap();
        prof.step();
    })
    .unwrap();
    let events = trace_events(&p);
    let ops: Vec<_> = events.iter().filter(|e| e["cat"] == "op").collect();
    let total: u64 = p.ops().iter().map(|o| o.count).sum();
    assert_eq!(ops.len() as u64, total);
    // Spans on one thread nest or follow each other, never overlap partially.
    for a in &ops {
        for b in &ops {
            let (a0, a1) = (
                a["ts"].as_f64().unwrap(),
                a["ts"].as_f64().unwrap() + a["dur"].as_f64().unwrap(),
            );
            let (b0, b1) = (
                b["ts"].as_f64().unwrap(),
                b["ts"].as_f64().unwrap() + b["dur"].as_f64().unwrap(),
            );
            let partial = a0 < b0 && b0 < a1 && a1 < b1;
            assert!(!partial || a["tid"] != b["tid"], "{a} and {b} overlap");
        }
    }
    let path = std::env::temp_dir().join(format!("mantissa-profiler-{}.json", std::process::id()));
    p.export_chrome_trace(&path).unwrap();
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(back["traceEvents"].as_array().unwrap().len(), events.len());
    let _ = std::fs::remove_file(&path);
}

/// Runs `Step` on the CUDA device as a child of `device_step_launches_match_the_emulator_trace`
/// (with the emulator's launch trace on); a no-op in a plain test run.
#[test]
fn device_step_child() {
    if std::env::var_os("MANTISSA_PROFILER_CHILD").is_none() {
        return;
    }
    let dev = gpu().expect("the parent found a device");
    let mut step = Step::new(dev);
    step.run().unwrap();
    eprintln!("PROFILE BEGIN");
    let prof = Profiler::start().unwrap();
    for _ in 0..2 {
        step.run().unwrap();
        prof.step();
    }
    let p = prof.stop().unwrap();
    eprintln!("PROFILE END");
    eprintln!("PROFILE LAUNCHES {}", p.launches());
}

#[test]
fn device_step_launches_match_the_emulator_trace() {
    let Some(dev) = gpu() else { return };
    let _s = serial();
    let mut step = Step::new(dev);
    step.run().unwrap();
    let prof = Profiler::start().unwrap();
    for _ in 0..2 {
        step.run().unwrap();
        prof.step();
    }
    let p = prof.stop().unwrap();
    println!("{}\n{}", p.table(SortBy::DeviceTime, 40), p.step_table());
    // The op layer is the same on every device.
    let want: BTreeMap<String, u64> = expected_ops()
        .into_iter()
        .map(|(k, n)| (k, 2 * n))
        .collect();
    assert_eq!(counts(&p), want);
    let launches = p.launches();
    assert!(launches > 0);
    assert_eq!(p.steps().len(), 2);
    assert_eq!(p.steps()[0].launches, p.steps()[1].launches, "equal steps");
    // Every launch has device times, inside its step's host span on the trace's timeline.
    for k in p.kernels() {
        assert_eq!(k.device.map(|d| d.count), Some(k.count), "{}", k.name);
    }
    for s in p.steps() {
        assert!(s.device_busy_ns > 0 && s.peak_allocated > 0);
    }
    // Bytes and FLOPs from the operands, over the two steps: relu of the [5, 4] f32 logits
    // reads and writes 20 values, its backward reads two and writes one; the weight's
    // gradient is a [4, 5] @ [5, 6] product, the forward a [5, 6] @ [6, 4] one with the bias.
    let kernel = |name: &str| {
        let found = p.kernels().iter().find(|k| k.name.starts_with(name));
        found.unwrap_or_else(|| panic!("no {name} in {:?}", p.kernels()))
    };
    assert_eq!(kernel("unary_float").bytes, Some(2 * 2 * 20 * 4));
    assert_eq!(
        kernel("unary_grad_contiguous_float").bytes,
        Some(2 * 3 * 20 * 4)
    );
    assert_eq!(
        kernel("cublas gemm 1x 4x5x6 f32").flops,
        Some(2 * 2 * 4 * 5 * 6)
    );
    if common::parity::emulated(dev) {
        // A GPU's cuBLASLt may decline the bias epilogue (then a gemm and a bias copy run).
        assert_eq!(
            kernel("cublasLt matmul+bias 5x6x4 f32").flops,
            Some(2 * 2 * 5 * 6 * 4)
        );
    }
    assert!(kernel("unary_float").gb_per_s().is_some_and(|g| g > 0.0));
    let events = trace_events(&p);
    let nested = launches_nest_in_their_ops(&events);
    assert!(nested as u64 >= launches, "{nested} launch events checked");
    let on_device = events
        .iter()
        .filter(|e| e["pid"].as_u64() == Some(1))
        .count();
    assert!(on_device as u64 >= launches);
    if !common::parity::emulated(dev) {
        return;
    }
    // The emulator prints each launch as it is queued: the same step in a child process.
    // The child test's name as the harness knows it: its module's path within the binary
    // too where this file is a module of one (tests/gpu_suite).
    let child = match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::device_step_child"),
        None => "device_step_child".to_string(),
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([child.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env("MANTISSA_PROFILER_CHILD", "1")
        .env("MANTISSA_EMU_TRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let region: Vec<&str> = err
        .lines()
        .skip_while(|l| *l != "PROFILE BEGIN")
        .take_while(|l| *l != "PROFILE END")
        .collect();
    let traced = region.iter().filter(|l| l.starts_with("launch ")).count();
    let counted: u64 = err
        .lines()
        .find_map(|l| l.strip_prefix("PROFILE LAUNCHES "))
        .expect("the child's count")
        .parse()
        .unwrap();
    assert_eq!(
        counted, traced as u64,
        "the profiler's launches against the emulator's trace"
    );
    assert_eq!(counted, launches, "the child ran the same steps");
}

#[cfg(feature = "cuda-backend")]
#[test]
fn device_memory_at_peak_names_the_ops_holding_it() {
    let Some(dev) = gpu() else { return };
    let _s = serial();
    let Device::Cuda(ordinal) = dev else {
        unreachable!()
    };
    let rt = mantissa::backend::cuda::runtime::runtime(ordinal).unwrap();
    let mut g = Generator::new(3);
    let mut param = |shape: &[usize]| {
        Tensor::randn_with(shape, 0.0, 0.3, DType::F32, dev, &mut g)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    };
    let (w1, b1, w2) = (param(&[4, 1, 3, 3]), param(&[4]), param(&[3, 100]));
    let x = Tensor::randn(&[2, 1, 10, 10], DType::F32, dev).unwrap();
    let t = Tensor::from_vec(vec![0i64, 2], &[2], Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let conv = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    // The forward of a small CNN, then one large tensor, so that the peak comes at the end
    // with every saved activation alive.
    let forward = || -> Result<(Tensor, Tensor)> {
        let h = x
            .conv2d(&w1, Some(&b1), conv)?
            .relu()?
            .max_pool2d(MaxPool2dOptions::new(2))?;
        let loss = h
            .reshape(&[2, 100])?
            .linear(&w2, None)?
            .cross_entropy(&t, Default::default())?;
        Ok((loss, Tensor::zeros(&[1 << 18], DType::F32, dev)?))
    };
    drop(forward().unwrap()); // warm-up: kernels, algorithms
    rt.synchronize().unwrap();
    let before = rt.memory_stats().allocated;
    rt.reset_peak_stats();
    let (held, p) = profiler::profile(|_| forward().unwrap()).unwrap();
    let stats = rt.memory_stats();
    let m = p
        .memory_at_peak()
        .iter()
        .find(|m| m.device == dev)
        .expect("a device view");
    println!("{}", p.step_table());
    let by: BTreeMap<&str, usize> = m.by_op.iter().map(|(k, b)| (k.as_str(), *b)).collect();
    assert_eq!(
        m.peak_allocated, stats.peak_allocated,
        "the allocator's own peak"
    );
    assert_eq!(by.values().sum::<usize>(), m.peak_allocated);
    assert_eq!(by.get(profiler::OUTSIDE_OPS).copied().unwrap_or(0), before);
    // The allocator's block of a request: rounded to 512 bytes, or the exact size without caching.
    let caching = std::env::var_os("MANTISSA_NO_CUDA_MEMORY_CACHING").is_none_or(|v| v != "1");
    let block = |b: usize| match caching {
        true => mantissa::backend::caching::block_size(b).unwrap(),
        false => b,
    };
    // Blocks belong to the op the user called. relu holds its output (its backward reads it);
    // its input, conv2d's output with the bias added, is saved by nobody (relu keeps its
    // output instead), so conv2d holds nothing: its output before the bias and any workspace
    // are gone too. max_pool2d holds its output and the position of each maximum (a byte per
    // output: the tap within its 2 x 2 window); `zeros` (a `full`) the large tensor.
    assert_eq!(by["relu"], block(2 * 4 * 10 * 10 * 4));
    assert!(!by.contains_key("conv2d"), "{by:?}");
    assert_eq!(
        by["max_pool2d"],
        block(2 * 4 * 5 * 5 * 4) + block(2 * 4 * 5 * 5)
    );
    assert!(by["full"] >= block(4 << 18));
    drop(held);
    // A whole step (forward, backward, SGD): the profile's peak is the allocator's, and the
    // ops' shares add up to it.
    let mut opt = Sgd::new(
        vec![w1.clone(), b1.clone(), w2.clone()],
        SgdConfig::new(0.1),
    )
    .unwrap();
    rt.reset_peak_stats();
    let ((), p) = profiler::profile(|prof| {
        let (loss, big) = forward().unwrap();
        drop(big);
        loss.backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        prof.step();
    })
    .unwrap();
    let m = p.memory_at_peak().iter().find(|m| m.device == dev).unwrap();
    assert_eq!(m.peak_allocated, rt.memory_stats().peak_allocated);
    assert_eq!(
        m.by_op.iter().map(|(_, b)| b).sum::<usize>(),
        m.peak_allocated
    );
    assert_eq!(p.steps()[0].peak_allocated, m.peak_allocated);
}

#[test]
fn sgld_noise_is_drawn_on_the_device() {
    let Some(dev) = gpu() else { return };
    let _s = serial();
    let sgld = |device: Device| {
        let p = Tensor::randn_with(
            &[48, 33],
            0.0,
            1.0,
            DType::F32,
            Device::Cpu,
            &mut Generator::new(1),
        )
        .unwrap()
        .to_device(device)
        .unwrap()
        .requires_grad(true)
        .unwrap();
        let g = Tensor::full(&[48, 33], 0.5, DType::F32, device).unwrap();
        let opt = mantissa::optim::Sgld::new(vec![p.clone()], SgdConfig::new(0.1), 2.0, 9).unwrap();
        (p, g, opt)
    };
    let (p, g, mut opt) = sgld(dev);
    let ((), prof) = profiler::profile(|prof| {
        for _ in 0..2 {
            p.set_grad(Some(g.clone())).unwrap();
            opt.step().unwrap();
            prof.step();
        }
    })
    .unwrap();
    for (k, s) in prof.steps().iter().enumerate() {
        assert_eq!((s.h2d_copies, s.h2d_bytes), (0, 0), "step {k}: an upload");
    }
    let normal = prof
        .kernels()
        .iter()
        .find(|k| k.name.starts_with("normal_float"));
    assert_eq!(
        normal.map(|k| k.count),
        Some(2),
        "{}",
        prof.table(SortBy::Count, 30)
    );
    // The same noise as on the host, where the same generator draws it.
    let (q, h, mut host_opt) = sgld(Device::Cpu);
    for _ in 0..2 {
        q.set_grad(Some(h.clone())).unwrap();
        host_opt.step().unwrap();
    }
    let (a, b) = (common::vals(&p), common::vals(&q));
    assert!(
        common::rel_err(&a, &b) < 1e-6,
        "{}",
        common::rel_err(&a, &b)
    );
    assert_eq!(opt.generator(), host_opt.generator());
}
