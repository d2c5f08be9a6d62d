//! Attention through cuDNN's fused (flash) attention engines: the operation graphs
//! cudnn-frontend's composite SDPA node lowers to for a cuDNN 9.0-9.20 runtime, built on the
//! graph API by hand (`dnn_sdpa_graph.rs` on `dnn_graph.rs`), with plans cached per problem.
//!
//! - Forward: `S = Q K^T`, times the by-value scale, the top-left causal mask (GEN_INDEX on
//!   rows and columns, CMP_GE, BINARY_SELECT with the fill value), the softmax as MAX and ADD
//!   reductions around SUB, EXP, LOG, ADD (Stats, the natural log-sum-exp of the scaled
//!   scores, written) and DIV into P of the I/O type, then `O = P V`.
//! - Backward: `rowsum(dO O)` into an f32 buffer of ours, the scores again, `P = exp(S -
//!   Stats)` (masked after the subtraction), `dV = P^T dO` (P^T a RESHAPE), `dP = dO V^T`,
//!   `dS = P (dP - rowsum) scale`, `dK = dS^T Q`, `dQ = dS K` straight into dQ: the graph of
//!   cudnn-frontend's deterministic backward (no f32 dQ accumulator, no atomics), as llm.c
//!   builds it.
//!
//! K^T and V^T are K's and V's descriptors with their last two dims and strides swapped (no
//! copy). Q, K, V, O and their gradients are `[B, H, T, e]` views with any strides whose last
//! is 1, so the heads of a packed q/k/v product are read where they lie; what this writes is
//! laid out as the tensor-core kernels write it (`flash::written`). Stats is the engine's
//! log-sum-exp `[B H, L]`, so a forward here and a backward by `flash.rs` (or the reverse)
//! agree.
//!
//! Where cuDNN is missing, too old, or declines the graph (no engine, or one that refuses the
//! operands when run), the caller's kernels run instead, and a declined problem is not asked
//! again.

use super::dnn_graph::{cached, plan_for, ran, Built, Plan, Plans};
use super::dnn_sdpa_graph::{backward_graph, bhte, forward_graph, uid, Graph};
use super::flash::{readable, written, FaRows};
use super::libs::{self, Lib};
use super::storage::CudaStorage;
use crate::backend::AttnDims;
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cudarc::cudnn::sys;
use std::ffi::c_void;
use std::sync::OnceLock;

use sys::cudnnDataType_t as Dt;

/// The runtime's version (`cudnnGetVersion`, 91002 for 9.10.2), once cuDNN is loaded.
fn version() -> usize {
    static V: OnceLock<usize> = OnceLock::new();
    // SAFETY: called only after `libs::load(Lib::Cudnn)` succeeded (`applies`); the call has
    // no arguments and reads no state.
    *V.get_or_init(|| unsafe { sys::cudnnGetVersion() })
}

/// Everything a plan depends on: the device, the I/O type, the direction, the mask, `[B, H,
/// L, S, e]` and the `[B, H, T]` strides of each tensor in memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SdpaKey {
    device: Device,
    dtype: DType,
    backward: bool,
    causal: bool,
    dims: [i64; 5],
    strides: Vec<[i64; 3]>,
    /// Built under `set_cudnn_deterministic` (no engine with the NONDETERMINISTIC note).
    deterministic: bool,
}

fn plans() -> &'static Plans<SdpaKey> {
    static PLANS: OnceLock<Plans<SdpaKey>> = OnceLock::new();
    PLANS.get_or_init(Default::default)
}

/// The I/O type's cuDNN code where cuDNN's fused attention takes this problem on this
/// device (before its graph is built): the switch is on, compute capability 8.0 or later,
/// f16 or bf16, one head size that is a multiple of 8 up to 128 for queries, keys and values
/// (the limit of every architecture's backward), at least two queries (a decoding step's
/// one query would build a plan per key count, and cudnn-frontend refuses a causal one up
/// to 9.9) and two keys (PyTorch's gate), a cuDNN from 9.0 that loads, and not 9.10.0 or
/// 9.10.1 (which cudnn-frontend refuses for known bugs).
fn applies(q: &CudaStorage, d: &AttnDims) -> Option<Dt> {
    if !crate::backend::softmax::cudnn_attention() || q.rt().arch() < 80 {
        return None;
    }
    let dt = match q.dtype() {
        DType::F16 => Dt::CUDNN_DATA_HALF,
        DType::BF16 => Dt::CUDNN_DATA_BFLOAT16,
        _ => return None,
    };
    let sizes = d.e == d.ev && d.e.is_multiple_of(8) && d.e <= 128 && d.l >= 2 && d.s >= 2;
    if !sizes || libs::load(Lib::Cudnn).is_err() {
        return None;
    }
    let v = version();
    (v >= 90000 && !(91000..91002).contains(&v)).then_some(dt)
}

