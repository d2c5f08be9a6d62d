//! Pooling kernels, NCHW and NHWC, forward and backward, against the CPU backend.

use super::{close, function, in_order, library, randn};
use crate::backend::cuda::pool::{args, PoolArgs};
use crate::backend::spec::PoolDims;
use crate::{AvgPool2dOptions, MaxPool2dOptions};

enum Pooling {
    Max(MaxPool2dOptions),
    Avg(AvgPool2dOptions),
    Adaptive([usize; 2]),
}

type Forward = unsafe extern "C" fn(*const f32, *mut f32, PoolArgs);
type MaxForward = unsafe extern "C" fn(*const f32, *mut f32, *mut i64, PoolArgs);
type MaxBackward = unsafe extern "C" fn(*const f32, *const i64, *mut f32, PoolArgs);
type TapsForward = unsafe extern "C" fn(*const f32, *mut f32, *mut u8, PoolArgs);
type TapsBackward = unsafe extern "C" fn(*const f32, *const u8, *mut f32, PoolArgs);

#[test]
fn pooling_kernels_match_the_cpu_in_both_memory_orders() {
    let Some(lib) = library("pool") else { return };
    let cases = [
        Pooling::Max(MaxPool2dOptions::new(2)),
        // ResNet's stem: 3 x 3 windows, stride 2, padding 1 (overlapping windows).
        Pooling::Max(MaxPool2dOptions {
            kernel: [3, 3],
            stride: Some([2, 2]),
            padding: [1, 1],
            dilation: [1, 1],
            ceil_mode: false,
        }),
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
        Pooling::Adaptive([1, 1]),
    ];
    let Some(vlib) = library("pool_vec") else {
        return;
    };
    // Three channels, rows of 9: the element kernels; eight channels, rows of 8: the vector
    // kernels too (two vectors of four f32 channels per pixel channels-last; two vectors of
    // four cells per row in NCHW).
    check_cases((lib, vlib), &cases, &randn(&[2, 3, 7, 9], 1));
    check_cases((lib, vlib), &cases, &randn(&[2, 8, 7, 8], 1));
}

/// Every case's kernels on x against the CPU, NCHW and NHWC; with `c` a multiple of 4, NHWC
/// through the vector kernels (`*_cl_*`) as well, and with rows a multiple of 4, NCHW through
/// the row kernels (`*_rows_*`) where the op has them.
fn check_cases(
    (lib, vlib): (&libloading::Library, &libloading::Library),
    cases: &[Pooling],
    x: &crate::Tensor,
) {
    let (c, h, w) = (x.shape()[1], x.shape()[2], x.shape()[3]);
    for case in cases {
        // The CPU's forward and input gradient for an upstream gradient g.
        let leaf = x.copy().unwrap().requires_grad(true).unwrap();
        let (y, params) = match case {
            Pooling::Max(o) => (leaf.max_pool2d(*o).unwrap(), Some(o.params())),
            Pooling::Avg(o) => (leaf.avg_pool2d(*o).unwrap(), Some(o.params())),
            Pooling::Adaptive(s) => (leaf.adaptive_avg_pool2d(*s).unwrap(), None),
        };
        let g = randn(y.shape(), 2);
        y.backward_with(&g).unwrap();
        let gx = leaf.grad().unwrap();
        for nhwc in [false, true] {
            let what = format!("{} nhwc={nhwc}", name(case));
            let d = PoolDims {
                planes: 2 * c,
                c,
                h,
                w,
                ho: y.shape()[2],
                wo: y.shape()[3],
                channels_last: nhwc,
            };
            let a = args(&d, params.as_ref());
            let xs = in_order(x, nhwc);
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
                    // The positions as u8 taps within the window (what the launcher uses for
                    // these windows) ...
                    let mut taps = vec![0u8; y.numel()];
                    let f: TapsForward = function(lib, "max_pool2d_taps_float");
                    f(xs.as_ptr(), out.as_mut_ptr(), taps.as_mut_ptr(), a);
                    let b: TapsBackward = function(lib, "max_pool2d_taps_backward_float");
                    b(gs.as_ptr(), taps.as_ptr(), back.as_mut_ptr(), a);
                    close(&out, &in_order(&y, nhwc), &format!("{what} forward (taps)"));
                    close(
                        &back,
                        &in_order(&gx, nhwc),
                        &format!("{what} backward (taps)"),
                    );
                    // ... and as i64 in-plane indices (windows of more than 255 taps).
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
            if nhwc && c % 4 == 0 {
                let (mut out, mut back) = (vec![0f32; y.numel()], vec![0f32; x.numel()]);
                // SAFETY: as above; c is a multiple of the vector's four channels.
                unsafe {
                    if let Pooling::Max(_) = case {
                        let mut taps = vec![0u8; y.numel()];
                        let f: TapsForward = function(vlib, "max_pool2d_taps_cl_float");
                        f(xs.as_ptr(), out.as_mut_ptr(), taps.as_mut_ptr(), a);
                        let b: TapsBackward = function(vlib, "max_pool2d_taps_cl_backward_float");
                        b(gs.as_ptr(), taps.as_ptr(), back.as_mut_ptr(), a);
                    } else {
                        let f: Forward = function(vlib, &format!("{stem}_cl_float"));
                        f(xs.as_ptr(), out.as_mut_ptr(), a);
                        let b: Forward = function(vlib, &format!("{stem}_cl_backward_float"));
                        b(gs.as_ptr(), back.as_mut_ptr(), a);
                    }
                }
                close(
                    &out,
                    &in_order(&y, nhwc),
                    &format!("{what} forward (vectors)"),
                );
                close(
                    &back,
                    &in_order(&gx, nhwc),
                    &format!("{what} backward (vectors)"),
                );
            }
            if !nhwc && w % 4 == 0 {
                check_rows(vlib, case, a, (&xs, &gs), (&y, &gx), &what);
            }
        }
    }
}

