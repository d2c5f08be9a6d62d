//! Elementwise kernels (vectorised and scalar paths) and the fused LSTM cell, against the CPU
//! backend.

use super::{close, function, library, near, randn};
use crate::backend::ops::{BinaryOp, UnaryOp};
use crate::layout::Layout;
use crate::{bf16, Device, Tensor};
use libloading::Library;

/// Every binary op.
const BINARY_OPS: [BinaryOp; 7] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Max,
    BinaryOp::Min,
];

/// Every unary op (with sample parameters).
const UNARY_OPS: [UnaryOp; UnaryOp::ALL.len()] = UnaryOp::ALL;

type Unary<T> = unsafe extern "C" fn(i32, f32, f32, *const T, *mut T, i64) -> ();
type Binary<T> = unsafe extern "C" fn(i32, *const T, *const T, *mut T, i64) -> ();
type UnaryGradContiguous<T> = unsafe extern "C" fn(i32, f32, *const T, *const T, *mut T, i64) -> ();

/// A start index into `v` whose address is 16-byte aligned, plus `skew` elements.
fn start<T>(v: &[T], skew: usize) -> usize {
    let size = std::mem::size_of::<T>();
    (16 - v.as_ptr() as usize % 16) % 16 / size + skew
}

/// Runs the contiguous unary and binary kernels of dtype `T` (kernel suffix `t`) over every
/// op, through the vectorised path (aligned, with a tail) and the scalar one (misaligned),
/// and compares them with the CPU backend within `tol` (norm-wise).
fn elementwise_in<T: crate::dtype::WithDType>(lib: &Library, t: &str, tol: f64) {
    use crate::backend::Storage;
    let n = 37;
    let mut g = crate::Generator::new(9);
    let mk = |g: &mut crate::Generator| {
        Tensor::rand_with(&[n], 0.1, 2.1, T::DTYPE, Device::Cpu, g).unwrap()
    };
    let (x, y) = (mk(&mut g), mk(&mut g));
    let l = Layout::contiguous(&[n]);
    let to_vec = |s: Storage| Tensor::from_storage(s, &[n]).to_vec_f64().unwrap();
    let check =
        |got: &[T], want: Vec<f64>, what: &str| near(got, &want, tol, &format!("{what} ({t})"));
    let unary = UNARY_OPS;
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
            let (code, a, b) = crate::backend::cuda::elementwise::unary_code(op);
            let f: Unary<T> = function(lib, &format!("unary_{t}"));
            // SAFETY: every buffer holds n elements from its start.
            unsafe {
                f(
                    code,
                    a,
                    b,
                    xa[sx..].as_ptr(),
                    out[so..].as_mut_ptr(),
                    n as i64,
                )
            };
            let want = to_vec(x.storage().unary(&l, op).unwrap());
            check(&out[so..so + n], want, &format!("{op:?} skew {skew}"));
        }
        // The backward on contiguous operands (y as the incoming gradient).
        for op in unary {
            let (code, a, _) = crate::backend::cuda::elementwise::unary_code(op);
            let f: UnaryGradContiguous<T> = function(lib, &format!("unary_grad_contiguous_{t}"));
            // SAFETY: every buffer holds n elements from its start.
            unsafe {
                f(
                    code,
                    a,
                    xa[sx..].as_ptr(),
                    ya[sy..].as_ptr(),
                    out[so..].as_mut_ptr(),
                    n as i64,
                )
            };
            let want = to_vec(x.storage().unary_grad(&l, &y.storage(), &l, op).unwrap());
            check(
                &out[so..so + n],
                want,
                &format!("{op:?} backward skew {skew}"),
            );
        }
        for op in BINARY_OPS {
            let f: Binary<T> = function(lib, &format!("binary_{t}"));
            let code = op.code();
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
    let Some(lib) = library("elementwise") else {
        return;
    };
    elementwise_in::<f32>(lib, "float", 1e-6);
    elementwise_in::<crate::f16>(lib, "f16", 2e-3);
    elementwise_in::<bf16>(lib, "bf16", 1.6e-2);
}

