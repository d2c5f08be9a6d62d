//! `cuda/attention.cu` on the host, as real blocks of 32 threads with barriers, against the
//! CPU backend's fused attention: forward (output and log-sum-exp) and both backward kernels,
//! causal or not, with several tiles of queries and keys.

use super::{close, function, library, randn, run_grid, Addr};
use crate::backend::cpu::CpuStorage;
use crate::backend::{AttnDims, SoftmaxOps};
use crate::layout::Layout;

/// The values of an f32 storage (the CPU backend's results of f32 inputs).
pub(super) fn floats(s: CpuStorage) -> Vec<f32> {
    match s {
        CpuStorage::F32(v) => v,
        _ => unreachable!("f32 inputs give f32 results"),
    }
}

#[test]
fn attention_kernels_match_the_cpu_on_emulated_blocks() {
    let Some(lib) = library("attention") else {
        return;
    };
    type Fwd = unsafe extern "C" fn(
        *const f32,
        *const f32,
        *const f32,
        *mut f32,
        *mut f32,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        i32,
    ) -> ();
    // dq (with D) and dk/dv take the same argument types: six inputs, two outputs, sizes.
    type Bwd = unsafe extern "C" fn(
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *mut f32,
        *mut f32,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        i32,
    ) -> ();
    let fwd: Fwd = function(lib, "attn_forward_float");
    let bq: Bwd = function(lib, "attn_backward_q_float");
    let bkv: Bwd = function(lib, "attn_backward_kv_float");
    let (b, l, s, e, ev) = (2usize, 37usize, 45usize, 8usize, 5usize);
    let data = |shape: &[usize], seed| randn(shape, seed).to_vec::<f32>().unwrap();
    let (q, k, v, g) = (
        data(&[b, l, e], 1),
        data(&[b, s, e], 2),
        data(&[b, s, ev], 3),
        data(&[b, l, ev], 4),
    );
    let st = |x: &[f32]| CpuStorage::F32(x.to_vec());
    let lay = |rows: usize, w: usize| Layout::contiguous(&[b, rows, w]);
    for causal in [false, true] {
        let d = AttnDims {
            b,
            l,
            s,
            e,
            ev,
            scale: 0.4,
            causal,
        };
        let ((want_o, _), want_lse) = st(&q)
            .attention(&lay(l, e), (&st(&k), &lay(s, e)), (&st(&v), &lay(s, ev)), d)
            .unwrap();
        let (want_o, want_lse) = (floats(want_o), floats(want_lse));
        let (mut o, mut lse) = (vec![0f32; b * l * ev], vec![0f32; b * l]);
        let [qa, ka, va, ga] = [&q, &k, &v, &g].map(|x| Addr::of(x));
        let (oa, la) = (Addr::of_mut(&mut o), Addr::of_mut(&mut lse));
        let dims = [b, l, s, e, ev].map(|x| x as i64);
        let c = causal as i32;
        // Fewer blocks than tiles: blocks loop over them, as past 65,535 on the GPU.
        run_grid(lib, 3, 32, || {
            // SAFETY: every buffer holds the elements its [b, rows, width] shape gives; each
            // thread writes its own query's row.
            unsafe {
                fwd(
                    qa.ptr(),
                    ka.ptr(),
                    va.ptr(),
                    oa.ptr(),
                    la.ptr(),
                    dims[0],
                    dims[1],
                    dims[2],
                    dims[3],
                    dims[4],
                    0.4,
                    c,
                )
            }
        });
        close(&o, &want_o, &format!("output causal={causal}"));
        close(&lse, &want_lse, &format!("lse causal={causal}"));

        let [(wq, _), (wk, _), (wv, _)] = st(&q)
            .attention_backward(
                &lay(l, e),
                (&st(&k), &lay(s, e)),
                (&st(&v), &lay(s, ev)),
                (&st(&o), &lay(l, ev)),
                &st(&lse),
                (&st(&g), &lay(l, ev)),
                d,
            )
            .unwrap();
        let (mut dq, mut dsum) = (vec![0f32; b * l * e], vec![0f32; b * l]);
        let (mut dk, mut dv) = (vec![0f32; b * s * e], vec![0f32; b * s * ev]);
        let (oa, la) = (Addr::of(&o), Addr::of(&lse));
        let (dqa, dsa) = (Addr::of_mut(&mut dq), Addr::of_mut(&mut dsum));
        let (dka, dva) = (Addr::of_mut(&mut dk), Addr::of_mut(&mut dv));
        run_grid(lib, 2, 32, || {
            // SAFETY: as above; each thread writes its query's dq row and D.
            unsafe {
                bq(
                    qa.ptr(),
                    ka.ptr(),
                    va.ptr(),
                    oa.ptr(),
                    ga.ptr(),
                    la.ptr(),
                    dsa.ptr(),
                    dqa.ptr(),
                    dims[0],
                    dims[1],
                    dims[2],
                    dims[3],
                    dims[4],
                    0.4,
                    c,
                )
            }
        });
        let dsa = Addr::of(&dsum);
        run_grid(lib, 2, 32, || {
            // SAFETY: as above; each thread writes its key's dk and dv rows.
            unsafe {
                bkv(
                    qa.ptr(),
                    ka.ptr(),
                    va.ptr(),
                    ga.ptr(),
                    la.ptr(),
                    dsa.ptr(),
                    dka.ptr(),
                    dva.ptr(),
                    dims[0],
                    dims[1],
                    dims[2],
                    dims[3],
                    dims[4],
                    0.4,
                    c,
                )
            }
        });
        let tol = |got: &[f32], want: CpuStorage, what: &str| {
            let want = floats(want);
            let (num, den) = got.iter().zip(&want).fold((0.0, 0.0), |(n, d), (x, y)| {
                (n + ((x - y) as f64).powi(2), d + (*y as f64).powi(2))
            });
            assert!((num / den).sqrt() < 1e-5, "{what} causal={causal}");
        };
        tol(&dq, wq, "dq");
        tol(&dk, wk, "dk");
        tol(&dv, wv, "dv");
    }
}
