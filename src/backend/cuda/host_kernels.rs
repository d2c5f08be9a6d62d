//! The kernel files run on the host, for tests: a kernel file with its prelude, exactly the
//! text NVRTC compiles, is built as C++ into a shared library (with `cuda/host_shim.h`
//! standing in for the CUDA built-ins: a grid of one thread, atomics as plain updates) and
//! called with the launchers' own argument structs, then compared with the CPU backend. This
//! checks the kernels' index arithmetic (NCHW and NHWC pooling, indexing, strided writes)
//! without a GPU; not their parallel behaviour or speed, and not kernels built on warp
//! reductions. Skipped where no C++ compiler is found.

use super::index::base;
use super::kernels;
use super::pool::{args, PoolArgs};
use super::storage::Strided;
use crate::backend::cpu::PoolDims;
use crate::backend::ops::Pool2dParams;
use crate::layout::Layout;
use crate::{bf16, AvgPool2dOptions, DType, Device, MaxPool2dOptions, Tensor};
use libloading::Library;
use std::collections::HashMap;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// Kernel file `name` built for the host and loaded, or `None` without a C++ compiler. A
/// file that does not build is a failure, with the compiler's message.
fn library(name: &str) -> Option<&'static Library> {
    static LIBS: OnceLock<Mutex<HashMap<String, &'static Library>>> = OnceLock::new();
    let mut libs = LIBS.get_or_init(Default::default).lock().unwrap();
    if let Some(lib) = libs.get(name) {
        return Some(lib);
    }
    let dir = std::env::temp_dir().join(format!("mantissa-host-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shim = concat!(env!("CARGO_MANIFEST_DIR"), "/cuda/host_shim.h");
    let source = kernels::source(name).expect("a kernel file");
    let (cpp, so) = (
        dir.join(format!("{name}.cpp")),
        dir.join(format!("lib{name}.so")),
    );
    let text =
        format!("#include \"{shim}\"\n{source}\n#define MANTISSA_HOST_TAIL\n#include \"{shim}\"\n");
    std::fs::write(&cpp, text).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = match Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-x", "c++"])
        .arg(&cpp)
        .arg("-o")
        .arg(&so)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipped: no C++ compiler ({cxx}: {e})");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "{name}.cu does not build on the host:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the library was just built from the kernel file; it runs no code on load.
    let lib: &'static Library = Box::leak(Box::new(unsafe { Library::new(&so) }.unwrap()));
    libs.insert(name.to_string(), lib);
    Some(lib)
}

/// The symbol `name` of `lib` as a function pointer of type `F`.
fn function<F: Copy>(lib: &Library, name: &str) -> F {
    // SAFETY: each caller names `F` as the kernel's C signature.
    unsafe { *lib.get::<F>(name.as_bytes()).unwrap() }
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut g = crate::Generator::new(seed);
    Tensor::randn_with(shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap()
}

/// The elements of an `[n, c, h, w]` tensor in NCHW or NHWC memory order.
fn in_order(t: &Tensor, nhwc: bool) -> Vec<f32> {
    match nhwc {
        true => t.permute(&[0, 2, 3, 1]).unwrap().to_vec::<f32>().unwrap(),
        false => t.to_vec::<f32>().unwrap(),
    }
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
            "{what}: [{i}] {g} vs {w}"
        );
    }
}

enum Pooling {
    Max(MaxPool2dOptions),
    Avg(AvgPool2dOptions),
    Adaptive([usize; 2]),
}

type Forward = unsafe extern "C" fn(*const f32, *mut f32, PoolArgs);
type MaxForward = unsafe extern "C" fn(*const f32, *mut f32, *mut i64, PoolArgs);
type MaxBackward = unsafe extern "C" fn(*const f32, *const i64, *mut f32, PoolArgs);