/// The NCHW row kernels where the case has them: max pooling forward (output rows of a
/// multiple of 4) and backward, adaptive average pooling backward; against the CPU's `y`
/// and `gx`.
fn check_rows(
    vlib: &libloading::Library,
    case: &Pooling,
    a: PoolArgs,
    (xs, gs): (&[f32], &[f32]),
    (y, gx): (&crate::Tensor, &crate::Tensor),
    what: &str,
) {
    let mut back = vec![0f32; gx.numel()];
    match case {
        Pooling::Max(_) => {
            // The CPU's taps for the backward, from the element kernel's forward.
            let (mut out, mut taps) = (vec![0f32; y.numel()], vec![0u8; y.numel()]);
            let wo = y.shape()[3];
            // SAFETY: the buffers hold the element counts the arguments describe; rows of a
            // multiple of 4 cells (checked by the callers and here).
            unsafe {
                if wo % 4 == 0 {
                    let f: TapsForward = function(vlib, "max_pool2d_taps_rows_float");
                    f(xs.as_ptr(), out.as_mut_ptr(), taps.as_mut_ptr(), a);
                    close(&out, &in_order(y, false), &format!("{what} forward (rows)"));
                } else {
                    let lib = super::library("pool").expect("built above");
                    let f: TapsForward = function(lib, "max_pool2d_taps_float");
                    f(xs.as_ptr(), out.as_mut_ptr(), taps.as_mut_ptr(), a);
                }
                let b: TapsBackward = function(vlib, "max_pool2d_taps_rows_backward_float");
                b(gs.as_ptr(), taps.as_ptr(), back.as_mut_ptr(), a);
            }
        }
        Pooling::Adaptive(_) => {
            let b: Forward = function(vlib, "adaptive_avg_pool2d_rows_backward_float");
            // SAFETY: as above.
            unsafe { b(gs.as_ptr(), back.as_mut_ptr(), a) };
        }
        Pooling::Avg(_) => return,
    }
    close(
        &back,
        &in_order(gx, false),
        &format!("{what} backward (rows)"),
    );
}

fn name(p: &Pooling) -> String {
    match p {
        Pooling::Max(o) => format!("max {o:?}"),
        Pooling::Avg(o) => format!("avg {o:?}"),
        Pooling::Adaptive(s) => format!("adaptive {s:?}"),
    }
}
