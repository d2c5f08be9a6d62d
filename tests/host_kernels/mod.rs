//! The kernel files run on the host, for tests: a kernel file with its prelude, exactly the
//! text NVRTC compiles, is built as C++ into a shared library (with `tests/emulator/host_shim.h`
//! standing in for the CUDA built-ins) and
//! called with the launchers' own argument structs, then compared with the CPU backend. This
//! checks the kernels' arithmetic and indexing without a GPU: directly called, a kernel runs
//! as one thread; kernels built on block reductions run through [`run_grid`], one fiber per
//! CUDA thread with real barriers and emulated warp shuffles. Not checked: speed, and
//! behaviour under the GPU's memory model. Skipped where no C++ compiler is found.

mod amp;
mod attention;
mod cast;
mod elementwise;
mod flash;
mod index;
mod norm;
mod optim;
mod parts;
mod pool;
mod reduce;
mod rows;
mod sort;

use super::kernels;
use crate::{DType, Device, Tensor};
use libloading::Library;
use std::collections::HashMap;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// Kernel file `name` built for the host and loaded, or `None` without a C++ compiler. A
/// file that does not build is a failure, with the compiler's message.
pub(super) fn library(name: &str) -> Option<&'static Library> {
    static LIBS: OnceLock<Mutex<HashMap<String, &'static Library>>> = OnceLock::new();
    let mut libs = LIBS.get_or_init(Default::default).lock().unwrap();
    if let Some(lib) = libs.get(name) {
        return Some(lib);
    }
    let dir = std::env::temp_dir().join(format!("mantissa-host-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shim = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/emulator/host_shim.h");
    let source = kernels::source(name).expect("a kernel file");
    let (cpp, so) = (
        dir.join(format!("{name}.cpp")),
        dir.join(format!("lib{name}.so")),
    );
    let text =
        format!("#include \"{shim}\"\n{source}\n#define MANTISSA_HOST_TAIL\n#include \"{shim}\"\n");
    std::fs::write(&cpp, text).unwrap();
    // Extra compiler flags, for sanitizer runs: MANTISSA_HOST_KERNEL_FLAGS="-fsanitize=address"
    // with the sanitizer's runtime preloaded (see the README).
    let extra = std::env::var("MANTISSA_HOST_KERNEL_FLAGS").unwrap_or_default();
    let out = cxx(|c| {
        c.args(["-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-x", "c++"])
            .args(extra.split_whitespace())
            .arg(&cpp)
            .arg("-o")
            .arg(&so)
    })?;
    assert!(
        out.status.success(),
        "{name}.cu does not build on the host:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the library was just built from the kernel file; it runs no code on load.
    let lib: &'static Library = Box::leak(Box::new(unsafe { Library::new(&so) }.unwrap()));
    // Loaded libraries stay mapped: the files can go (the folder once it is empty).
    let _ = (std::fs::remove_file(&cpp), std::fs::remove_file(&so));
    let _ = std::fs::remove_dir(&dir);
    libs.insert(name.to_string(), lib);
    Some(lib)
}

/// The host C++ compiler (`CXX`, else `c++`) run with the arguments `args` adds; `None`,
/// saying so, when there is none.
pub(super) fn cxx(args: impl FnOnce(&mut Command) -> &mut Command) -> Option<std::process::Output> {
    let name = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    match args(&mut Command::new(&name)).output() {
        Ok(out) => Some(out),
        Err(e) => {
            eprintln!("skipped: no C++ compiler ({name}: {e})");
            None
        }
    }
}

/// The symbol `name` of `lib` as a function pointer of type `F`.
pub(super) fn function<F: Copy>(lib: &Library, name: &str) -> F {
    // SAFETY: each caller names `F` as the kernel's C signature.
    unsafe { *lib.get::<F>(name.as_bytes()).unwrap() }
}

pub(super) fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut g = crate::Generator::new(seed);
    Tensor::randn_with(shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap()
}

/// The elements of an `[n, c, h, w]` tensor in NCHW or NHWC memory order.
pub(super) fn in_order(t: &Tensor, nhwc: bool) -> Vec<f32> {
    match nhwc {
        true => t.permute(&[0, 2, 3, 1]).unwrap().to_vec::<f32>().unwrap(),
        false => t.to_vec::<f32>().unwrap(),
    }
}

pub(super) fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
            "{what}: [{i}] {g} vs {w}"
        );
    }
}

/// Asserts `got` is within norm-wise relative error `tol` of `want`.
pub(super) fn near<T: crate::dtype::WithDType, U: crate::dtype::WithDType>(
    got: &[T],
    want: &[U],
    tol: f64,
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let diff = got.iter().zip(want).map(|(a, b)| a.to_f64() - b.to_f64());
    let num: f64 = diff.map(|d| d * d).sum();
    let den: f64 = want.iter().map(|b| b.to_f64() * b.to_f64()).sum();
    let err = (num / den).sqrt();
    assert!(err <= tol, "{what}: relative error {err:.2e}");
}

/// A buffer's address, which a kernel call may carry across the emulated threads of
/// [`run_grid`]: [`Addr::of_mut`] for a buffer the kernel writes.
#[derive(Clone, Copy)]
pub(super) struct Addr(usize);

impl Addr {
    pub(super) fn of<T>(v: &[T]) -> Addr {
        Addr(v.as_ptr() as usize)
    }
    pub(super) fn of_mut<T>(v: &mut [T]) -> Addr {
        Addr(v.as_mut_ptr() as usize)
    }
    pub(super) fn ptr<T>(self) -> *mut T {
        self.0 as *mut T
    }
}

/// Runs `launch` (a kernel call) as a grid of `blocks` blocks of `threads` threads, through
/// the shim's `host_run_grid`: a block at a time, its threads as fibers on this thread that
/// take turns at each barrier.
pub(super) fn run_grid(lib: &Library, blocks: u32, threads: u32, launch: impl Fn()) {
    type Body = extern "C" fn(*mut std::ffi::c_void);
    type RunGrid = unsafe extern "C" fn(u32, u32, Body, *mut std::ffi::c_void) -> i32;
    extern "C" fn body(arg: *mut std::ffi::c_void) {
        // SAFETY: `arg` is the `&dyn Fn()` below, alive for the whole grid.
        let launch = unsafe { &*(arg as *const &dyn Fn()) };
        launch();
    }
    let run: RunGrid = function(lib, "host_run_grid");
    // One emulated grid of a library at a time: its shared memory is static, and the tests
    // run side by side.
    static ONE_GRID: Mutex<()> = Mutex::new(());
    let _one = ONE_GRID.lock().unwrap_or_else(|e| e.into_inner());
    let launch: &dyn Fn() = &launch;
    // SAFETY: the shim calls `body` with `arg` only while this call runs.
    let rc = unsafe { run(blocks, threads, body, &launch as *const _ as *mut _) };
    assert_eq!(rc, 0, "host_run_grid: no stacks for {threads} fibers");
}