#[test]
fn pooling_kernels_match_the_cpu_in_both_memory_orders() {
    let Some(lib) = library("pool") else { return };
    let cases = [
        Pooling::Max(MaxPool2dOptions::new(2)),
        Pooling::Max(MaxPool2dOptions {
            kernel: [3, 2],
            stride: Some([2, 1]),
            padding: [1, 1],
            dilation: [1, 2],
            ceil_mode: true,
        }),
        Pooling::Avg(AvgPool2dOptions {
            kernel: [3, 3],
            stride: Some([2, 2]),
            padding: [1, 1],
            ceil_mode: true,
            count_include_pad: false,
        }),
        Pooling::Avg(AvgPool2dOptions {
            kernel: [3, 2],
            stride: Some([1, 2]),
            padding: [1, 0],
            ceil_mode: false,
            count_include_pad: true,
        }),
        Pooling::Adaptive([3, 4]),
        Pooling::Adaptive([13, 11]),
    ];
    let x = randn(&[2, 3, 7, 9], 1);
    for case in &cases {
        // The CPU's forward and input gradient for an upstream gradient g.
        let leaf = x.copy().unwrap().requires_grad(true).unwrap();
        let (y, params) = match case {
            Pooling::Max(o) => (leaf.max_pool2d(*o).unwrap(), Some(params_max(o))),
            Pooling::Avg(o) => (leaf.avg_pool2d(*o).unwrap(), Some(params_avg(o))),
            Pooling::Adaptive(s) => (leaf.adaptive_avg_pool2d(*s).unwrap(), None),
        };
        let g = randn(y.shape(), 2);
        y.backward_with(&g).unwrap();
        let gx = leaf.grad().unwrap();
        for nhwc in [false, true] {
            let what = format!("{} nhwc={nhwc}", name(case));
            let d = PoolDims {
                planes: 6,
                c: 3,
                h: 7,
                w: 9,
                ho: y.shape()[2],
                wo: y.shape()[3],
                channels_last: nhwc,
            };
            let a = args(&d, params.as_ref());
            let xs = in_order(&x, nhwc);
            let gs = in_order(&g, nhwc);
            let mut out = vec![0f32; y.numel()];
            let mut back = vec![0f32; x.numel()];
            let stem = match case {
                Pooling::Max(_) => "max_pool2d",
                Pooling::Avg(_) => "avg_pool2d",
                Pooling::Adaptive(_) => "adaptive_avg_pool2d",
            };
            // SAFETY: the buffers hold the element counts the arguments describe.
            unsafe {
                if let Pooling::Max(_) = case {
                    let mut idx = vec![0i64; y.numel()];
                    let f: MaxForward = function(lib, "max_pool2d_float");
                    f(xs.as_ptr(), out.as_mut_ptr(), idx.as_mut_ptr(), a);
                    let b: MaxBackward = function(lib, "max_pool2d_backward_float");
                    b(gs.as_ptr(), idx.as_ptr(), back.as_mut_ptr(), a);
                } else {
                    let f: Forward = function(lib, &format!("{stem}_float"));
                    f(xs.as_ptr(), out.as_mut_ptr(), a);
                    let b: Forward = function(lib, &format!("{stem}_backward_float"));
                    b(gs.as_ptr(), back.as_mut_ptr(), a);
                }
            }
            close(&out, &in_order(&y, nhwc), &format!("{what} forward"));
            close(&back, &in_order(&gx, nhwc), &format!("{what} backward"));
        }
    }
}

fn name(p: &Pooling) -> String {
    match p {
        Pooling::Max(o) => format!("max {o:?}"),
        Pooling::Avg(o) => format!("avg {o:?}"),
        Pooling::Adaptive(s) => format!("adaptive {s:?}"),
    }
}

fn params_max(o: &MaxPool2dOptions) -> Pool2dParams {
    Pool2dParams {
        kernel: o.kernel,
        stride: o.stride.unwrap_or(o.kernel),
        padding: o.padding,
        dilation: o.dilation,
        ceil_mode: o.ceil_mode,
        count_include_pad: false,
    }
}

fn params_avg(o: &AvgPool2dOptions) -> Pool2dParams {
    Pool2dParams {
        kernel: o.kernel,
        stride: o.stride.unwrap_or(o.kernel),
        padding: o.padding,
        dilation: [1, 1],
        ceil_mode: o.ceil_mode,
        count_include_pad: o.count_include_pad,
    }
}

