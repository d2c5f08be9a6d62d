//! The public API as a hostile user calls it: sizes that overflow, views that reach past
//! their storage, files that lie about their size, loads that do not fit, guards dropped out
//! of order. Every call returns `Err` (or the right answer) and leaves nothing half-changed.
//! The tensor cases run on the CPU and, where there is one, on the first CUDA device.

mod common;

use mantissa::data::{mnist, DataLoader, DataLoaderConfig, Dataset};
use mantissa::nn::{Linear, Module};
use mantissa::optim::{Adam, AdamConfig, Optimizer};
use mantissa::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Barrier, Mutex};

/// Counts the bytes this thread holds from the allocator and their peak, so a test can bound
/// what one call allocated (other tests' threads do not count).
struct Counting;

thread_local! {
    static HELD: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// const-initialised thread-locals without destructors, so touching them never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = HELD.try_with(|h| {
            h.set(h.get() + l.size());
            let _ = PEAK.try_with(|p| p.set(p.get().max(h.get())));
        });
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, l: Layout) {
        let _ = HELD.try_with(|h| h.set(h.get().saturating_sub(l.size())));
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, l) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let _ = HELD.try_with(|h| {
            h.set(h.get().saturating_sub(l.size()) + new);
            let _ = PEAK.try_with(|p| p.set(p.get().max(h.get())));
        });
        // SAFETY: as GlobalAlloc::realloc requires, forwarded unchanged.
        unsafe { System.realloc(ptr, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The most bytes this thread held at once while `f` ran, above what it held before.
fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = HELD.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    (r, PEAK.with(Cell::get) - base)
}

/// The CPU, and the first CUDA device when there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(g) => d.push(g),
        Err(e) => println!("skipped on CUDA: no CUDA device ({e})"),
    }
    d
}

fn too_large(r: Result<Tensor>, what: &str) {
    match r {
        Err(Error::TooLarge { .. }) | Err(Error::Invalid { .. }) => {}
        Err(e) => panic!("{what}: a size error expected, got {e}"),
        Ok(t) => panic!("{what}: Ok with shape {:?}", t.shape()),
    }
}

#[test]
fn narrow_near_usize_max_is_an_error() {
    for d in devices() {
        let t = Tensor::from_vec(vec![7.0f32; 4], &[4, 1], d).unwrap();
        too_large(t.narrow(0, usize::MAX - 99, 101), "narrow wrapping");
        too_large(t.narrow(0, usize::MAX, 2), "narrow at usize::MAX");
        too_large(t.narrow(0, 3, 2), "narrow past the end");
        assert_eq!(
            t.narrow(0, 4, 0).unwrap().numel(),
            0,
            "an empty narrow at the end"
        );
        let e = t.narrow(0, usize::MAX - 99, 101).unwrap_err().to_string();
        assert!(e.contains("narrow") && e.contains("[4, 1]"), "{e}");
    }
}

#[test]
fn shapes_whose_element_count_wraps_are_errors() {
    let wrap = (1usize << 63) + 1;
    for d in devices() {
        let two = Tensor::from_vec(vec![1.0f32, 2.0], &[2], d).unwrap();
        too_large(two.reshape(&[2, wrap]), "reshape wrapping to 2 elements");
        too_large(
            Tensor::from_vec(vec![1.0f32, 2.0], &[wrap, 2], d),
            "from_vec wrapping to 2 elements",
        );
        too_large(
            two.reshape_infer(&[-1, 1 << 62, 4]),
            "reshape_infer overflow",
        );
        let one = Tensor::ones(&[1, 1], DType::F32, d).unwrap();
        too_large(one.expand(&[1 << 32, 1 << 32]), "expand past usize");
        // Expanded operands are small in memory; their product's output is not.
        let a = one.expand(&[1 << 40, 1]).unwrap();
        let b = one.expand(&[1, 1 << 40]).unwrap();
        let half = Tensor::ones(&[1], DType::F32, d)
            .unwrap()
            .expand(&[1 << 62])
            .unwrap();
        // (On the host the operands themselves, views of 2^40 and 2^62 elements, may be
        // refused first: out of memory is as right as the size error there.)
        for (r, what) in [
            (a.matmul(&b), "matmul"),
            (a.add(&b), "broadcast add"),
            (Tensor::cat(&[&half, &half], 0), "cat past isize::MAX"),
        ] {
            match r {
                Err(Error::TooLarge { .. }) | Err(Error::OutOfMemory { .. }) => {}
                other => panic!("{what} past usize: {:?}", other.map(|t| t.numel())),
            }
        }
    }
}

