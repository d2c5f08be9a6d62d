//! Row kernels built on block reductions (softmax, the fused cross-entropy), run as real
//! blocks of threads on the host, against the CPU backend.

use super::{close, function, library, randn, run_grid, Addr};
use crate::backend::Storage;
use crate::layout::Layout;
use crate::{Device, Tensor};

const ROWS: usize = 5;
const COLS: usize = 77;

#[test]
fn softmax_kernel_matches_the_cpu_on_emulated_blocks() {
    let Some(lib) = library("softmax_xent") else {
        return;
    };
    type Softmax = unsafe extern "C" fn(*const f32, *mut f32, i64, i64, i32, f32, i64) -> ();
    let f: Softmax = function(lib, "softmax_rows_float");
    let x = randn(&[ROWS, COLS], 30).mul(3.0).unwrap();
    let xs = x.to_vec::<f32>().unwrap();
    for log in [false, true] {
        let l = Layout::contiguous(&[ROWS, COLS]);
        let want = x.storage().softmax(&l, 1, log).unwrap();
        let want = Tensor::from_storage(want, &[ROWS, COLS])
            .to_vec::<f32>()
            .unwrap();
        let mut out = vec![0f32; ROWS * COLS];
        let (xa, oa) = (Addr::of(&xs), Addr::of_mut(&mut out));
        // Fewer blocks than rows: each block strides over rows, as on the GPU past 65535.
        run_grid(lib, 2, 64, || {
            // SAFETY: x and out hold ROWS x COLS elements; threads write distinct elements.
            unsafe {
                f(
                    xa.ptr(),
                    oa.ptr(),
                    ROWS as i64,
                    COLS as i64,
                    log as i32,
                    1.0,
                    0,
                )
            }
        });
        close(&out, &want, &format!("softmax log={log}"));
    }
}

#[test]
fn fused_cross_entropy_kernels_match_the_cpu_on_emulated_blocks() {
    let Some(lib) = library("softmax_xent") else {
        return;
    };
    type Forward = unsafe extern "C" fn(
        *const f32,
        *const i64,
        *mut f32,
        *mut f32,
        i64,
        i64,
        i64,
        f32,
        *mut i32,
        i32,
    ) -> ();
    type Backward = unsafe extern "C" fn(
        *const f32,
        *const i64,
        *const f32,
        *const f32,
        *mut f32,
        i64,
        i64,
        i64,
        f32,
    ) -> ();
    let (fwd, bwd): (Forward, Backward) = (
        function(lib, "xent_rows_float"),
        function(lib, "xent_backward_float"),
    );
    let x0 = randn(&[ROWS, COLS], 31).mul(2.0).unwrap();
    // Row 2 is ignored (ignore_index 3).
    let targets = vec![0i64, 76, 3, 40, 5];
    let t = Tensor::from_vec(targets.clone(), &[ROWS], Device::Cpu).unwrap();
    let g = randn(&[ROWS], 32);
    let gs = g.to_vec::<f32>().unwrap();
    let l = Layout::contiguous(&[ROWS, COLS]);
    let lt = Layout::contiguous(&[ROWS]);
    for eps in [0.0, 0.1] {
        // Without smoothing, a masked (-inf) logit that is not the target leaves the loss
        // finite (with smoothing the loss is +inf, as in PyTorch).
        let mut xs = x0.to_vec::<f32>().unwrap();
        if eps == 0.0 {
            xs[COLS + 5] = f32::NEG_INFINITY;
        }
        let x = Tensor::from_vec(xs.clone(), &[ROWS, COLS], Device::Cpu).unwrap();
        let (loss, lse) = x
            .storage()
            .cross_entropy(&l, &t.storage(), &lt, 3, eps)
            .unwrap();
        let dx = x
            .storage()
            .cross_entropy_backward(&l, &t.storage(), &lt, &lse, &g.storage(), &lt, 3, eps)
            .unwrap();
        let vals = |s: Storage, n: usize| Tensor::from_storage(s, &[n]).to_vec::<f32>().unwrap();
        let (want_loss, want_lse) = (vals(loss, ROWS), vals(lse, ROWS));
        let want_dx = vals(dx, ROWS * COLS);
        let (mut loss, mut lse) = (vec![0f32; ROWS], vec![0f32; ROWS]);
        let (mut dx, mut fault) = (vec![0f32; ROWS * COLS], vec![0i32]);
        let a = [
            Addr::of(&xs),
            Addr::of_mut(&mut loss),
            Addr::of_mut(&mut lse),
            Addr::of(&gs),
            Addr::of_mut(&mut dx),
        ];
        let (ta, fa) = (Addr::of(&targets), Addr::of_mut(&mut fault));
        let (r, c, e) = (ROWS as i64, COLS as i64, eps as f32);
        run_grid(lib, 3, 64, || {
            // SAFETY: the buffers hold the rows' elements; thread 0 of a block writes a row's
            // loss and lse, and the threads write distinct gradient elements.
            unsafe {
                fwd(
                    a[0].ptr(),
                    ta.ptr(),
                    a[1].ptr(),
                    a[2].ptr(),
                    r,
                    c,
                    3,
                    e,
                    fa.ptr(),
                    9,
                )
            }
        });
        run_grid(lib, 2, 64, || {
            // SAFETY: as above.
            unsafe {
                bwd(
                    a[0].ptr(),
                    ta.ptr(),
                    a[2].ptr(),
                    a[3].ptr(),
                    a[4].ptr(),
                    r,
                    c,
                    3,
                    e,
                )
            }
        });
        assert_eq!(fault[0], 0, "no fault for valid targets");
        close(&loss, &want_loss, &format!("loss eps={eps}"));
        close(&lse, &want_lse, &format!("lse eps={eps}"));
        close(&dx, &want_dx, &format!("gradient eps={eps}"));
    }
    // A target out of range: that row's loss is NaN and the fault flag holds the slot.
    let bad = vec![0i64, 77, 3, 40, 5];
    let xs = x0.to_vec::<f32>().unwrap();
    let (mut loss, mut lse, mut fault) = (vec![0f32; ROWS], vec![0f32; ROWS], vec![0i32]);
    let (xa, ba, la, za, fa) = (
        Addr::of(&xs),
        Addr::of(&bad),
        Addr::of_mut(&mut loss),
        Addr::of_mut(&mut lse),
        Addr::of_mut(&mut fault),
    );
    run_grid(lib, 5, 32, || {
        // SAFETY: as above.
        unsafe {
            fwd(
                xa.ptr(),
                ba.ptr(),
                la.ptr(),
                za.ptr(),
                ROWS as i64,
                COLS as i64,
                3,
                0.0,
                fa.ptr(),
                9,
            )
        }
    });
    assert_eq!(fault[0], 9);
    assert!(loss[1].is_nan() && loss[0].is_finite() && loss[3].is_finite());
}