/// The most attention problems given a plan in one process: past that, new ones run on the
/// engine's kernels (a workload whose shapes keep changing would build a plan, slowly, at
/// each call).
const MAX_PLANS: usize = 64;

/// Problem sizes as the graphs use them: B, H, L, S, e.
fn sizes(q: &FaRows, d: &AttnDims) -> Option<[usize; 5]> {
    let h = q.h.max(1) as usize;
    d.b.is_multiple_of(h).then_some([d.b / h, h, d.l, d.s, d.e])
}

/// The plan `graph` builds on handle `h`; a part cuDNN refuses (a descriptor, an attribute
/// this runtime does not know, an operation) declines the problem instead of failing it.
fn build(
    h: sys::cudnnHandle_t,
    key: &SdpaKey,
    graph: impl FnOnce() -> Result<Graph>,
) -> Result<Built> {
    let planned = plans().lock().map(|m| m.len()).unwrap_or(0);
    if planned >= MAX_PLANS {
        return Ok(Built::Declined(format!(
            "{MAX_PLANS} attention problems planned already"
        )));
    }
    match graph().and_then(|g| g.plan(h, key.deterministic)) {
        Err(Error::CudaLibrary { msg, .. }) => Ok(Built::Declined(msg)),
        Err(Error::CudaLibraryStatus { status, what, .. }) => {
            Ok(Built::Declined(format!("{what}: {status}")))
        }
        other => other,
    }
}

/// The mask's fill value: the lowest float before 9.10, -inf from there (cudnn-frontend's
/// choice for each runtime).
fn fill() -> f32 {
    if version() < 91000 {
        f32::MIN
    } else {
        f32::NEG_INFINITY
    }
}

/// One run of an attention plan: its problem, its label in the profiler and the work it
/// counts there.
struct Run {
    label: String,
    flops: u64,
    bytes: u64,
}

impl Run {
    /// Runs `plan` on handle `h` over the device (or, for by-value scalars, host) addresses
    /// `ptrs` of the tensors `uids`, with a workspace of the plan's size, as one profiled
    /// library call; `Ok(false)` where cuDNN refused to run it (then `key` is remembered as
    /// declined).
    ///
    /// # Safety
    /// As [`Plan::execute`]: each address holds the tensor its uid names, on `rt`'s device
    /// (a by-value scalar's, an f32 in host memory for the call), alive until the stream has
    /// run the plan; `h` is `rt`'s handle, on `rt`'s stream.
    unsafe fn go(
        self,
        key: &SdpaKey,
        rt: &std::sync::Arc<super::runtime::CudaRuntime>,
        h: sys::cudnnHandle_t,
        plan: &Plan,
        uids: &[i64],
        ptrs: &[*mut c_void],
    ) -> Result<bool> {
        let ws = CudaStorage::alloc_on(rt, DType::U8, plan.workspace.max(1))?;
        let prof = super::profile::library(rt, || self.label.clone(), self.flops, self.bytes);
        // SAFETY: the addresses are the caller's (this function's contract); the workspace
        // holds the plan's size and lives until the stream has run it (the caching allocator
        // reuses a block only in stream order).
        let run = unsafe { plan.execute(h, uids, ptrs, ws.ptr() as *mut c_void) };
        let done =
            ran(plans(), key, "attention", run).map_err(|status| Error::CudaLibraryStatus {
                lib: "cuDNN",
                op: "scaled_dot_product_attention",
                device: rt.device(),
                status,
                what: self.label.clone(),
            })?;
        if let (Some(p), true) = (prof, done) {
            p.end();
        }
        Ok(done)
    }
}

/// The key, label and work of a problem; `None` where the views' heads disagree.
fn problem(
    q: &CudaStorage,
    views: &[&FaRows],
    d: &AttnDims,
    backward: bool,
) -> Option<([usize; 5], SdpaKey, Run)> {
    let dims = sizes(views[0], d)?;
    let [b, h, l, s, e] = dims;
    // One head count; batch entries and heads up to 65,535 (PyTorch's gate); no dim of more
    // than one element read at stride 0 (a broadcast, which cuDNN is not documented to take).
    let broadcast = |r: &FaRows| (b > 1 && r.sb == 0) || (h > 1 && r.sh == 0);
    if views.iter().any(|r| r.h != views[0].h || broadcast(r)) || b > 65_535 || h > 65_535 {
        return None;
    }
    let key = SdpaKey {
        device: q.rt().device(),
        dtype: q.dtype(),
        backward,
        causal: d.causal,
        dims: dims.map(|x| x as i64),
        strides: views.iter().map(|r| [r.sb, r.sh, r.st]).collect(),
        deterministic: super::conv::cudnn_deterministic(),
    };
    let products: u64 = if backward { 5 } else { 2 };
    let full = 2 * (b * h * l * s * e) as u64 * products;
    let flops = if d.causal { full / 2 } else { full };
    let bytes = (views.len() * b * h * l.max(s) * e * q.dtype().size_in_bytes()) as u64;
    let dir = if backward { "bwd" } else { "fwd" };
    let mask = if d.causal { " causal" } else { "" };
    let label = format!(
        "cudnn sdpa {dir} b{b} h{h} l{l} s{s} e{e} {:?}{mask}",
        q.dtype()
    );
    let run = Run {
        label,
        flops,
        bytes,
    };
    Some((dims, key, run))
}