type Take = unsafe extern "C" fn(
    *const u32,
    Strided,
    *const i64,
    i64,
    i64,
    i64,
    i64,
    *mut u32,
    i64,
    *mut i32,
    i32,
) -> ();

/// Runs `take_u32` as index_select (`select`) or gather over `x` viewed by `l`; returns the
/// output and the fault flag.
fn take(
    lib: &Library,
    x: &[f32],
    l: &Layout,
    dim: usize,
    idx: &[i64],
    out_shape: &[usize],
    select: bool,
) -> (Vec<f32>, i32) {
    let (b, dim_stride) = base("take", l, out_shape, dim).unwrap();
    let inner = match select {
        true => out_shape[dim + 1..].iter().product::<usize>() as i64,
        false => 0,
    };
    let n: usize = out_shape.iter().product();
    let mut out = vec![0f32; n];
    let mut fault = 0i32;
    let f: Take = function(lib, "take_u32");
    // SAFETY: `x` holds the view's elements, `idx` its entries, `out` the n outputs; f32s
    // travel as their 32-bit patterns.
    unsafe {
        f(
            x.as_ptr().cast(),
            b,
            idx.as_ptr(),
            inner,
            idx.len() as i64,
            l.shape()[dim] as i64,
            dim_stride,
            out.as_mut_ptr().cast(),
            n as i64,
            &mut fault,
            7,
        )
    };
    (out, fault)
}

#[test]
fn take_kernel_selects_gathers_and_flags_bad_indices() {
    let Some(lib) = library("index") else { return };
    let x = randn(&[6, 7], 3);
    let xs = x.to_vec::<f32>().unwrap();
    let cpu_idx =
        |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape, Device::Cpu).unwrap();
    // index_select along dim 1 of the transposed view [7, 6].
    let t = Layout::contiguous(&[6, 7]).permute("t", &[1, 0]).unwrap();
    let rows = [5i64, 0, 0, 3, 5];
    let (got, fault) = take(lib, &xs, &t, 1, &rows, &[7, 5], true);
    let want = x
        .t()
        .unwrap()
        .index_select(1, &cpu_idx(&rows, &[5]))
        .unwrap();
    assert_eq!(
        (got, fault),
        (want.to_vec::<f32>().unwrap(), 0),
        "index_select"
    );
    // gather along dim 0 with a [2, 4] index.
    let g = [5i64, 5, 0, 1, 1, 1, 2, 4];
    let (got, fault) = take(
        lib,
        &xs,
        &Layout::contiguous(&[6, 7]),
        0,
        &g,
        &[2, 4],
        false,
    );
    let want = x.gather(0, &cpu_idx(&g, &[2, 4])).unwrap();
    assert_eq!((got, fault), (want.to_vec::<f32>().unwrap(), 0), "gather");
    // An index out of range: the slot in the flag, 0 in its place, the others as usual.
    let (got, fault) = take(
        lib,
        &xs,
        &Layout::contiguous(&[6, 7]),
        0,
        &[2, 6],
        &[2, 7],
        true,
    );
    assert_eq!(fault, 7);
    assert_eq!(&got[..7], &xs[14..21]);
    assert_eq!(&got[7..], &[0.0; 7]);
}

type AddAt<T> = unsafe extern "C" fn(
    *mut T,
    Strided,
    i64,
    *const i64,
    i64,
    i64,
    i64,
    *const T,
    Strided,
    i64,
    *mut i32,
    i32,
) -> ();