#[test]
fn allocations_too_large_are_errors_not_aborts() {
    for d in devices() {
        // 2^62 f32 elements: the byte count overflows isize.
        too_large(Tensor::zeros(&[1 << 62], DType::F32, d), "zeros [2^62]");
        too_large(
            Tensor::zeros(&[(1 << 62) + 1], DType::F32, d),
            "zeros [2^62 + 1]",
        );
        too_large(
            Tensor::arange(0.0, 1e300, 1.0, DType::F32, d),
            "arange of 1e300 elements",
        );
        // 2^45 f32 elements (128 TiB): representable, but no 64-bit machine has the address
        // space: the allocator refuses and it is an out-of-memory error.
        for r in [
            Tensor::zeros(&[1 << 45], DType::F32, d),
            Tensor::randn(&[1 << 45], DType::F32, d),
        ] {
            assert!(
                matches!(r, Err(Error::OutOfMemory { .. })),
                "{d}: {:?}",
                r.map(|t| t.numel())
            );
        }
    }
    // The 2^40 (4 TiB) case, where the kernel refuses allocations past memory (the
    // default heuristic overcommit); with "always overcommit" the allocation would succeed.
    let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").ok();
    if overcommit.as_deref().map(str::trim) == Some("0") {
        let r = Tensor::zeros(&[1 << 40], DType::F32, Device::Cpu);
        assert!(matches!(r, Err(Error::OutOfMemory { .. })));
    }
}

#[test]
fn materialising_a_view_past_memory_is_an_error() {
    // Views that take no memory but would make outputs of 2^45 elements (128 TiB of f32):
    // more than any 64-bit address space holds, so every host allocation is refused.
    let oom = |r: Result<Tensor>, what: &str| match r {
        Err(Error::OutOfMemory { .. }) | Err(Error::TooLarge { .. }) => {}
        Err(e) => panic!("{what}: an out-of-memory error expected, got {e}"),
        Ok(t) => panic!("{what}: Ok with shape {:?}", t.shape()),
    };
    let big = Tensor::ones(&[1], DType::F32, Device::Cpu)
        .unwrap()
        .expand(&[1 << 45])
        .unwrap();
    oom(big.exp(), "exp");
    oom(big.add(&big), "add");
    oom(big.to_dtype(DType::F16), "to_dtype");
    oom(big.contiguous(), "contiguous");
    assert!(big.to_vec::<f32>().is_err());
    assert!(big.to_vec_f64().is_err());
    // The sum reads the view without making it.
    assert_eq!(
        big.narrow(0, (1 << 45) - 3, 3)
            .unwrap()
            .sum_all()
            .unwrap()
            .item()
            .unwrap(),
        3.0
    );
    let idx = Tensor::from_vec(vec![0i64], &[1], Device::Cpu)
        .unwrap()
        .expand(&[1 << 40])
        .unwrap();
    let rows = Tensor::ones(&[1, 64], DType::F32, Device::Cpu).unwrap();
    oom(rows.index_select(0, &idx), "index_select of 2^40 rows");
    // A padding that makes the output and the unfolded columns terabytes.
    let x = Tensor::ones(&[1, 1, 4, 4], DType::F32, Device::Cpu).unwrap();
    let w = Tensor::ones(&[1, 1, 3, 3], DType::F32, Device::Cpu).unwrap();
    let opts = Conv2dOptions {
        padding: [1 << 20, 1 << 20],
        ..Default::default()
    };
    oom(x.conv2d(&w, None, opts), "conv2d with a 2^20 padding");
}

