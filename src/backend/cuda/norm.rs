//! Launchers for `cuda/norm.cu`: batch normalisation's per-channel moments and gradient sums
//! (a partial per chunk of rows, then `bn_finalize`, which joins the chunks and computes the
//! coefficients, running statistics included) and its per-channel affine pass, over dense
//! row-major or channels-last operands (`ChannelSplit`).

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::same_dtype;
use super::storage::{float_kname, grid, CudaStorage, Dense};
use crate::backend::norm::{Addend, BnForward, BnGrad, BnGradOut, BnSource, FusedRelu};
use crate::backend::spec::ChannelSplit;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::{sys, DeviceRepr, LaunchConfig, PushKernelArg};

/// Threads per block of `bn_partial` (at most 256: its warp sums hold 8 warps).
const THREADS: u32 = 256;
/// Elements a `bn_partial` block reduces, about.
const CHUNK_ELEMS: usize = 4096;

/// Vectors each thread of `bn_partial`'s channels-last vector path reads per chunk, about.
const VECTORS_PER_THREAD: usize = 16;

/// How `bn_partial` divides its work: `chunk` outer rows per block, `tiles` channel tiles;
/// `tg` > 0 picks the channels-last path in 16-byte vectors, with tiles of `tg` groups of
/// adjacent channels (0: the element paths, tiles of one channel, or of 32 channels-last).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PartialPlan {
    pub(crate) chunk: usize,
    pub(crate) tiles: usize,
    pub(crate) tg: usize,
}

impl PartialPlan {
    /// The plan for `s` in `dtype`; `aligned`: every operand's address is a multiple of 16.
    pub(crate) fn new(s: ChannelSplit, dtype: DType, aligned: bool) -> PartialPlan {
        let v = 16 / dtype.size_in_bytes();
        if s.inner == 1 && s.channels.is_multiple_of(v) && aligned {
            // Groups per tile: a power of two up to 32, so a warp reads whole rows of a tile.
            let groups = s.channels / v;
            let tg = groups.next_power_of_two().min(32);
            let chunk = THREADS as usize / tg * VECTORS_PER_THREAD;
            return PartialPlan {
                chunk,
                tiles: groups.div_ceil(tg),
                tg,
            };
        }
        let (chunk, tiles) = match s.inner {
            1 => (256, s.channels.div_ceil(32)),
            inner => ((CHUNK_ELEMS / inner).max(1), s.channels),
        };
        PartialPlan {
            chunk,
            tiles,
            tg: 0,
        }
    }

    /// Chunks of rows: the partials per channel.
    pub(crate) fn chunks(&self, s: ChannelSplit) -> usize {
        s.outer.div_ceil(self.chunk)
    }

    /// Blocks of work (chunks times channel tiles).
    pub(crate) fn blocks(&self, s: ChannelSplit) -> usize {
        self.chunks(s) * self.tiles
    }
}

/// An f32 statistics vector's elements in order, and their address (a copy when the view is
/// not contiguous).
fn f32_vector<'a>(
    op: &'static str,
    v: &'a CudaStorage,
    l: &Layout,
) -> Result<(Dense<'a>, sys::CUdeviceptr)> {
    if v.dtype() != DType::F32 {
        return Err(Error::DType {
            op,
            dtype: v.dtype(),
            expected: "f32 statistics",
        });
    }
    if l.is_contiguous() {
        return Ok((Dense::Borrowed(v), v.ptr_at(l.offset())));
    }
    let copy = v.copy_strided(l)?;
    let p = copy.ptr();
    Ok((Dense::Owned(copy), p))
}

/// The backward operands of `bn_partial` (device addresses; 0 for none): dy, a fused ReLU's
/// output as its mask, where the masked dy goes, and the forward's statistics (f32 `[5, c]`,
/// whose second plane holds the means); with `recompute`, a fused ReLU's mask is recomputed
/// from x and those statistics.
struct Sums {
    dy: sys::CUdeviceptr,
    mask: sys::CUdeviceptr,
    masked: sys::CUdeviceptr,
    stats: sys::CUdeviceptr,
    recompute: bool,
}