#[test]
fn add_at_kernel_adds_in_the_cpus_order() {
    let Some(lib) = library("index") else { return };
    // scatter_add along dim 0 of an f32 [4, 6] from a larger source [10, 7] through a
    // [10, 6] index with repeats: one thread adds in the index's order, as the CPU does.
    let x = randn(&[4, 6], 4);
    let src = randn(&[10, 7], 5);
    let ids: Vec<i64> = (0..60).map(|i| (i * i) % 4).collect();
    let index = Tensor::from_vec(ids.clone(), &[10, 6], Device::Cpu).unwrap();
    let want = x.scatter_add(0, &index, &src).unwrap();
    let mut dst = x.to_vec::<f32>().unwrap();
    let sl = Layout::contiguous(&[10, 7]);
    let sview = Layout::new(vec![10, 6], sl.strides().to_vec(), 0);
    let (db, dim_stride) = base("scatter_add", &Layout::contiguous(&[4, 6]), &[10, 6], 0).unwrap();
    let srcv = src.to_vec::<f32>().unwrap();
    let mut fault = 0;
    let f: AddAt<f32> = function(lib, "add_at_float");
    // SAFETY: the buffers hold the elements the views describe.
    unsafe {
        f(
            dst.as_mut_ptr(),
            db,
            dim_stride,
            ids.as_ptr(),
            0,
            60,
            4,
            srcv.as_ptr(),
            Strided::new("scatter_add", &sview).unwrap(),
            60,
            &mut fault,
            3,
        )
    };
    assert_eq!(fault, 0);
    assert_eq!(dst, want.to_vec::<f32>().unwrap(), "scatter_add f32");

    // index_add along dim 1 in bf16 (the backward of index_select), rounding after each
    // addition as the CPU does: bit for bit.
    let w = randn(&[3, 5], 6)
        .to_dtype(DType::BF16)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let cols = [4i64, 0, 4, 2, 4, 4];
    let sel = Tensor::from_vec(cols.to_vec(), &[6], Device::Cpu).unwrap();
    let y = w.index_select(1, &sel).unwrap();
    let g = randn(&[3, 6], 7).to_dtype(DType::BF16).unwrap();
    y.backward_with(&g).unwrap();
    let want = w.grad().unwrap().to_vec::<bf16>().unwrap();
    let mut dst = vec![bf16::ZERO; 15];
    let gs = g.to_vec::<bf16>().unwrap();
    let (db, dim_stride) = base("index_add", &Layout::contiguous(&[3, 5]), &[3, 6], 1).unwrap();
    let f: AddAt<bf16> = function(lib, "add_at_bf16");
    // SAFETY: as above.
    unsafe {
        f(
            dst.as_mut_ptr(),
            db,
            dim_stride,
            cols.as_ptr(),
            1,
            6,
            5,
            gs.as_ptr(),
            Strided::new("index_add", &Layout::contiguous(&[3, 6])).unwrap(),
            18,
            &mut fault,
            3,
        )
    };
    assert_eq!(fault, 0);
    assert_eq!(dst, want, "index_add bf16");
}

#[test]
fn copy_into_strided_writes_only_the_view() {
    let Some(lib) = library("cast") else { return };
    type Copy = unsafe extern "C" fn(*const u32, Strided, *mut u32, i64) -> ();
    let f: Copy = function(lib, "copy_into_strided_u32");
    // Columns 2..5 of a [4, 6] tensor, and the transpose of a [3, 4] block at offset 1.
    for view in [
        Layout::contiguous(&[4, 6]).narrow("t", 1, 2, 3).unwrap(),
        Layout::new(vec![4, 3], vec![1, 6], 1),
    ] {
        let n = view.numel() as u32;
        let src: Vec<u32> = (100..100 + n).collect();
        let mut dst = vec![0u32; 24];
        // SAFETY: `src` holds the view's elements; the view lies inside `dst`.
        unsafe {
            f(
                src.as_ptr(),
                Strided::new("copy_", &view).unwrap(),
                dst.as_mut_ptr(),
                n as i64,
            )
        };
        let mut want = vec![0u32; 24];
        for (v, o) in src.iter().zip(view.offsets()) {
            want[o] = *v;
        }
        assert_eq!(dst, want, "{view:?}");
    }
}

type Unary<T> = unsafe extern "C" fn(i32, f32, f32, *const T, *mut T, i64) -> ();
type Binary<T> = unsafe extern "C" fn(i32, *const T, *const T, *mut T, i64) -> ();