#[test]
fn max_min_relu_and_clamp_kernels_keep_nan_as_the_cpu_does() {
    let Some(lib) = library("elementwise") else {
        return;
    };
    let n = 6;
    let nan = f32::NAN;
    let xs = vec![-2.0f32, nan, 0.5, 3.0, nan, -0.0];
    let ys = vec![1.0f32, 1.0, nan, -1.0, nan, 0.0];
    let (x, y) = (
        Tensor::from_vec(xs.clone(), &[n], Device::Cpu).unwrap(),
        Tensor::from_vec(ys.clone(), &[n], Device::Cpu).unwrap(),
    );
    let l = Layout::contiguous(&[n]);
    let same = |got: &[f32], want: crate::backend::Storage, what: &str| {
        let want = Tensor::from_storage(want, &[n]).to_vec::<f32>().unwrap();
        let ok = got
            .iter()
            .zip(&want)
            .all(|(g, w)| g == w || g.is_nan() && w.is_nan());
        assert!(ok, "{what}: {got:?} vs {want:?}");
    };
    let mut out = vec![0f32; n];
    let unary: Unary<f32> = function(lib, "unary_float");
    for op in [
        UnaryOp::Relu,
        UnaryOp::MaxScalar(0.25),
        UnaryOp::MinScalar(0.25),
    ] {
        let (code, a, b) = crate::backend::cuda::elementwise::unary_code(op);
        // SAFETY: every buffer holds n elements.
        unsafe { unary(code, a, b, xs.as_ptr(), out.as_mut_ptr(), n as i64) };
        same(&out, x.storage().unary(&l, op).unwrap(), &format!("{op:?}"));
    }
    let binary: Binary<f32> = function(lib, "binary_float");
    for op in [BinaryOp::Max, BinaryOp::Min] {
        let code = op.code();
        // SAFETY: as above.
        unsafe { binary(code, xs.as_ptr(), ys.as_ptr(), out.as_mut_ptr(), n as i64) };
        let want = x.storage().binary(&l, &y.storage(), &l, op).unwrap();
        same(&out, want, &format!("{op:?}"));
    }
}

#[test]
fn lstm_cell_kernels_match_the_cpu() {
    use crate::backend::CellGrads;
    let Some(lib) = library("rnn") else { return };
    type Forward = unsafe extern "C" fn(*const f32, *const f32, i64, *mut f32, i64, i64) -> ();
    type Backward = unsafe extern "C" fn(
        *const f32,
        *const f32,
        i64,
        *const f32,
        i64,
        *const f32,
        i64,
        *const f32,
        i64,
        *mut f32,
        i64,
        i64,
    ) -> ();
    let (b, h) = (3, 5);
    // The cell state and the gradients as views with row strides other than h: c in
    // [B, 2H], dh and dc in [B, 3H], dh2 in [B, H].
    let (g, cw, dw, d2) = (
        randn(&[b, 4 * h], 10),
        randn(&[b, 2 * h], 11),
        randn(&[b, 3 * h], 12),
        randn(&[b, h], 13),
    );
    let l = |t: &Tensor| Layout::contiguous(t.shape());
    let view = |w: usize, off: usize| Layout::new(vec![b, h], vec![w, 1], off);
    let (lc, ldh, ldc) = (view(2 * h, h), view(3 * h, 0), view(3 * h, 2 * h));
    let fwd = g.storage().lstm_cell(&l(&g), &cw.storage(), &lc).unwrap();
    let want_f = Tensor::from_storage(fwd, &[b, 2 * h])
        .to_vec::<f32>()
        .unwrap();
    let (gs, cs, ds, d2s) = (
        g.to_vec::<f32>().unwrap(),
        cw.to_vec::<f32>().unwrap(),
        dw.to_vec::<f32>().unwrap(),
        d2.to_vec::<f32>().unwrap(),
    );
    let mut out_f = vec![0f32; b * 2 * h];
    let f: Forward = function(lib, "lstm_cell_float");
    let bk: Backward = function(lib, "lstm_cell_backward_float");
    let (b64, h64) = (b as i64, h as i64);
    // SAFETY: the buffers hold [B, 4H], [B, 2H] and the output's elements.
    unsafe {
        f(
            gs.as_ptr(),
            cs.as_ptr().add(h),
            2 * h64,
            out_f.as_mut_ptr(),
            b64,
            h64,
        )
    };
    close(&out_f, &want_f, "lstm_cell");
    for second in [false, true] {
        let (dws, d2st) = (dw.storage(), d2.storage());
        let bwd = g
            .storage()
            .lstm_cell_backward(
                &l(&g),
                &cw.storage(),
                &lc,
                CellGrads {
                    dh: (&dws, &ldh),
                    dh2: second.then_some((&*d2st, &l(&d2))),
                    dc: (&dws, &ldc),
                },
            )
            .unwrap();
        let want_b = Tensor::from_storage(bwd, &[b, 5 * h])
            .to_vec::<f32>()
            .unwrap();
        let mut out_b = vec![0f32; b * 5 * h];
        let dh2 = if second {
            d2s.as_ptr()
        } else {
            std::ptr::null()
        };
        // SAFETY: as above; the gradients hold [B, 3H] and [B, H] elements.
        unsafe {
            bk(
                gs.as_ptr(),
                cs.as_ptr().add(h),
                2 * h64,
                ds.as_ptr(),
                3 * h64,
                dh2,
                h64,
                ds.as_ptr().add(2 * h),
                3 * h64,
                out_b.as_mut_ptr(),
                b64,
                h64,
            )
        };
        close(
            &out_b,
            &want_b,
            &format!("lstm_cell backward, dh2 {second}"),
        );
    }
}

