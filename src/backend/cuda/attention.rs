//! Launchers of `cuda/attention.cu`: fused attention without a mask or dropout, forward (one
//! launch) and backward (two: dq with each query's `do . o`, then dk and dv). Blocks of 32
//! threads, one per query (or key) row, the other side's rows through shared memory. Where
//! cuDNN's fused attention takes the problem (`dnn_sdpa.rs`: f16/bf16, head sizes a multiple
//! of 8 up to 128), it runs instead; where it does not and the tensor-core kernels apply
//! (f16/bf16, head size 64 or 128: `flash.rs`), they do.

use super::kernels::KernelFile;
use super::storage::{float_kname, CudaStorage};
use super::{dnn_sdpa, flash};
use crate::backend::AttnDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Rows per block (`ATT_TILE`) and the largest head size (`ATT_MAX_E`) of the kernels.
const TILE: usize = 32;
pub(crate) const MAX_HEAD: usize = 128;

/// A block per tile of `rows` rows of every batch entry (blocks loop past 65,535).
fn tiles(b: usize, rows: usize) -> LaunchConfig {
    let blocks = b.saturating_mul(rows.div_ceil(TILE));
    LaunchConfig {
        grid_dim: (blocks.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (TILE as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' limits: heads up to [`MAX_HEAD`] (so `b l ev` is at most 128 times the
/// queries' count, which exists), at least one key.
fn check(d: &AttnDims) -> Result<()> {
    if d.e > MAX_HEAD || d.ev > MAX_HEAD || d.s == 0 {
        return Err(Error::invalid(
            "scaled_dot_product_attention",
            format!(
                "the fused kernel takes head sizes up to {MAX_HEAD} and at least one key (E {}, \
                 Ev {}, S {})",
                d.e, d.ev, d.s
            ),
        ));
    }
    Ok(())
}

/// The kernels' size arguments: B, L, S, E, Ev, scale, causal.
fn sizes(d: &AttnDims) -> ([i64; 5], f32, i32) {
    let [b, l, s, e, ev] = [d.b, d.l, d.s, d.e, d.ev].map(|x| x as i64);
    ([b, l, s, e, ev], d.scale as f32, d.causal as i32)
}

pub(crate) fn attention(
    q: &CudaStorage,
    lq: &Layout,
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
    d: AttnDims,
) -> Result<((CudaStorage, Layout), CudaStorage)> {
    check(&d)?;
    let t = float_kname("scaled_dot_product_attention", q.dtype())?;
    if let Some(done) = dnn_sdpa::forward((q, lq), (k, lk), (v, lv), &d)? {
        return Ok(done);
    }
    if let Some(ft) = flash::applies(q, &d) {
        return flash::forward((q, lq), (k, lk), (v, lv), ft, &d);
    }
    let (qd, kd, vd) = (q.contiguous(lq)?, k.contiguous(lk)?, v.contiguous(lv)?);
    let out = CudaStorage::alloc_on(q.rt(), q.dtype(), d.b * d.l * d.ev)?;
    let lse = CudaStorage::alloc_on(q.rt(), DType::F32, d.b * d.l)?;
    let ([b, l, s, e, ev], scale, causal) = sizes(&d);
    let (qp, kp, vp, op, lp) = (qd.ptr(), kd.ptr(), vd.ptr(), out.ptr(), lse.ptr());
    launch!(
        q,
        KernelFile::Attention,
        kname!("attn_forward_", t),
        tiles(d.b, d.l),
        &qp,
        &kp,
        &vp,
        &op,
        &lp,
        &b,
        &l,
        &s,
        &e,
        &ev,
        &scale,
        &causal
    );
    Ok(((out, d.out_layout(lq)), lse))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(
    q: &CudaStorage,
    lq: &Layout,
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
    (o, lo): (&CudaStorage, &Layout),
    lse: &CudaStorage,
    (g, lg): (&CudaStorage, &Layout),
    d: AttnDims,
) -> Result<[(CudaStorage, Layout); 3]> {
    check(&d)?;
    let dt = q.dtype();
    let t = float_kname("scaled_dot_product_attention backward", dt)?;
    let views = [(q, lq), (k, lk), (v, lv), (o, lo), (g, lg)];
    if let Some(done) = dnn_sdpa::backward(views, lse, &d)? {
        return Ok(done);
    }
    if let Some(ft) = flash::applies(q, &d) {
        return flash::backward(views, lse, ft, &d);
    }
    let od = o.contiguous(lo)?;
    let (qd, kd, vd, gd) = (
        q.contiguous(lq)?,
        k.contiguous(lk)?,
        v.contiguous(lv)?,
        g.contiguous(lg)?,
    );
    let rt = q.rt();
    let dq = CudaStorage::alloc_on(rt, dt, d.b * d.l * d.e)?;
    let dk = CudaStorage::alloc_on(rt, dt, d.b * d.s * d.e)?;
    let dv = CudaStorage::alloc_on(rt, dt, d.b * d.s * d.ev)?;
    let dsum = CudaStorage::alloc_on(rt, DType::F32, d.b * d.l)?;
    let ([b, l, s, e, ev], scale, causal) = sizes(&d);
    let (qp, kp, vp, op, gp, lp) = (qd.ptr(), kd.ptr(), vd.ptr(), od.ptr(), gd.ptr(), lse.ptr());
    let (dqp, dkp, dvp, dsp) = (dq.ptr(), dk.ptr(), dv.ptr(), dsum.ptr());
    launch!(
        q,
        KernelFile::Attention,
        kname!("attn_backward_q_", t),
        tiles(d.b, d.l),
        &qp,
        &kp,
        &vp,
        &op,
        &gp,
        &lp,
        &dsp,
        &dqp,
        &b,
        &l,
        &s,
        &e,
        &ev,
        &scale,
        &causal
    );
    launch!(
        q,
        KernelFile::Attention,
        kname!("attn_backward_kv_", t),
        tiles(d.b, d.s),
        &qp,
        &kp,
        &vp,
        &gp,
        &lp,
        &dsp,
        &dkp,
        &dvp,
        &b,
        &l,
        &s,
        &e,
        &ev,
        &scale,
        &causal
    );
    let laid = |l: &Layout| Layout::contiguous(l.shape());
    Ok([(dq, laid(lq)), (dk, laid(lk)), (dv, laid(lv))])
}