#[test]
fn integer_pow_is_exact() {
    for d in devices() {
        let base = Tensor::from_vec(vec![3i64, 2, -2, 1, -1, 0, 7], &[7], d).unwrap();
        let exp = Tensor::from_vec(vec![1i64, 10, 3, -5, -3, 0, 22], &[7], d).unwrap();
        let got = base.pow(&exp).unwrap().to_vec::<i64>().unwrap();
        // 7^22 is past 2^53: a float pow would round it.
        let want = vec![3, 1024, -8, 1, -1, 1, 3_909_821_048_582_988_049];
        assert_eq!(got, want, "{d}");
        // Negative exponents as PyTorch's integer pow: 1 / a^-b truncated.
        let neg = Tensor::from_vec(vec![2i64, -2, 5], &[3], d).unwrap();
        let e = Tensor::from_vec(vec![-1i64, -2, -1], &[3], d).unwrap();
        assert_eq!(neg.pow(&e).unwrap().to_vec::<i64>().unwrap(), vec![0, 0, 0]);
        // A negative integer scalar exponent is refused, as PyTorch refuses it.
        assert!(base.pow(-2i64).is_err(), "{d}");
        assert_eq!(
            base.pow(2i64).unwrap().to_vec::<i64>().unwrap(),
            vec![9, 4, 4, 1, 1, 0, 49]
        );
        let u = Tensor::from_vec(vec![3u8, 2, 2, 0], &[4], d).unwrap();
        let ue = Tensor::from_vec(vec![1u8, 7, 9, 0], &[4], d).unwrap();
        // u8 arithmetic wraps modulo 256, as PyTorch's: 2^9 is 0.
        assert_eq!(
            u.pow(&ue).unwrap().to_vec::<u8>().unwrap(),
            vec![3, 128, 0, 1]
        );
    }
}

/// A model and an Adam optimizer over its parameters, after one step (so it has a state).
fn trained(seed: u64) -> (Linear, Adam) {
    let m = Linear::new(3, 2, true, &mut Generator::new(seed)).unwrap();
    let mut opt = Adam::new(m.parameters(), AdamConfig::adam(1e-2)).unwrap();
    let x = Tensor::randn(&[4, 3], DType::F32, Device::Cpu).unwrap();
    m.forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    (m, opt)
}

/// The bytes of every model tensor, and of every optimizer state tensor by name.
type Bits = (Vec<Vec<u8>>, Vec<(String, Vec<u8>)>);

fn bits(m: &dyn Module, opt: &dyn Optimizer) -> Bits {
    let mut model = vec![];
    m.visit("", &mut |_, t, _| model.push(t.to_le_bytes().unwrap()));
    let state = opt
        .state_tensors()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_le_bytes().unwrap()))
        .collect();
    (model, state)
}

fn ckpt_path(name: &str) -> std::path::PathBuf {
    common::temp_checkpoint("hostile", name)
}

