//! Launchers for `cuda/amp.cu`: the loss scaler's unscale with its overflow check (one pass
//! over a list of gradients per launch) and its scale update (one thread), on device
//! scalars: no host read.
//!
//! `tests/host_kernels/amp.rs` runs the kernels on the host against the CPU backend.

use super::kernels::KernelFile;
use super::storage::{kname, one_thread, rows_grid, CudaStorage};
use crate::backend::Span;
use crate::{DType, Error, Result};
use cudarc::driver::{DeviceRepr, PushKernelArg};
use std::ops::Range;

/// Checks that `s` is the one-element f32 storage the scaler keeps its values in.
fn scalar(op: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype() != DType::F32 || s.len() != 1 {
        return Err(Error::invalid(
            op,
            format!(
                "needs a one-element f32 tensor, got {} elements of {:?}",
                s.len(),
                s.dtype()
            ),
        ));
    }
    Ok(())
}

/// Gradients per launch (`UNSCALE_LIST` in `cuda/amp.cu`).
pub(super) const LIST: usize = 96;
/// Elements per block-sized chunk of a listed gradient (`UNSCALE_CHUNK`).
pub(super) const CHUNK: usize = 16384;

/// `cuda/amp.cu`'s `UnscaleList`, field for field: device addresses of each gradient's and
/// output's element 0, the length and the first of its chunks.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct UnscaleList {
    count: i64,
    chunks: i64,
    g: [u64; LIST],
    out: [u64; LIST],
    n: [i64; LIST],
    start: [i64; LIST],
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for UnscaleList {}

// The unscale kernels take the list and two pointers: within a launch's 4,096 bytes of
// parameters.
const _: () = assert!(std::mem::size_of::<UnscaleList>() + 16 <= 4096);

impl UnscaleList {
    /// The chunks of all its gradients: the blocks' work items.
    pub(super) fn chunks(&self) -> usize {
        self.chunks as usize
    }
}

/// `(gradient, output, length)` triples in lists of at most [`LIST`], in order.
pub(super) fn lists(entries: &[(u64, u64, usize)]) -> Vec<UnscaleList> {
    entries
        .chunks(LIST)
        .map(|part| {
            let mut l = UnscaleList {
                count: part.len() as i64,
                chunks: 0,
                g: [0; LIST],
                out: [0; LIST],
                n: [0; LIST],
                start: [0; LIST],
            };
            for (k, &(g, out, n)) in part.iter().enumerate() {
                (l.g[k], l.out[k], l.n[k], l.start[k]) = (g, out, n as i64, l.chunks);
                l.chunks += n.div_ceil(CHUNK) as i64;
            }
            l
        })
        .collect()
}

/// Every element of each gradient (its range, in storage order) times `inv_scale`, as new
/// storages of dtype `out`; sets `found_inf` to 1 when an element is inf or NaN. One launch
/// per dtype pair and list of [`LIST`]. Kernels exist for each float dtype into its own (the
/// in-place pass, [`unscale_grads_`], uses them too) and f16/bf16 into f32 (master weights);
/// every pair is checked before anything runs.
pub(crate) fn unscale_grads(
    grads: &[Span<'_, CudaStorage>],
    inv_scale: &CudaStorage,
    found_inf: &CudaStorage,
    out: DType,
) -> Result<Vec<CudaStorage>> {
    const OP: &str = "GradScaler::unscale_";
    scalar(OP, inv_scale)?;
    scalar(OP, found_inf)?;
    use DType::{BF16, F16, F32};
    const PAIRS: [(DType, DType); 5] = [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (F16, F32),
        (BF16, F32),
    ];
    let pair = |g: &CudaStorage| (g.dtype(), out);
    for g in grads {
        if !PAIRS.contains(&pair(g.storage)) {
            return Err(Error::DType {
                op: OP,
                dtype: g.storage.dtype(),
                expected: "f32, f16 or bf16 gradients into their own dtype, or f16/bf16 into f32",
            });
        }
    }
    let outs = grads
        .iter()
        .map(|g| CudaStorage::alloc_on(g.storage.rt(), out, g.len()))
        .collect::<Result<Vec<_>>>()?;
    let entries: Vec<_> = grads
        .iter()
        .zip(&outs)
        .map(|(g, o)| {
            let at = g.storage.ptr_at(g.range.start);
            ((at, o.ptr(), g.len()), pair(g.storage))
        })
        .collect();
    launch_unscale(&entries, inv_scale, found_inf)?;
    Ok(outs)
}

/// [`unscale_grads`] in place: each range `(k, range)` of `grads[k]` is its own output (the
/// kernels allow it), in its own dtype. The ranges do not overlap (the dispatch checked).
pub(crate) fn unscale_grads_(
    grads: &[&CudaStorage],
    ranges: &[(usize, Range<usize>)],
    inv_scale: &CudaStorage,
    found_inf: &CudaStorage,
) -> Result<()> {
    const OP: &str = "GradScaler::unscale_";
    scalar(OP, inv_scale)?;
    scalar(OP, found_inf)?;
    for g in grads {
        if !matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::DType {
                op: OP,
                dtype: g.dtype(),
                expected: "f32, f16 or bf16 gradients",
            });
        }
    }
    let entries: Vec<_> = ranges
        .iter()
        .map(|(k, r)| {
            let g = grads[*k];
            let at = g.ptr_at(r.start);
            ((at, at, r.len()), (g.dtype(), g.dtype()))
        })
        .collect();
    launch_unscale(&entries, inv_scale, found_inf)
}