/// The output (laid out as [`written`] says) and the log-sum-exp `[B H, L]` (f32) by cuDNN's
/// fused attention; `None` where it does not take the problem (see the module).
pub(super) fn forward(
    (q, lq): (&CudaStorage, &Layout),
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
    d: &AttnDims,
) -> Result<Option<((CudaStorage, Layout), CudaStorage)>> {
    let Some(dt) = applies(q, d) else {
        return Ok(None);
    };
    let (_qh, qp, qr) = readable(q, lq, d.l, d.e)?;
    let (_kh, kp, kr) = readable(k, lk, d.s, d.e)?;
    let (_vh, vp, vr) = readable(v, lv, d.s, d.e)?;
    let (lo, or) = written(lq, d.e);
    let Some((dims, key, run)) = problem(q, &[&qr, &kr, &vr, &or], d, false) else {
        return Ok(None);
    };
    if matches!(cached(plans(), &key), Some(None)) {
        return Ok(None);
    }
    let rt = q.rt().clone();
    let out = CudaStorage::alloc_on(&rt, q.dtype(), d.b * d.l * d.e)?;
    let lse = CudaStorage::alloc_on(&rt, DType::F32, d.b * d.l)?;
    let (scale, fill) = (d.scale as f32, fill());
    let ran = rt.with_cudnn(|h| -> Result<bool> {
        let graph = || forward_graph(dt, dims, [&qr, &kr, &vr, &or], d.causal);
        let Some(plan) = plan_for(plans(), &key, "attention", || build(h, &key, graph))? else {
            return Ok(false);
        };
        let mut uids = vec![uid::Q, uid::K, uid::V, uid::O, uid::STATS, uid::SCALE];
        let mut ptrs = [qp, kp, vp, out.ptr(), lse.ptr()]
            .map(|p| p as *mut c_void)
            .to_vec();
        ptrs.push(&scale as *const f32 as *mut c_void);
        if d.causal {
            uids.push(uid::FILL);
            ptrs.push(&fill as *const f32 as *mut c_void);
        }
        // SAFETY: q, k and v are read where `readable` says (their `[B, H, T, e]` rows as the
        // graph's strides give them, alive in `_qh`.. until the end of this function, and
        // the stream orders their reuse); the output (B H L e elements) and the log-sum-exp
        // (B H L) were allocated above for the strides `written` gave; the scale and the fill
        // are f32 locals alive for the call, which reads them.
        unsafe { run.go(&key, &rt, h, &plan, &uids, &ptrs) }
    })??;
    Ok(ran.then_some(((out, lo), lse)))
}

/// Whether the query-side views `a` and `c` (rows of `d.l` queries, the head count `q`'s)
/// lie with the same strides, a dim of one element's aside.
fn same_rows(a: &FaRows, c: &FaRows, q: &FaRows, d: &AttnDims) -> bool {
    sizes(q, d).is_some_and(|[b, _, l, _, e]| bhte(a, b, l, e) == bhte(c, b, l, e))
}

/// The output gradient `g` copied into the layout of the output `lo` (whose rows the kernels
/// read as `or`), what a runtime before 9.5.1 needs (as PyTorch copies it); `None` where the
/// output is not laid out as this module writes it.
fn laid_like_output(
    (g, lg): (&CudaStorage, &Layout),
    lo: &Layout,
    or: &FaRows,
    d: &AttnDims,
) -> Result<Option<(CudaStorage, u64, FaRows)>> {
    let (laid, rows) = written(lo, d.e);
    if !same_rows(&rows, or, or, d) || lo.offset() != 0 || lg.shape() != laid.shape() {
        return Ok(None);
    }
    let mut copy = CudaStorage::alloc_on(g.rt(), g.dtype(), d.b * d.l * d.e)?;
    copy.copy_into(&laid, g, lg)?;
    let ptr = copy.ptr();
    Ok(Some((copy, ptr, rows)))
}