/// Runs `bn_partial`: f32 partials `[chunks, c, 2]`, the moments of x (mode 0, `sums` None)
/// or the gradient sums (mode 1, mode 2 with the mask recomputed), and the plan they were
/// made with. With a mask, dy counts only where the mask is > 0; with `masked`, the masked dy
/// is written there too.
fn partial(
    op: &'static str,
    x: &CudaStorage,
    lx: &Layout,
    sums: Option<Sums>,
    s: ChannelSplit,
) -> Result<(CudaStorage, PartialPlan)> {
    let t = float_kname(op, x.dtype())?;
    let xp = x.ptr_at(lx.offset());
    let mode = match &sums {
        None => 0,
        Some(s) => 1 + i32::from(s.recompute),
    };
    let Sums {
        dy: dp,
        mask,
        masked,
        stats: sp,
        ..
    } = sums.unwrap_or(Sums {
        dy: 0,
        mask: 0,
        masked: 0,
        stats: 0,
        recompute: false,
    });
    let aligned = [xp, dp, mask, masked].iter().all(|p| p % 16 == 0);
    let plan = PartialPlan::new(s, x.dtype(), aligned);
    let (chunks, blocks) = (plan.chunks(s), plan.blocks(s));
    let part = CudaStorage::alloc_on(x.rt(), DType::F32, chunks * s.channels * 2)?;
    let i = |v: usize| v as i64;
    let (outer, c, inner, chunk) = (i(s.outer), i(s.channels), i(s.inner), i(plan.chunk));
    let tg = plan.tg as i32;
    let pp = part.ptr();
    let cfg = LaunchConfig {
        grid_dim: (blocks.min(1 << 20) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // Mode 0 reads x; modes 1 and 2 read dy and x (and the statistics); all write f32
    // partial sums.
    let n = s.outer * s.channels * s.inner;
    let planes = if mode != 0 {
        2 + u64::from(mask != 0) + u64::from(masked != 0)
    } else {
        1
    };
    let bytes = planes * elems(n, x.dtype()) + elems(chunks * s.channels * 2, DType::F32);
    let name = kname!("bn_partial_", t);
    launch!(
        bytes = bytes;
        x, KernelFile::Norm, name, cfg, &mode, &xp, &dp, &mask, &masked, &sp, &pp, &outer, &c,
        &inner, &chunk, &tg
    );
    Ok((part, plan))
}

/// `cuda/norm.cu`'s `BnArgs`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BnArgs {
    pub(super) mode: i32,
    pub(super) momentum: f64,
    pub(super) eps: f64,
    pub(super) count: f64,
    pub(super) weight: u64,
    pub(super) bias: u64,
    pub(super) running_mean: u64,
    pub(super) running_var: u64,
    pub(super) tracked: u64,
    pub(super) stats: u64,
    pub(super) out: u64,
    pub(super) dweight: u64,
    pub(super) dbias: u64,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for BnArgs {}

/// Threads per block of `bn_finalize` for `chunks` partials: a power of two, 32 to 256.
pub(crate) fn finalize_threads(chunks: usize) -> u32 {
    chunks.next_power_of_two().clamp(32, THREADS as usize) as u32
}

/// Runs `bn_finalize` over the partials and their plan (none in modes 1 and 4): one block per
/// channel.
fn finalize(
    x: &CudaStorage,
    part: Option<&(CudaStorage, PartialPlan)>,
    a: BnArgs,
    s: ChannelSplit,
) -> Result<()> {
    let (chunks, chunk) = part.map_or((0, 1), |(_, plan)| (plan.chunks(s), plan.chunk));
    let cfg = LaunchConfig {
        grid_dim: (s.channels.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (finalize_threads(chunks), 1, 1),
        shared_mem_bytes: 0,
    };
    let i = |v: usize| v as i64;
    let (outer, c, inner, chunk) = (i(s.outer), i(s.channels), i(s.inner), i(chunk));
    let pp = part.map_or(0, |(p, _)| p.ptr());
    let bytes = elems(2 * chunks * s.channels + 9 * s.channels, DType::F32);
    launch!(
        bytes = bytes;
        x, KernelFile::Norm, "bn_finalize", cfg, &pp, &a, &outer, &c, &inner, &chunk
    );
    Ok(())
}

/// The address of a whole f32 storage of `n` values (read or written by the kernel or
/// library call).
pub(super) fn whole_f32(op: &'static str, what: &str, v: &CudaStorage, n: usize) -> Result<u64> {
    if v.dtype() != DType::F32 || v.len() != n {
        return Err(Error::invalid(
            op,
            format!(
                "{what} must be {n} f32 values, got {} {:?}",
                v.len(),
                v.dtype()
            ),
        ));
    }
    Ok(v.ptr())
}

/// The address of a batch counter: one i64.
fn tracked_ptr(op: &'static str, t: &CudaStorage) -> Result<u64> {
    if t.dtype() != DType::I64 || t.len() != 1 {
        let (n, dt) = (t.len(), t.dtype());
        let msg = format!("num_batches_tracked must be one i64, got {n} {dt:?}");
        return Err(Error::invalid(op, msg));
    }
    Ok(t.ptr())
}

/// Adds one to a batch counter (one i64) in one small launch: `bn_finalize` over no
/// channels, for a batch norm whose statistics another call made.
pub(super) fn count_batch(x: &CudaStorage, tracked: &mut CudaStorage) -> Result<()> {
    let a = BnArgs {
        tracked: tracked_ptr("batch_norm", tracked)?,
        ..Default::default()
    };
    let none = ChannelSplit {
        outer: 0,
        channels: 0,
        inner: 1,
    };
    finalize(x, None, a, none)
}

/// See [`crate::backend::NormOps::batch_norm_stats`]: `bn_partial` and `bn_finalize` in
/// training (running statistics and counter updated by the second), `bn_finalize` alone in
/// eval.
pub(crate) fn batch_norm_stats(
    x: &CudaStorage,
    lx: &Layout,
    p: BnForward<'_, CudaStorage>,
) -> Result<CudaStorage> {
    let op = "batch_norm";
    let s = ChannelSplit::of(op, lx)?;
    let c = s.channels;
    if s.outer * s.inner == 0 {
        return Err(Error::Empty {
            op,
            shape: lx.shape().to_vec(),
        });
    }
    let (_w, weight) = optional_f32(op, p.weight)?;
    let (_b, bias) = optional_f32(op, p.bias)?;
    let out = CudaStorage::alloc_on(x.rt(), DType::F32, 5 * c)?;
    let mut a = BnArgs {
        eps: p.eps,
        count: (s.outer * s.inner) as f64,
        weight,
        bias,
        out: out.ptr(),
        ..Default::default()
    };
    match p.source {
        BnSource::Batch {
            running,
            tracked,
            momentum,
            sums,
        } => {
            a.momentum = momentum;
            if let Some((m, v)) = running {
                a.running_mean = whole_f32(op, "running_mean", m, c)?;
                a.running_var = whole_f32(op, "running_var", v, c)?;
            }
            if let Some(t) = tracked {
                a.tracked = tracked_ptr(op, t)?;
            }
            match sums {
                // The moments from the sums another call made: bn_finalize alone.
                Some(sums) => {
                    a.mode = 5;
                    a.stats = whole_f32(op, "channel sums", sums, 2 * c)?;
                    finalize(x, None, a, s)?;
                }
                None => {
                    let part = partial(op, x, lx, None, s)?;
                    finalize(x, Some(&part), a, s)?;
                }
            }
        }
        BnSource::Running(m, v) => {
            a.mode = 1;
            a.running_mean = whole_f32(op, "running_mean", m, c)?;
            a.running_var = whole_f32(op, "running_var", v, c)?;
            finalize(x, None, a, s)?;
        }
    }
    Ok(out)
}

/// An optional f32 `[c]` operand's address (a contiguous copy of a strided view), or null.
fn optional_f32<'a>(
    op: &'static str,
    v: Option<(&'a CudaStorage, &Layout)>,
) -> Result<(Option<Dense<'a>>, u64)> {
    match v {
        None => Ok((None, 0)),
        Some((v, l)) => {
            let (d, p) = f32_vector(op, v, l)?;
            Ok((Some(d), p))
        }
    }
}

/// See [`crate::backend::NormOps::batch_norm_grad`]: `bn_partial` (the gradient sums, unless
/// only the eval input gradient is wanted) and `bn_finalize`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_grad(
    dy: &CudaStorage,
    ld: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    stats: &CudaStorage,
    ls: &Layout,
    mode: BnGrad,
    relu: FusedRelu<'_, CudaStorage>,
) -> Result<BnGradOut<CudaStorage>> {
    let op = "batch_norm backward";
    same_dtype(op, dy, x)?;
    let s = ChannelSplit::of_pair(op, ld, lx)?;
    let mask = relu_mask(op, dy, ld, relu)?;
    let c = s.channels;
    if ls.numel() != 5 * c || s.outer * s.inner == 0 {
        return Err(bad_stats(op, ls, lx));
    }
    let (_stats, sp) = f32_vector(op, stats, ls)?;
    let coef = CudaStorage::alloc_on(x.rt(), DType::F32, 4 * c)?;
    let params = match mode {
        BnGrad::EvalInputOnly => None,
        _ => Some((
            CudaStorage::alloc_on(x.rt(), DType::F32, c)?,
            CudaStorage::alloc_on(x.rt(), DType::F32, c)?,
        )),
    };
    let a = BnArgs {
        mode: match mode {
            BnGrad::Train => 2,
            BnGrad::EvalWithParams => 3,
            BnGrad::EvalInputOnly => 4,
        },
        count: (s.outer * s.inner) as f64,
        stats: sp,
        out: coef.ptr(),
        dweight: params.as_ref().map_or(0, |p| p.0.ptr()),
        dbias: params.as_ref().map_or(0, |p| p.1.ptr()),
        ..Default::default()
    };
    // The kernel indexes dy from its own first element as it indexes x.
    // The masked gradient, written by the sums' pass in dy's dense order from offset 0.
    let masked = match (relu, mode) {
        (FusedRelu::GradKept(..), BnGrad::Train | BnGrad::EvalWithParams) => {
            Some(CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?)
        }
        _ => None,
    };
    let part = match mode {
        BnGrad::EvalInputOnly => None,
        _ => Some(partial(
            op,
            x,
            lx,
            Some(Sums {
                dy: dy.ptr_at(ld.offset()),
                mask,
                masked: masked.as_ref().map_or(0, |m| m.ptr()),
                stats: sp,
                // The op passes its own statistics for the recomputed mask.
                recompute: matches!(relu, FusedRelu::Recompute(..)),
            }),
            s,
        )?),
    };
    finalize(x, part.as_ref(), a, s)?;
    Ok(BnGradOut {
        coef,
        params,
        masked,
    })
}

/// `alpha[c] (x - center[c]) + gamma[c]` plus the addend (`beta[c] dy`, or a residual) in
/// `x`'s dtype and layout, with `coef = [alpha | center | gamma | beta]`.
pub(crate) fn channel_affine(
    x: &CudaStorage,
    lx: &Layout,
    add: Addend<'_, CudaStorage>,
    coef: &CudaStorage,
    lc: &Layout,
    relu: FusedRelu<'_, CudaStorage>,
) -> Result<CudaStorage> {
    let op = "batch_norm";
    let t = float_kname(op, x.dtype())?;
    let s = match add.operand() {
        Some((d, ld)) => {
            same_dtype(op, x, d)?;
            ChannelSplit::of_pair(op, lx, ld)?
        }
        None => ChannelSplit::of(op, lx)?,
    };
    let (_coef, kp) = f32_vector(op, coef, lc)?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let xp = x.ptr_at(lx.offset());
    let dp = add.operand().map_or(0, |(d, ld)| d.ptr_at(ld.offset()));
    let mask = match add {
        Addend::Scaled(d, ld) => relu_mask(op, d, ld, relu)?,
        _ => 0,
    };
    // A fused ReLU's mask recomputed from x: the forward's statistics (f32 `[5, c]`).
    let fc = match (add, relu.stats()) {
        (Addend::Scaled(..), Some((st, ls))) => {
            if ls.numel() != 5 * s.channels {
                return Err(bad_stats(op, ls, lx));
            }
            Some(f32_vector(op, st, ls)?)
        }
        _ => None,
    };
    let fp = fc.as_ref().map_or(0, |f| f.1);
    // Bit 0: clamp the output (a fused ReLU forward); bit 1: the addend is a residual.
    let flags = i32::from(matches!(relu, FusedRelu::Output))
        | (i32::from(matches!(add, Addend::Residual(..))) << 1);
    let outp = out.ptr();
    let (n64, c, inner) = (n as i64, s.channels as i64, s.inner as i64);
    // A fused ReLU's backward that recomputes its mask from x has a kernel of its own (its
    // whole-row path holds more coefficients; the other keeps fewer registers).
    let name = match fp != 0 && mask == 0 {
        true => kname!("bn_affine_fc_", t),
        false => kname!("bn_affine_", t),
    };
    // x in, the addend in when given, the output out; the coefficients are four f32 per
    // channel, and a recomputed mask reads the forward's five more.
    let planes = if dp != 0 { 3 } else { 2 } + u64::from(mask != 0);
    let per_channel = if fp != 0 { 9 } else { 4 };
    let bytes = planes * elems(n, x.dtype()) + elems(per_channel * s.channels, DType::F32);
    // A thread per 16-byte vector where the kernel can take them (the grid strides anyway).
    let v = 16 / x.dtype().size_in_bytes();
    let vectors = match s.inner {
        1 => s.channels % v == 0,
        inner => inner % v == 0,
    };
    let threads = if vectors { n.div_ceil(v) } else { n };
    let mut cfg = grid(threads);
    if vectors && s.inner == 1 {
        cfg.grid_dim.0 = whole_rows(cfg.grid_dim.0, s.channels / v);
    }
    launch!(
        bytes = bytes;
        x,
        KernelFile::Norm,
        name,
        cfg,
        &xp,
        &dp,
        &mask,
        &fp,
        &kp,
        &outp,
        &n64,
        &c,
        &inner,
        &flags
    );
    Ok(out)
}

/// The error for statistics (layout `ls`) that are not `[5, c]` for the input `lx`.
fn bad_stats(op: &'static str, ls: &Layout, lx: &Layout) -> Error {
    Error::invalid(
        op,
        format!(
            "statistics of {} values for input {:?}",
            ls.numel(),
            lx.shape()
        ),
    )
}

/// The address of a fused ReLU's forward output, read as a mask beside `dy` (0 without one):
/// it must be dense in `dy`'s format and dtype.
fn relu_mask(
    op: &'static str,
    dy: &CudaStorage,
    ld: &Layout,
    relu: FusedRelu<'_, CudaStorage>,
) -> Result<sys::CUdeviceptr> {
    let Some((y, ly)) = relu.mask() else {
        return Ok(0);
    };
    same_dtype(op, dy, y)?;
    ChannelSplit::of_pair(op, ld, ly)?;
    Ok(y.ptr_at(ly.offset()))
}

/// `blocks` (of 256 threads) made a multiple of what makes the grid's stride a whole number
/// of channels-last rows of `run` vectors: the affine kernel then loads each thread's
/// coefficients once (`bn_affine_rows`). Rounded up (the extra threads find nothing to do)
/// while the grid stays within 65,535 blocks, else down; kept where neither is possible.
pub(crate) fn whole_rows(blocks: u32, run: usize) -> u32 {
    let stride = u64::from(blocks) * 256;
    if run == 0 || stride.is_multiple_of(run as u64) {
        return blocks;
    }
    // Blocks per whole-row stride: run / gcd(run, 256).
    let step = (run / gcd(run, 256)) as u64;
    let up = u64::from(blocks).div_ceil(step) * step;
    let down = u64::from(blocks) / step * step;
    match (up <= 65_535, down) {
        (true, _) => up as u32,
        (false, 0) => blocks,
        (false, d) => d as u32,
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::whole_rows;

    #[test]
    fn the_affine_grid_strides_whole_rows() {
        // 65,535 blocks of 256 threads and rows of 512 vectors (f32, 2048 channels): rounding
        // up passes the grid's limit, one block fewer makes the stride a multiple of 512.
        assert_eq!(whole_rows(65_535, 512), 65_534);
        assert_eq!(u64::from(whole_rows(65_535, 512)) * 256 % 512, 0);
        // Rows that divide 256 threads: any grid.
        assert_eq!(whole_rows(6_001, 128), 6_001);
        // Rows of 3 * 256 vectors: a multiple of three blocks, rounded up.
        assert_eq!(whole_rows(100, 768), 102);
        assert_eq!(whole_rows(2, 768), 3);
    }
}