/// One gradient of an unscale launch: `(gradient, output, length)` and `(from, to)` dtypes.
type UnscaleEntry = ((u64, u64, usize), (DType, DType));

/// The unscale launches of `entries` (their dtypes checked by the caller): one per dtype
/// pair and list of [`LIST`], in order.
fn launch_unscale(
    entries: &[UnscaleEntry],
    inv_scale: &CudaStorage,
    found_inf: &CudaStorage,
) -> Result<()> {
    const OP: &str = "GradScaler::unscale_";
    let (ip, fp) = (inv_scale.ptr(), found_inf.ptr());
    let mut pairs: Vec<(DType, DType)> = Vec::new();
    for (_, p) in entries {
        if !pairs.contains(p) {
            pairs.push(*p);
        }
    }
    for (from, to) in pairs {
        let these: Vec<(u64, u64, usize)> = entries
            .iter()
            .filter(|(_, p)| *p == (from, to))
            .map(|(e, _)| *e)
            .collect();
        let name = kname!("amp_unscale_", kname(OP, from)?, "_", kname(OP, to)?);
        for list in lists(&these) {
            // A block of 256 threads per chunk (the kernel strides past 65,535).
            let cfg = rows_grid(list.chunks());
            launch!(inv_scale, KernelFile::Amp, name, cfg, &list, &ip, &fp);
        }
    }
    Ok(())
}

/// The sum of the squares of every element of every gradient (its range), an f32 scalar: one
/// launch per dtype and list of [`LIST`] writes each chunk's sum, and one reduction joins
/// them in a fixed order (the same bits every run).
pub(crate) fn sum_squares(grads: &[Span<'_, CudaStorage>]) -> Result<CudaStorage> {
    const OP: &str = "clip_grad_norm";
    let Some(first) = grads.first().map(|g| g.storage) else {
        return Err(Error::invalid(OP, "no gradients to sum"));
    };
    use DType::{BF16, F16, F32};
    for g in grads {
        if !matches!(g.storage.dtype(), F32 | F16 | BF16) {
            return Err(Error::DType {
                op: OP,
                dtype: g.storage.dtype(),
                expected: "f32, f16 or bf16 gradients (f64 takes the per-tensor path)",
            });
        }
    }
    let chunks: usize = grads.iter().map(|g| g.len().div_ceil(CHUNK)).sum();
    if chunks == 0 {
        return CudaStorage::full(first.ordinal(), 0.0, 1, F32);
    }
    let partial = CudaStorage::alloc_on(first.rt(), F32, chunks)?;
    let mut done = 0usize;
    for dtype in [F32, F16, BF16] {
        let entries: Vec<(u64, u64, usize)> = grads
            .iter()
            .filter(|g| g.storage.dtype() == dtype)
            .map(|g| (g.storage.ptr_at(g.range.start), 0, g.len()))
            .collect();
        let name = kname!("amp_sum_squares_", kname(OP, dtype)?);
        for list in lists(&entries) {
            // This list's chunks write their sums after the lists before it.
            let pp = partial.ptr_at(done);
            let cfg = rows_grid(list.chunks());
            launch!(first, KernelFile::Amp, name, cfg, &list, &pp);
            done += list.chunks();
        }
    }
    let l = crate::layout::Layout::contiguous(&[chunks]);
    super::reduce::reduce(&partial, &l, &[0], crate::backend::ops::ReduceOp::Sum)
}

/// PyTorch's `_amp_update_scale_` on the device scalars `scale` and `tracker`.
pub(crate) fn update_scale(
    scale: &CudaStorage,
    tracker: &CudaStorage,
    found_inf: &CudaStorage,
    growth: f32,
    backoff: f32,
    interval: i32,
) -> Result<()> {
    const OP: &str = "GradScaler::update";
    for s in [scale, tracker, found_inf] {
        scalar(OP, s)?;
    }
    let (sp, tp, fp) = (scale.ptr(), tracker.ptr(), found_inf.ptr());
    let name = "amp_update_scale";
    launch!(
        scale,
        KernelFile::Amp,
        name,
        one_thread(),
        &sp,
        &tp,
        &fp,
        &growth,
        &backoff,
        &interval
    );
    Ok(())
}