/// `[dq, dk, dv]` (each laid out as [`written`] says for its input's view) by cuDNN's fused
/// attention backward from q, k, v, the output, the log-sum-exp and the output gradient;
/// `None` where it does not take the problem. A runtime up to 9.15 is not asked for a key
/// count that is not a multiple of 128 (cudnn-frontend pads those with a mask the graph
/// does not carry); for one before 9.5.1 the output gradient is first laid out as the
/// output, which those need.
pub(super) fn backward(
    [(q, lq), (k, lk), (v, lv), (o, lo), (g, lg)]: [(&CudaStorage, &Layout); 5],
    lse: &CudaStorage,
    d: &AttnDims,
) -> Result<Option<[(CudaStorage, Layout); 3]>> {
    let Some(dt) = applies(q, d) else {
        return Ok(None);
    };
    // cudnn-frontend runs the deterministic backward on compute capability 10.x only from
    // 9.18, on an engine it picks itself: not asked there.
    if (version() <= 91500 && !d.s.is_multiple_of(128)) || (100..110).contains(&q.rt().arch()) {
        return Ok(None);
    }
    let (_qh, qp, qr) = readable(q, lq, d.l, d.e)?;
    let (_kh, kp, kr) = readable(k, lk, d.s, d.e)?;
    let (_vh, vp, vr) = readable(v, lv, d.s, d.e)?;
    let (_oh, op, or) = readable(o, lo, d.l, d.e)?;
    let (_gh, mut gp, mut gr) = readable(g, lg, d.l, d.e)?;
    let mut _g_laid = None;
    if version() < 90501 && !same_rows(&gr, &or, &qr, d) {
        let Some((laid, p, r)) = laid_like_output((g, lg), lo, &or, d)? else {
            return Ok(None);
        };
        (gp, gr, _g_laid) = (p, r, Some(laid));
    }
    let ((ldq, dqr), (ldk, dkr), (ldv, dvr)) =
        (written(lq, d.e), written(lk, d.e), written(lv, d.e));
    let views = [&qr, &kr, &vr, &or, &gr, &dqr, &dkr, &dvr];
    let Some((dims, key, run)) = problem(q, &views, d, true) else {
        return Ok(None);
    };
    if matches!(cached(plans(), &key), Some(None)) {
        return Ok(None);
    }
    let (rt, t) = (q.rt().clone(), q.dtype());
    let dq = CudaStorage::alloc_on(&rt, t, d.b * d.l * d.e)?;
    let dk = CudaStorage::alloc_on(&rt, t, d.b * d.s * d.e)?;
    let dv = CudaStorage::alloc_on(&rt, t, d.b * d.s * d.e)?;
    let row_sum = CudaStorage::alloc_on(&rt, DType::F32, d.b * d.l)?;
    let (scale, one, fill) = (d.scale as f32, 1.0f32, fill());
    let ran = rt.with_cudnn(|h| -> Result<bool> {
        let graph = || backward_graph(dt, dims, views, d.causal);
        let Some(plan) = plan_for(plans(), &key, "attention backward", || {
            build(h, &key, graph)
        })?
        else {
            return Ok(false);
        };
        let mut uids = vec![
            uid::Q,
            uid::K,
            uid::V,
            uid::O,
            uid::DO,
            uid::STATS,
            uid::ROW_SUM,
            uid::DQ,
            uid::DK,
            uid::DV,
            uid::SCALE,
            uid::ONE,
        ];
        let dev = [qp, kp, vp, op, gp, lse.ptr(), row_sum.ptr()];
        let dev = dev.into_iter().chain([dq.ptr(), dk.ptr(), dv.ptr()]);
        let mut ptrs: Vec<*mut c_void> = dev.map(|p| p as *mut c_void).collect();
        ptrs.push(&scale as *const f32 as *mut c_void);
        ptrs.push(&one as *const f32 as *mut c_void);
        if d.causal {
            uids.push(uid::FILL);
            ptrs.push(&fill as *const f32 as *mut c_void);
        }
        // SAFETY: q, k, v, o and the output gradient are read where `readable` says (alive
        // in `_qh`.. until the end of this function; the stream orders their reuse); the
        // log-sum-exp is the forward's `[B H, L]` f32; the row sums (B H L f32) and the
        // gradients (B H L e, B H S e twice) were allocated above for the strides `written`
        // gave; the scalars are f32 locals alive for the call, which reads them.
        unsafe { run.go(&key, &rt, h, &plan, &uids, &ptrs) }
    })??;
    Ok(ran.then_some([(dq, ldq), (dk, ldk), (dv, ldv)]))
}