#[test]
fn i64_arithmetic_kernel_matches_the_cpu() {
    use crate::backend::cuda::storage::Strided;
    let Some(lib) = library("elementwise") else {
        return;
    };
    type I64Binary =
        unsafe extern "C" fn(i32, *const i64, Strided, *const i64, Strided, *mut i64, i64) -> ();
    let f: I64Binary = function(lib, "binary_strided_i64");
    // Sums, differences and products that wrap modulo 2^64, and values past 2^53.
    let xs = vec![7i64, i64::MAX, 5, (1 << 53) + 1, i64::MIN, 3_037_000_500];
    let ys = vec![2i64, 2, -3, 3, 4, 3_037_000_500];
    // y is seen transposed against x: [2, 3] and the [3, 2] buffer's transpose.
    let lx = Layout::contiguous(&[2, 3]);
    let ly = Layout::contiguous(&[3, 2]).permute("t", &[1, 0]).unwrap();
    let x = Tensor::from_vec(xs.clone(), &[2, 3], Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys.clone(), &[3, 2], Device::Cpu).unwrap();
    for op in BINARY_OPS {
        let want = x.storage().binary(&lx, &y.storage(), &ly, op).unwrap();
        let want = Tensor::from_storage(want, &[2, 3]).to_vec::<i64>().unwrap();
        let mut out = vec![0i64; 6];
        let code = op.code();
        let (sx, sy) = (
            Strided::new("t", &lx).unwrap(),
            Strided::new("t", &ly).unwrap(),
        );
        // SAFETY: both inputs hold 6 elements under their views; the output 6.
        unsafe { f(code, xs.as_ptr(), sx, ys.as_ptr(), sy, out.as_mut_ptr(), 6) };
        assert_eq!(out, want, "{op:?}");
    }
}

#[test]
fn u8_arithmetic_kernel_matches_the_cpu() {
    use crate::backend::cuda::storage::Strided;
    let Some(lib) = library("elementwise") else {
        return;
    };
    type U8Binary =
        unsafe extern "C" fn(i32, *const u8, Strided, *const u8, Strided, *mut u8, i64) -> ();
    let f: U8Binary = function(lib, "binary_strided_u8");
    // Values whose sums, differences, products and powers wrap modulo 256; a zero divisor.
    let xs = vec![0u8, 200, 255, 16, 3, 7];
    let ys = vec![200u8, 100, 2, 17, 0, 9];
    let lx = Layout::contiguous(&[2, 3]);
    let ly = Layout::contiguous(&[3, 2]).permute("t", &[1, 0]).unwrap();
    let x = Tensor::from_vec(xs.clone(), &[2, 3], Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys.clone(), &[3, 2], Device::Cpu).unwrap();
    for op in BINARY_OPS {
        let want = x.storage().binary(&lx, &y.storage(), &ly, op).unwrap();
        let want = Tensor::from_storage(want, &[2, 3]).to_vec::<u8>().unwrap();
        let mut out = vec![0u8; 6];
        let (sx, sy) = (
            Strided::new("t", &lx).unwrap(),
            Strided::new("t", &ly).unwrap(),
        );
        // SAFETY: both inputs hold 6 elements under their views; the output 6.
        unsafe {
            f(
                op.code(),
                xs.as_ptr(),
                sx,
                ys.as_ptr(),
                sy,
                out.as_mut_ptr(),
                6,
            )
        };
        assert_eq!(out, want, "{op:?}");
    }
}