#[test]
fn a_refused_checkpoint_load_changes_nothing() {
    let path = ckpt_path("refused");
    let (m, opt) = trained(1);
    checkpoint::save(&path, &m, Some(&opt), &[]).unwrap();
    // The same model shape, different weights; an optimizer over only one of its parameters
    // (so the checkpoint's state for parameter 1 does not fit).
    let (mut m2, _) = trained(2);
    let mut opt2 = Adam::new(vec![m2.parameters()[0].clone()], AdamConfig::adam(1e-2)).unwrap();
    let x = Tensor::randn(&[4, 3], DType::F32, Device::Cpu).unwrap();
    m2.forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    opt2.step().unwrap();
    let before = bits(&m2, &opt2);
    let err = checkpoint::load(&path, &mut m2, Some(&mut opt2)).unwrap_err();
    assert!(matches!(err, Error::Checkpoint { .. }), "{err}");
    assert!(err.to_string().contains("optimizer state"), "{err}");
    assert_eq!(
        bits(&m2, &opt2),
        before,
        "the refused load changed the model or optimizer"
    );
    // A state whose moment has the wrong shape is refused by the optimizer alone too.
    let mut bad: BTreeMap<String, Tensor> = opt2.state_tensors().unwrap().into_iter().collect();
    bad.insert(
        "0.exp_avg".into(),
        Tensor::zeros(&[5], DType::F32, Device::Cpu).unwrap(),
    );
    assert!(opt2.load_state_tensors(&bad).is_err());
    assert_eq!(bits(&m2, &opt2), before);
    // The matching pair loads.
    let mut opt3 = Adam::new(m2.parameters(), AdamConfig::adam(1e-2)).unwrap();
    checkpoint::load(&path, &mut m2, Some(&mut opt3)).unwrap();
    assert_eq!(bits(&m2, &opt3), bits(&m, &opt));
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_refused_scaler_state_changes_nothing() {
    use mantissa::amp::{GradScaler, GradScalerConfig};
    let mut s = GradScaler::new(GradScalerConfig::default()).unwrap();
    let loss = Tensor::full(&[], 2.0, DType::F32, Device::Cpu).unwrap();
    s.scale(&loss).unwrap();
    let values = |s: &GradScaler| -> Vec<(String, Vec<f64>)> {
        let state = s.state_dict().unwrap();
        state
            .into_iter()
            .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
            .collect()
    };
    let before = values(&s);
    let good = s.state_dict().unwrap();
    for (name, bad) in [
        (
            "scale",
            Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap(),
        ),
        (
            "growth_interval",
            Tensor::full(&[], -3.0, DType::F32, Device::Cpu).unwrap(),
        ),
        (
            "growth_interval",
            Tensor::full(&[], f64::NAN, DType::F32, Device::Cpu).unwrap(),
        ),
    ] {
        let state: Vec<(String, Tensor)> = good
            .iter()
            .map(|(n, t)| (n.clone(), if n == name { bad.clone() } else { t.clone() }))
            .collect();
        assert!(s.load_state_dict(&state).is_err(), "{name}");
        assert_eq!(values(&s), before, "a refused {name} changed the scaler");
    }
}

#[test]
fn checkpoint_saves_do_not_follow_planted_links_or_collide() {
    let path = ckpt_path("links");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    // A victim file, and a link planted at the temporary name a predictable scheme
    // (`.{name}.tmp-{pid}`) would use.
    let victim = path.with_file_name("victim");
    std::fs::write(&victim, b"precious").unwrap();
    #[cfg(unix)]
    {
        let planted = path.with_file_name(format!(".ck.safetensors.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, planted).unwrap();
    }
    let (m, opt) = trained(3);
    // Saves from several threads of this process to one path all succeed, and the file
    // they leave is a whole checkpoint.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| checkpoint::save(&path, &m, Some(&opt), &[]).unwrap());
        }
    });
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    let (mut m2, mut opt2) = trained(4);
    checkpoint::load(&path, &mut m2, Some(&mut opt2)).unwrap();
    assert_eq!(bits(&m2, &opt2), bits(&m, &opt));
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// A gzip stream of `header` followed by `zeros` zero bytes.
fn gzip(header: &[u8], zeros: usize) -> Vec<u8> {
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(header).unwrap();
    let block = vec![0u8; 1 << 16];
    let mut left = zeros;
    while left > 0 {
        let n = left.min(block.len());
        z.write_all(&block[..n]).unwrap();
        left -= n;
    }
    z.finish().unwrap()
}

#[test]
fn a_gzip_bomb_is_refused_with_little_allocated() {
    let dir = std::env::temp_dir().join(format!("mantissa-bomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let inflated = 64 << 20;
    // A header for 10 bytes of data, followed by 64 MiB of zeros; and a wrong magic number.
    let cases = [
        ("small-dims", gzip(&[0, 0, 8, 1, 0, 0, 0, 10], inflated)),
        ("bad-magic", gzip(&[0x50, 0x4b, 3, 4], inflated)),
    ];
    for (name, bytes) in cases {
        assert!(bytes.len() < inflated / 100, "the bomb should be small");
        let path = dir.join(name);
        std::fs::write(&path, &bytes).unwrap();
        let (r, peak) = peak_during(|| mnist::read_idx(&path));
        let e = r.unwrap_err().to_string();
        assert!(e.contains("trailing") || e.contains("magic"), "{name}: {e}");
        // The compressed file itself, plus the header's implied size and small buffers.
        assert!(
            peak < bytes.len() + (1 << 20),
            "{name}: {peak} bytes allocated for a {}-byte file",
            bytes.len()
        );
    }
    // Dims whose product wraps, with no data, are an error too.
    let mut wraps = vec![0u8, 0, 8, 4];
    for _ in 0..4 {
        wraps.extend_from_slice(&65536u32.to_be_bytes());
    }
    assert!(mnist::parse_idx(&wraps, &dir).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Records the first draw of each worker thread's default generator.
struct Draws {
    seen: Mutex<BTreeMap<String, f64>>,
    both: Barrier,
}

impl Dataset for Draws {
    fn len(&self) -> usize {
        8
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![1]
    }
    fn fill(&self, i: usize, x: &mut [f32]) -> Result<i64> {
        let v = Tensor::rand(&[1], DType::F64, Device::Cpu)?.to_vec::<f64>()?[0];
        let name = std::thread::current().name().unwrap_or("main").to_string();
        self.seen.lock().unwrap().entry(name).or_insert(v);
        if i < 2 {
            // The first two batches go to the two workers; both draw before either goes on.
            self.both.wait();
        }
        x[0] = v as f32;
        Ok(i as i64)
    }
}

fn worker_draws(seed: u64) -> (BTreeMap<String, f64>, Vec<f32>) {
    let ds = Arc::new(Draws {
        seen: Mutex::new(BTreeMap::new()),
        both: Barrier::new(2),
    });
    let cfg = DataLoaderConfig {
        num_workers: 2,
        seed,
        ..DataLoaderConfig::new(1)
    };
    let mut dl = DataLoader::new(ds.clone(), cfg).unwrap();
    let xs: Vec<f32> = dl
        .epoch(0)
        .map(|b| b.unwrap().x.to_vec::<f32>().unwrap()[0])
        .collect();
    drop(dl);
    let seen = ds.seen.lock().unwrap().clone();
    (seen, xs)
}

#[test]
fn loader_workers_draw_distinct_reproducible_numbers() {
    let (a, xa) = worker_draws(5);
    assert_eq!(a.len(), 2, "{a:?}");
    let v: Vec<f64> = a.values().copied().collect();
    assert_ne!(v[0], v[1], "two workers drew the same number");
    let (b, xb) = worker_draws(5);
    assert_eq!(a, b, "the same seed gave other draws");
    assert_eq!(xa, xb, "the same seed gave other batches");
    let (c, _) = worker_draws(6);
    assert_ne!(a, c, "another seed gave the same draws");
}

#[test]
fn loader_configs_that_cannot_work_are_refused() {
    let ds = Arc::new(Draws {
        seen: Mutex::new(BTreeMap::new()),
        both: Barrier::new(1),
    });
    for cfg in [
        DataLoaderConfig {
            num_workers: 2,
            prefetch_factor: 1 << 63,
            ..DataLoaderConfig::new(4)
        },
        DataLoaderConfig::new(0),
        DataLoaderConfig {
            num_workers: 1 << 40,
            ..DataLoaderConfig::new(4)
        },
        DataLoaderConfig {
            prefetch_factor: 0,
            ..DataLoaderConfig::new(4)
        },
    ] {
        assert!(DataLoader::new(ds.clone(), cfg).is_err(), "{cfg:?}");
    }
}

/// Compiles only for types that are not `Send` (two blanket impls become ambiguous for a
/// `Send` type).
trait AmbiguousIfSend<A> {
    fn not_send() {}
}
impl<T: ?Sized> AmbiguousIfSend<()> for T {}
impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}

#[test]
fn guards_dropped_out_of_order_restore_the_state() {
    <NoGradGuard as AmbiguousIfSend<_>>::not_send();
    <amp::AutocastGuard as AmbiguousIfSend<_>>::not_send();
    let outer = NoGradGuard::new();
    let inner = NoGradGuard::new();
    drop(outer);
    assert!(!is_grad_enabled(), "the inner guard is still alive");
    drop(inner);
    assert!(
        is_grad_enabled(),
        "gradients stay off after both guards are gone"
    );

    let outer = amp::autocast(DType::F16).unwrap();
    let inner = amp::autocast(DType::BF16).unwrap();
    let hole = amp::autocast_disabled();
    drop(inner);
    assert_eq!(
        amp::active_dtype(),
        None,
        "the disabled region is the newest"
    );
    drop(hole);
    assert_eq!(amp::active_dtype(), Some(DType::F16));
    drop(outer);
    assert_eq!(
        amp::active_dtype(),
        None,
        "autocast stays on after every guard is gone"
    );
}