/// A start index into `v` whose address is 16-byte aligned, plus `skew` elements.
fn start<T>(v: &[T], skew: usize) -> usize {
    let size = std::mem::size_of::<T>();
    (16 - v.as_ptr() as usize % 16) % 16 / size + skew
}

/// Runs the contiguous unary and binary kernels of dtype `T` (kernel suffix `t`) over every
/// op, through the vectorised path (aligned, with a tail) and the scalar one (misaligned),
/// and compares them with the CPU backend within `tol` (norm-wise).
fn elementwise_in<T: crate::dtype::WithDType>(lib: &Library, t: &str, tol: f64) {
    use crate::backend::ops::{BinaryOp, UnaryOp};
    use crate::backend::Storage;
    let n = 37;
    let mut g = crate::Generator::new(9);
    let mk = |g: &mut crate::Generator| {
        Tensor::rand_with(&[n], 0.1, 2.1, T::DTYPE, Device::Cpu, g).unwrap()
    };
    let (x, y) = (mk(&mut g), mk(&mut g));
    let l = Layout::contiguous(&[n]);
    let to_vec = |s: Storage| Tensor::from_storage(s, &[n]).to_vec_f64().unwrap();
    let check = |got: &[T], want: Vec<f64>, what: &str| {
        let got: Vec<f64> = got.iter().map(|v| v.to_f64()).collect();
        let num: f64 = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        assert!((num / den).sqrt() <= tol, "{what} ({t}): {got:?} vs {want:?}");
    };
    let unary = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Log1p,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::LeakyRelu(0.1),
        UnaryOp::GeluErf,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Affine { mul: 1.5, add: -0.25 },
        UnaryOp::PowScalar(1.7),
        UnaryOp::ScalarPow(1.3),
        UnaryOp::MaxScalar(1.0),
        UnaryOp::MinScalar(1.0),
    ];
    let (xs, ys) = (x.to_vec::<T>().unwrap(), y.to_vec::<T>().unwrap());
    // Room to place each buffer at an aligned start, or one element past it.
    let pad = |v: &[T]| [v, &[T::default(); 16][..]].concat();
    let (xp, yp) = (pad(&xs), pad(&ys));
    for skew in [0, 1] {
        let mut xa = xp.clone();
        let (sx, sy) = (start(&xa, skew), start(&yp, skew));
        xa.copy_within(0..n, sx);
        let mut ya = yp.clone();
        ya.copy_within(0..n, sy);
        let mut out = vec![T::default(); n + 16];
        let so = start(&out, skew);
        for op in unary {
            let (code, a, b) = super::ops::unary_code(op);
            let f: Unary<T> = function(lib, &format!("unary_{t}"));
            // SAFETY: every buffer holds n elements from its start.
            unsafe { f(code, a, b, xa[sx..].as_ptr(), out[so..].as_mut_ptr(), n as i64) };
            let want = to_vec(x.storage().unary(&l, op).unwrap());
            check(&out[so..so + n], want, &format!("{op:?} skew {skew}"));
        }
        for op in [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Pow,
            BinaryOp::Max,
            BinaryOp::Min,
        ] {
            let f: Binary<T> = function(lib, &format!("binary_{t}"));
            let code = super::ops::binary_code(op);
            // SAFETY: as above.
            unsafe {
                f(
                    code,
                    xa[sx..].as_ptr(),
                    ya[sy..].as_ptr(),
                    out[so..].as_mut_ptr(),
                    n as i64,
                )
            };
            let want = to_vec(x.storage().binary(&l, &y.storage(), &l, op).unwrap());
            check(&out[so..so + n], want, &format!("{op:?} skew {skew}"));
        }
    }
}

#[test]
fn elementwise_kernels_match_the_cpu_vectorised_and_not() {
    let Some(lib) = library("elementwise") else { return };
    elementwise_in::<f32>(lib, "float", 1e-6);
    elementwise_in::<crate::f16>(lib, "f16", 2e-3);
    elementwise_in::<bf16>(lib, "bf16", 1.6e-2);
}
