//! Launchers of `cuda/flash.cu`: attention on tensor cores (`mma.sync`, FlashAttention-2's
//! arrangement) for f16 and bf16 with one head size of 64 or 128. Forward is one launch;
//! backward three: each query's `do . o`, then dk and dv per block of keys, then dq per
//! block of queries (no atomics, so a backward repeats bit for bit). The contract is
//! `cuda/attention.cu`'s, which takes every other case.

use super::kernels::KernelFile;
use super::storage::CudaStorage;
use crate::backend::AttnDims;
use crate::{DType, Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Queries a block of the forward and dq kernels takes (`16 * FA_WARPS`).
const QUERY_ROWS: usize = 64;

/// The kernels' dtype name, when they take these sizes: f16 or bf16, one head size of 64 or
/// 128 for queries, keys and values, at least one key.
pub(super) fn applies(dt: DType, d: &AttnDims) -> Option<&'static str> {
    let t = match dt {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return None,
    };
    (d.e == d.ev && matches!(d.e, 64 | 128) && d.s > 0 && d.l > 0).then_some(t)
}

/// Whether every pointer allows the kernels' 16-byte loads.
pub(super) fn aligned(ptrs: &[u64]) -> bool {
    ptrs.iter().all(|p| p % 16 == 0)
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

fn sizes(d: &AttnDims) -> ([i64; 3], f32, i32) {
    let [b, l, s] = [d.b, d.l, d.s].map(|x| x as i64);
    ([b, l, s], d.scale as f32, d.causal as i32)
}

/// Output `[b, l, e]` and log-sum-exp `[b, l]` (f32) from contiguous q, k and v at `ptrs`.
pub(super) fn forward(
    q: &CudaStorage,
    t: &'static str,
    [qp, kp, vp]: [u64; 3],
    d: &AttnDims,
) -> Result<(CudaStorage, CudaStorage)> {
    let out = CudaStorage::alloc_on(q.rt(), q.dtype(), d.b * d.l * d.e)?;
    let lse = CudaStorage::alloc_on(q.rt(), DType::F32, d.b * d.l)?;
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
        &causal
    );
    Ok((out, lse))
}

/// `(dq, dk, dv)` from contiguous q, k, v, output, log-sum-exp and output gradient at `ptrs`.
pub(super) fn backward(
    q: &CudaStorage,
    t: &'static str,
    [qp, kp, vp, op, lp, gp]: [u64; 6],
    d: &AttnDims,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let (rt, dt) = (q.rt(), q.dtype());
    let dq = CudaStorage::alloc_on(rt, dt, d.b * d.l * d.e)?;
    let dk = CudaStorage::alloc_on(rt, dt, d.b * d.s * d.e)?;
    let dv = CudaStorage::alloc_on(rt, dt, d.b * d.s * d.e)?;
    let dsum = CudaStorage::alloc_on(rt, DType::F32, d.b * d.l)?;
    let ([b, l, s], scale, causal) = sizes(d);
    let (dqp, dkp, dvp, dsp) = (dq.ptr(), dk.ptr(), dv.ptr(), dsum.ptr());
    let h = head(d.e);
    let rows = (d.b * d.l) as i64;
    let prep = grid(1, d.b * d.l, 256, 256);
    launch!(
        q,
        KernelFile::Flash,
        kname!("flash_prep_", t, "_", h),
        prep,
        &op,
        &gp,
        &dsp,
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
        &causal
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
        &causal
    );
    Ok((dq, dk, dv))
}

/// The head size as the kernels' names spell it.
fn head(e: usize) -> &'static str {
    if e == 64 {
        "64"
    } else {
        "128"
    }
}
