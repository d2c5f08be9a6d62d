//! `cuda/flash.cu` on the host with fewer blocks than tiles, so that each block loops over
//! several (query or key) tiles, as past 65,535 blocks on the GPU: the reuse of shared
//! memory and of the `cp.async` stages from one tile of a block to its next. bf16, head 64,
//! causal, against the CPU backend's fused attention of the same rounded values.

use super::attention::floats;
use super::{function, library, near, randn, run_grid, Addr};
use crate::backend::cpu::CpuStorage;
use crate::backend::cuda::flash::{contiguous_rows, FaAll};
use crate::backend::{AttnDims, SoftmaxOps};
use crate::layout::Layout;

#[test]
fn flash_kernels_loop_over_tiles_past_the_grid() {
    let Some(lib) = library("flash") else {
        return;
    };
    type Fwd = unsafe extern "C" fn(
        *const u16,
        *const u16,
        *const u16,
        *mut u16,
        *mut f32,
        i64,
        i64,
        i64,
        f32,
        i32,
        FaAll,
    ) -> ();
    type Prep = unsafe extern "C" fn(*const u16, *const u16, *mut f32, i64, i64, FaAll) -> ();
    // dk/dv: q, k, v, dout, lse, D, dk, dv; dq: the same with dq alone.
    type Bkv = unsafe extern "C" fn(
        *const u16,
        *const u16,
        *const u16,
        *const u16,
        *const f32,
        *const f32,
        *mut u16,
        *mut u16,
        i64,
        i64,
        i64,
        f32,
        i32,
        FaAll,
    ) -> ();
    type Bq = unsafe extern "C" fn(
        *const u16,
        *const u16,
        *const u16,
        *const u16,
        *const f32,
        *const f32,
        *mut u16,
        i64,
        i64,
        i64,
        f32,
        i32,
        FaAll,
    ) -> ();
    let fwd: Fwd = function(lib, "flash_forward_bf16_64");
    let prep: Prep = function(lib, "flash_prep_bf16_64");
    let bkv: Bkv = function(lib, "flash_backward_kv_bf16_64");
    let bq: Bq = function(lib, "flash_backward_q_bf16_64");
    // Two query tiles and three key tiles per pair, three pairs: 6 and 9 tiles for 1 block.
    let (b, l, s, e) = (3usize, 100usize, 150usize, 64usize);
    let bits = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| crate::bf16::from_f32(v).to_bits())
            .collect()
    };
    let back = |x: &[u16]| -> Vec<f32> {
        x.iter()
            .map(|&v| crate::bf16::from_bits(v).to_f32())
            .collect()
    };
    let data = |shape: &[usize], seed| bits(&randn(shape, seed).to_vec::<f32>().unwrap());
    let (q, k, v, g) = (
        data(&[b, l, e], 1),
        data(&[b, s, e], 2),
        data(&[b, s, e], 3),
        data(&[b, l, e], 4),
    );
    let (ql, sl) = (contiguous_rows(l, e), contiguous_rows(s, e));
    let rows = FaAll {
        q: ql,
        k: sl,
        v: sl,
        o: ql,
        dout: ql,
        dq: ql,
        dk: sl,
        dv: sl,
    };
    let (bl, ll, sl64) = (b as i64, l as i64, s as i64);
    let scale = 0.125f32;
    let (mut o, mut lse) = (vec![0u16; b * l * e], vec![0f32; b * l]);
    let [qa, ka, va, ga] = [&q, &k, &v, &g].map(|x| Addr::of(x));
    let (oa, la) = (Addr::of_mut(&mut o), Addr::of_mut(&mut lse));
    run_grid(lib, 1, 128, || {
        // SAFETY: every buffer holds the elements its contiguous [b, rows, 64] shape gives.
        unsafe {
            fwd(
                qa.ptr(),
                ka.ptr(),
                va.ptr(),
                oa.ptr(),
                la.ptr(),
                bl,
                ll,
                sl64,
                scale,
                1,
                rows,
            )
        }
    });
    let mut dsum = vec![0f32; b * l];
    let (oa, dsa) = (Addr::of(&o), Addr::of_mut(&mut dsum));
    // SAFETY: as above; one thread walks every row.
    unsafe { prep(oa.ptr(), ga.ptr(), dsa.ptr(), bl * ll, ll, rows) };
    let (mut dq, mut dk, mut dv) = (
        vec![0u16; b * l * e],
        vec![0u16; b * s * e],
        vec![0u16; b * s * e],
    );
    let (la, dsa) = (Addr::of(&lse), Addr::of(&dsum));
    let (dka, dva, dqa) = (
        Addr::of_mut(&mut dk),
        Addr::of_mut(&mut dv),
        Addr::of_mut(&mut dq),
    );
    run_grid(lib, 1, 128, || {
        // SAFETY: as above; each warp writes its keys' dk and dv rows.
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
                bl,
                ll,
                sl64,
                scale,
                1,
                rows,
            )
        }
    });
    run_grid(lib, 1, 128, || {
        // SAFETY: as above; each warp writes its queries' dq rows.
        unsafe {
            bq(
                qa.ptr(),
                ka.ptr(),
                va.ptr(),
                ga.ptr(),
                la.ptr(),
                dsa.ptr(),
                dqa.ptr(),
                bl,
                ll,
                sl64,
                scale,
                1,
                rows,
            )
        }
    });
    let st = |x: &[u16]| CpuStorage::F32(back(x));
    let lay = |r: usize| Layout::contiguous(&[b, r, e]);
    let d = AttnDims {
        b,
        l,
        s,
        e,
        ev: e,
        scale: scale as f64,
        causal: true,
    };
    let ((want_o, _), want_lse) = st(&q)
        .attention(&lay(l), (&st(&k), &lay(s)), (&st(&v), &lay(s)), d)
        .unwrap();
    near(&back(&o), &floats(want_o), 8e-3, "output");
    near(&lse, &floats(want_lse), 1e-5, "log-sum-exp");
    let [(wq, _), (wk, _), (wv, _)] = st(&q)
        .attention_backward(
            &lay(l),
            (&st(&k), &lay(s)),
            (&st(&v), &lay(s)),
            (&st(&o), &lay(l)),
            &CpuStorage::F32(lse.clone()),
            (&st(&g), &lay(l)),
            d,
        )
        .unwrap();
    near(&back(&dq), &floats(wq), 8e-3, "dq");
    near(&back(&dk), &floats(wk), 8e-3, "dk");
    near(&back(&dv), &floats(wv), 8e-3, "dv");
}