#[test]
fn unary_grad_kernel_matches_the_cpu_including_its_conventions() {
    use crate::backend::cuda::storage::Strided;
    let Some(lib) = library("elementwise") else {
        return;
    };
    type UnaryGrad = unsafe extern "C" fn(
        i32,
        f32,
        *const f32,
        Strided,
        *const f32,
        Strided,
        *mut f32,
        i64,
    ) -> ();
    let f: UnaryGrad = function(lib, "unary_grad_float");
    // Random values, and the points where a derivative is a convention (0, +-1, 0.25).
    let mut xs = randn(&[64], 41).to_vec::<f32>().unwrap();
    xs.extend([0.0, -0.0, 1.0, -1.0, 0.25, 2.0]);
    let n = xs.len();
    let gs = randn(&[n], 42).to_vec::<f32>().unwrap();
    let x = Tensor::from_vec(xs.clone(), &[n], Device::Cpu).unwrap();
    let g = Tensor::from_vec(gs.clone(), &[n], Device::Cpu).unwrap();
    let l = Layout::contiguous(&[n]);
    // Every op, and the exponents 0 whose derivatives are conventions.
    let extra = [UnaryOp::PowScalar(0.0), UnaryOp::ScalarPow(0.0)];
    let ops = UNARY_OPS.into_iter().chain(extra);
    let mut out = vec![0f32; n];
    let s = Strided::new("t", &l).unwrap();
    for op in ops {
        let (code, a, _) = crate::backend::cuda::elementwise::unary_code(op);
        // SAFETY: every buffer holds n elements.
        unsafe {
            f(
                code,
                a,
                xs.as_ptr(),
                s,
                gs.as_ptr(),
                s,
                out.as_mut_ptr(),
                n as i64,
            )
        };
        let want = x.storage().unary_grad(&l, &g.storage(), &l, op).unwrap();
        let want = Tensor::from_storage(want, &[n]).to_vec::<f32>().unwrap();
        // Non-finite values (0^x for x < 0) must agree exactly; the rest closely.
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            let same = a == b || (a.is_nan() && b.is_nan());
            assert!(
                same || (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{op:?} at x = {}: kernel {a}, CPU {b}",
                xs[i]
            );
        }
    }
}

#[test]
fn strided_unary_kernel_reads_the_view() {
    use crate::backend::cuda::storage::Strided;
    let Some(lib) = library("elementwise") else {
        return;
    };
    fn check<T: crate::dtype::WithDType>(lib: &Library, t: &str, tol: f64) {
        // A transposed view with an offset into a [5, 8] buffer: element (i, j) at 2 + i + 8j.
        let buf = Tensor::rand_with(
            &[5, 8],
            0.1,
            2.1,
            T::DTYPE,
            Device::Cpu,
            &mut crate::Generator::new(61),
        )
        .unwrap();
        let l = Layout::new(vec![4, 5], vec![1, 8], 2);
        let xs = buf.to_vec::<T>().unwrap();
        type StridedUnary<T> =
            unsafe extern "C" fn(i32, f32, f32, *const T, Strided, *mut T, i64) -> ();
        let f: StridedUnary<T> = function(lib, &format!("unary_strided_{t}"));
        let mut out = vec![T::default(); 20];
        for op in UNARY_OPS {
            let (code, a, b) = crate::backend::cuda::elementwise::unary_code(op);
            let s = Strided::new("t", &l).unwrap();
            // SAFETY: the view stays inside the 40 elements; the output holds 20.
            unsafe { f(code, a, b, xs.as_ptr(), s, out.as_mut_ptr(), 20) };
            let want = buf.storage().unary(&l, op).unwrap();
            let want: Vec<f64> = Tensor::from_storage(want, &[4, 5]).to_vec_f64().unwrap();
            near(&out, &want, tol, &format!("{op:?} ({t})"));
        }
    }
    check::<f32>(lib, "float", 1e-6);
    check::<crate::f16>(lib, "f16", 2e-3);
    check::<bf16>(lib, "bf16", 1.6e-2);
}

