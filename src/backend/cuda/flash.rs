//! Launchers of `cuda/flash.cu`: attention on tensor cores (`mma.sync`, FlashAttention-2's
//! arrangement) for f16 and bf16 with one head size of 64 or 128. Forward is one launch;
//! backward three: each query's `do . o`, then dk and dv per block of keys, then dq per
//! block of queries (no atomics, so a backward repeats bit for bit). The contract is
//! `cuda/attention.cu`'s, which takes every other case, except for layouts: the kernels read
//! `[B, H, T, e]` views with any strides whose last is 1 where they lie (the heads of a packed
//! q/k/v product, transposed), and lay out what they write for such views as `[B, T, H, e]`,
//! so that merging the heads back is a view (as PyTorch's flash attention does).

use super::kernels::KernelFile;
use super::storage::{CudaStorage, Dense};
use crate::backend::AttnDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

/// Queries a block of the forward and dq kernels takes (`16 * FA_WARPS`).
const QUERY_ROWS: usize = 64;

/// `cuda/flash.cu`'s `FaRows`: pair `bh = b h + i` of a view's (batch, head) pairs starts at
/// element `b sb + i sh` and its rows are `st` apart.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct FaRows {
    pub(super) h: i64,
    pub(super) sb: i64,
    pub(super) sh: i64,
    pub(super) st: i64,
}

/// `cuda/flash.cu`'s `FaAll`: the rows of every tensor a kernel reads or writes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FaAll {
    pub(super) q: FaRows,
    pub(super) k: FaRows,
    pub(super) v: FaRows,
    pub(super) o: FaRows,
    pub(super) dout: FaRows,
    pub(super) dq: FaRows,
    pub(super) dk: FaRows,
    pub(super) dv: FaRows,
}

// SAFETY: plain `i64`s in the order and types of cuda/flash.cu's `FaAll`, no pointers.
unsafe impl DeviceRepr for FaAll {}

/// The kernels' dtype name, when they take these sizes on this device: compute capability
/// 8.0 or later (`mma.sync` m16n8k16 and `cp.async`), f16 or bf16, one head size of 64 or
/// 128 for queries, keys and values, at least one query and one key.
pub(super) fn applies(q: &CudaStorage, d: &AttnDims) -> Option<&'static str> {
    if q.rt().arch() < 80 {
        return None;
    }
    let t = match q.dtype() {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return None,
    };
    (d.e == d.ev && matches!(d.e, 64 | 128) && d.s > 0 && d.l > 0).then_some(t)
}

/// How the kernels read view `l` (`[.., rows, e]`) where it lies: rank 2 to 4 with the last
/// stride 1 (rank 4 as `[B, H, rows, e]` with any strides), the offset and every stride that
/// moves a multiple of 8 elements, so that each row starts 16-byte aligned (device blocks
/// are). `None` otherwise: the view is copied to contiguous rows first.
fn rows_in_place(l: &Layout) -> Option<FaRows> {
    let (shape, strides) = (l.shape(), l.strides());
    let r = shape.len();
    if !(2..=4).contains(&r) || strides[r - 1] != 1 {
        return None;
    }
    // A dim of one element moves nothing: its stride counts as 0.
    let st = |i: usize| if shape[i] == 1 { 0 } else { strides[i] as i64 };
    let rows = match r {
        2 => FaRows {
            h: 1,
            sb: 0,
            sh: 0,
            st: st(0),
        },
        3 => FaRows {
            h: 1,
            sb: st(0),
            sh: 0,
            st: st(1),
        },
        _ => FaRows {
            h: shape[1].max(1) as i64,
            sb: st(0),
            sh: st(1),
            st: st(2),
        },
    };
    let aligned =
        l.offset().is_multiple_of(8) && [rows.sb, rows.sh, rows.st].iter().all(|s| s % 8 == 0);
    aligned.then_some(rows)
}

/// Contiguous rows of `rows` rows of `e` per pair.
pub(super) fn contiguous_rows(rows: usize, e: usize) -> FaRows {
    FaRows {
        h: 1,
        sb: (rows * e) as i64,
        sh: 0,
        st: e as i64,
    }
}

/// View `l` of `s` as the kernels read it: its device address and rows, copied first where
/// they cannot read it in place (`rows` rows of `e` per pair).
pub(super) fn readable<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    rows: usize,
    e: usize,
) -> Result<(Dense<'a>, u64, FaRows)> {
    match rows_in_place(l) {
        Some(r) => Ok((Dense::Borrowed(s), s.ptr_at(l.offset()), r)),
        None => {
            let c = s.contiguous(l)?;
            let ptr = c.ptr();
            Ok((c, ptr, contiguous_rows(rows, e)))
        }
    }
}

/// What the kernels write for a view shaped as `l` (`[.., rows, e]`): a `[B, H, rows, e]`
/// shape laid out as `[B, rows, H, e]` (the heads of a row side by side), other ranks
/// contiguous; with the rows the kernels write it through.
pub(super) fn written(l: &Layout, e: usize) -> (Layout, FaRows) {
    let mut shape = l.shape().to_vec();
    let r = shape.len();
    shape[r - 1] = e;
    if r == 4 {
        let (h, rows) = (shape[1], shape[2]);
        let strides = vec![rows * h * e, e, h * e, 1];
        let fr = FaRows {
            h: h.max(1) as i64,
            sb: (rows * h * e) as i64,
            sh: e as i64,
            st: (h * e) as i64,
        };
        (Layout::new(shape, strides, 0), fr)
    } else {
        (Layout::contiguous(&shape), contiguous_rows(shape[r - 2], e))
    }
}

/// A block of `threads` per tile of `rows` rows of every batch entry (blocks loop past
/// 65,535).
fn grid(b: usize, rows: usize, tile: usize, threads: u32) -> LaunchConfig {
    let blocks = b.saturating_mul(rows.div_ceil(tile));
    LaunchConfig {
        grid_dim: (blocks.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Keys a block of the dk/dv kernel takes and its threads: 4 warps of 16 keys for head 64,
/// 2 for head 128 (the `FLASH` instantiations' `W`).
fn key_block(e: usize) -> (usize, u32) {
    if e == 64 {
        (64, 128)
    } else {
        (32, 64)
    }
}

/// The head size as the kernels' names spell it.
fn head(e: usize) -> &'static str {
    if e == 64 {
        "64"
    } else {
        "128"
    }
}

fn sizes(d: &AttnDims) -> ([i64; 3], f32, i32) {
    let [b, l, s] = [d.b, d.l, d.s].map(|x| x as i64);
    ([b, l, s], d.scale as f32, d.causal as i32)
}

/// The output (with its layout: see [`written`]) and the log-sum-exp `[b, l]` (f32).
pub(super) fn forward(
    (q, lq): (&CudaStorage, &Layout),
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
    t: &'static str,
    d: &AttnDims,
) -> Result<((CudaStorage, Layout), CudaStorage)> {
    let (_qh, qp, qr) = readable(q, lq, d.l, d.e)?;
    let (_kh, kp, kr) = readable(k, lk, d.s, d.e)?;
    let (_vh, vp, vr) = readable(v, lv, d.s, d.e)?;
    let (lo, or) = written(lq, d.e);
    let out = CudaStorage::alloc_on(q.rt(), q.dtype(), d.b * d.l * d.e)?;
    let lse = CudaStorage::alloc_on(q.rt(), DType::F32, d.b * d.l)?;
    let rows = FaAll {
        q: qr,
        k: kr,
        v: vr,
        o: or,
        ..Default::default()
    };
    let ([b, l, s], scale, causal) = sizes(d);
    let (op, lp) = (out.ptr(), lse.ptr());
    let name = kname!("flash_forward_", t, "_", head(d.e));
    let cfg = grid(d.b, d.l, QUERY_ROWS, 128);
    launch!(
        q,
        KernelFile::Flash,
        name,
        cfg,
        &qp,
        &kp,
        &vp,
        &op,
        &lp,
        &b,
        &l,
        &s,
        &scale,
        &causal,
        &rows
    );
    Ok(((out, lo), lse))
}

/// `[dq, dk, dv]` (each laid out as [`written`] says for its input's view) from q, k, v,
/// the output, the log-sum-exp and the output gradient.
pub(super) fn backward(
    [(q, lq), (k, lk), (v, lv), (o, lo), (g, lg)]: [(&CudaStorage, &Layout); 5],
    lse: &CudaStorage,
    t: &'static str,
    d: &AttnDims,
) -> Result<[(CudaStorage, Layout); 3]> {
    let (rt, dt) = (q.rt(), q.dtype());
    let (_qh, qp, qr) = readable(q, lq, d.l, d.e)?;
    let (_kh, kp, kr) = readable(k, lk, d.s, d.e)?;
    let (_vh, vp, vr) = readable(v, lv, d.s, d.e)?;
    let (_oh, op, or) = readable(o, lo, d.l, d.e)?;
    let (_gh, gp, gr) = readable(g, lg, d.l, d.e)?;
    let ((ldq, dqr), (ldk, dkr), (ldv, dvr)) =
        (written(lq, d.e), written(lk, d.e), written(lv, d.e));
    let rows = FaAll {
        q: qr,
        k: kr,
        v: vr,
        o: or,
        dout: gr,
        dq: dqr,
        dk: dkr,
        dv: dvr,
    };
    let dq = CudaStorage::alloc_on(rt, dt, d.b * d.l * d.e)?;
    let dk = CudaStorage::alloc_on(rt, dt, d.b * d.s * d.e)?;
    let dv = CudaStorage::alloc_on(rt, dt, d.b * d.s * d.e)?;
    let dsum = CudaStorage::alloc_on(rt, DType::F32, d.b * d.l)?;
    let ([b, l, s], scale, causal) = sizes(d);
    let (dqp, dkp, dvp, dsp, lp) = (dq.ptr(), dk.ptr(), dv.ptr(), dsum.ptr(), lse.ptr());
    let h = head(d.e);
    let pairs = (d.b * d.l) as i64;
    let prep = grid(1, d.b * d.l, 256, 256);
    let name = kname!("flash_prep_", t, "_", h);
    launch!(
        q,
        KernelFile::Flash,
        name,
        prep,
        &op,
        &gp,
        &dsp,
        &pairs,
        &l,
        &rows
    );
    let (keys, threads) = key_block(d.e);
    launch!(
        q,
        KernelFile::Flash,
        kname!("flash_backward_kv_", t, "_", h),
        grid(d.b, d.s, keys, threads),
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
        &scale,
        &causal,
        &rows
    );
    launch!(
        q,
        KernelFile::Flash,
        kname!("flash_backward_q_", t, "_", h),
        grid(d.b, d.l, QUERY_ROWS, 128),
        &qp,
        &kp,
        &vp,
        &gp,
        &lp,
        &dsp,
        &dqp,
        &b,
        &l,
        &s,
        &scale,
        &causal,
        &rows
    );
    Ok([(dq, ldq), (dk, ldk), (dv, ldv)])
}