/// Every comparison in every dtype on a transposed view against a broadcast row, NaN and ties
/// included; then `where` with a mask broadcast along the other dim.
#[test]
fn compare_and_where_kernels_match_the_cpu_in_every_dtype() {
    use crate::backend::cuda::storage::Strided;
    use crate::backend::ops::CmpOp;
    let Some(lib) = library("elementwise") else {
        return;
    };
    type Cmp<T> =
        unsafe extern "C" fn(i32, *const T, Strided, *const T, Strided, *mut u8, i64) -> ();
    type Where<T> = unsafe extern "C" fn(
        *const u8,
        Strided,
        *const T,
        Strided,
        *const T,
        Strided,
        *mut T,
        i64,
    ) -> ();
    fn check<T: crate::dtype::WithDType>(lib: &Library, t: &str) {
        let float = T::DTYPE.is_float();
        let nan = if float { f32::NAN } else { 7.0 };
        // x: a [4, 3] buffer seen as [3, 4]; y: a [4] row broadcast over 3 rows.
        let xs = [2.0, 1.0, 0.0, 3.0, 2.0, 1.0, 0.0, 5.0, nan, 1.0, 2.0, 3.0];
        let ys = [2.0, 1.0, 0.0, nan];
        let x = Tensor::from_vec(xs.to_vec(), &[4, 3], Device::Cpu).unwrap();
        let y = Tensor::from_vec(ys.to_vec(), &[4], Device::Cpu).unwrap();
        let (x, y) = (x.to_dtype(T::DTYPE).unwrap(), y.to_dtype(T::DTYPE).unwrap());
        let lx = Layout::contiguous(&[4, 3]).permute("t", &[1, 0]).unwrap();
        let ly = Layout::new(vec![3, 4], vec![0, 1], 0);
        let (xv, yv) = (x.to_vec::<T>().unwrap(), y.to_vec::<T>().unwrap());
        let (sx, sy) = (
            Strided::new("t", &lx).unwrap(),
            Strided::new("t", &ly).unwrap(),
        );
        let f: Cmp<T> = function(lib, &format!("cmp_{t}"));
        let ops = [
            CmpOp::Eq,
            CmpOp::Ne,
            CmpOp::Lt,
            CmpOp::Le,
            CmpOp::Gt,
            CmpOp::Ge,
        ];
        for (code, op) in ops.into_iter().enumerate() {
            let mut out = [9u8; 12];
            // SAFETY: the views stay inside 12 and 4 elements; the output holds 12.
            unsafe {
                f(
                    code as i32,
                    xv.as_ptr(),
                    sx,
                    yv.as_ptr(),
                    sy,
                    out.as_mut_ptr(),
                    12,
                )
            };
            let want = x.storage().cmp(&lx, &y.storage(), &ly, op).unwrap();
            let want = Tensor::from_storage(want, &[3, 4]).to_vec::<u8>().unwrap();
            assert_eq!(out.to_vec(), want, "{op:?} ({t})");
            assert!(out.contains(&1) && out.contains(&0));
        }
        // where(mask, x, y): a [3] mask broadcast along the columns.
        let m = Tensor::from_vec(vec![1u8, 0, 1], &[3], Device::Cpu).unwrap();
        let lm = Layout::new(vec![3, 4], vec![1, 0], 0);
        let sm = Strided::new("t", &lm).unwrap();
        let w: Where<T> = function(lib, &format!("where_{t}"));
        let mut out = vec![T::default(); 12];
        let mv = m.to_vec::<u8>().unwrap();
        // SAFETY: as above; the mask holds 3 elements.
        unsafe {
            w(
                mv.as_ptr(),
                sm,
                xv.as_ptr(),
                sx,
                yv.as_ptr(),
                sy,
                out.as_mut_ptr(),
                12,
            )
        };
        let want = m
            .storage()
            .where_cond(&lm, &x.storage(), &lx, &y.storage(), &ly)
            .unwrap();
        let want = Tensor::from_storage(want, &[3, 4]).to_vec_f64().unwrap();
        let got: Vec<f64> = out.iter().map(|v| v.to_f64()).collect();
        let same = |a: &f64, b: &f64| a == b || (a.is_nan() && b.is_nan());
        assert!(
            got.iter().zip(&want).all(|(a, b)| same(a, b)),
            "where ({t}): {got:?} vs {want:?}"
        );
    }
    check::<f32>(lib, "float");
    check::<crate::f16>(lib, "f16");
    check::<bf16>(lib, "bf16");
    check::<i64>(lib, "i64");
    check::<u8>(lib, "u8");
}
