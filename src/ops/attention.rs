//! Scaled dot-product attention (PyTorch's `F.scaled_dot_product_attention`): a composition
//! of the batched product, masking and softmax with their backward, or, without a mask or
//! dropout and with heads of up to 128, one fused op (the backends' `attention`: the `[L, S]`
//! scores are never stored; backward recomputes them from each query's log-sum-exp), as
//! [`set_attention_kernel`] chooses. Under autocast both run their products in the low dtype.

use super::{dispatch, Op};
pub use crate::backend::softmax::{cudnn_attention, set_cudnn_attention};
use crate::backend::{AttnDims, RowSoftmax};
use crate::{DType, Error, Result, Tensor};
use std::sync::atomic::{AtomicU8, Ordering};

/// The largest head size (E and Ev) of the fused op (the CUDA kernel's `ATT_MAX_E`).
const FUSED_MAX_HEAD: usize = 128;

/// With [`AttentionKernel::Auto`], the fused op from this many scores (`[.., L, S]`
/// elements) up: 2^26, whose attention weights the composition keeps for backward (256 MiB
/// in f32, 128 MiB in f16/bf16 under autocast).
const FUSED_FROM: usize = 1 << 26;

/// Which implementation [`Tensor::scaled_dot_product_attention`] uses where both apply (no
/// mask, no dropout, heads up to 128, one float dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// The fused op on CUDA in f16/bf16 at head size 64 or 128 (through cuDNN's fused
    /// attention where it takes the problem, [`set_cudnn_attention`], else the tensor-core
    /// kernels); otherwise the composition while its `[.., L, S]` scores stay below 2^26 elements (its
    /// products are cuBLAS's on a GPU), the fused op from there on (it never stores the
    /// scores).
    #[default]
    Auto,
    /// Always the fused op.
    Fused,
    /// Always the composition.
    Composed,
}

static KERNEL: AtomicU8 = AtomicU8::new(0);

/// Chooses the attention implementation for the whole process (PyTorch's
/// `torch.backends.cuda.enable_flash_attention` and friends). On CUDA in f16 and bf16 the
/// fused op runs through cuDNN's fused attention where cuDNN takes the problem (head sizes a
/// multiple of 8 up to 128; [`set_cudnn_attention`]), else, with head size 64 or 128, on
/// FlashAttention-2-style kernels on tensor cores; at head size 64 or 128
/// [`AttentionKernel::Auto`] takes the fused op at every size. Elsewhere it is a plain tiled
/// kernel (one thread a row), which `Auto` takes only once the memory of the composition's
/// scores is the larger cost.
///
/// ```
/// use mantissa::{attention_kernel, set_attention_kernel, AttentionKernel};
/// set_attention_kernel(AttentionKernel::Fused);
/// assert_eq!(attention_kernel(), AttentionKernel::Fused);
/// set_attention_kernel(AttentionKernel::Auto);
/// ```
pub fn set_attention_kernel(k: AttentionKernel) {
    KERNEL.store(k as u8, Ordering::Relaxed);
}

/// The implementation [`set_attention_kernel`] chose.
pub fn attention_kernel() -> AttentionKernel {
    match KERNEL.load(Ordering::Relaxed) {
        1 => AttentionKernel::Fused,
        2 => AttentionKernel::Composed,
        _ => AttentionKernel::Auto,
    }
}

/// Options of [`Tensor::scaled_dot_product_attention`] (PyTorch's defaults: no mask, no
/// dropout, not causal, scale `1/sqrt(E)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionOptions<'a> {
    /// Added to the scores when float; when U8, 1 marks the pairs that take part (PyTorch's
    /// boolean `attn_mask`: true attends). Broadcast to `[.., L, S]`.
    pub attn_mask: Option<&'a Tensor>,
    /// Dropout on the attention weights (active whenever it is above 0, as in PyTorch's
    /// functional form).
    pub dropout_p: f64,
    /// Query `i` attends to keys `0..=i` only (the top-left causal mask).
    pub is_causal: bool,
    /// The scores' factor; `None` is `1/sqrt(E)`.
    pub scale: Option<f64>,
}

impl Tensor {
    /// `softmax(q k^T scale + mask) v` for queries `[.., L, E]` (this tensor), keys
    /// `[.., S, E]` and values `[.., S, Ev]`: `[.., L, Ev]`. A query whose keys are all masked
    /// attends to nothing, as in PyTorch 2.5 and later: its output row is 0 and no gradient
    /// flows through it (not NaN, which would reach every parameter before it). An
    /// `attn_mask` together with `is_causal` is refused, as PyTorch refuses it: fold the
    /// causal mask into `attn_mask`. Without a mask or dropout, with the same batch dims and heads
    /// (E, Ev) up to 128, it can be one fused op whose graph keeps one float per query (its
    /// log-sum-exp) instead of the `[.., L, S]` scores ([`set_attention_kernel`]: by default
    /// on CUDA's tensor cores, elsewhere from 2^26 scores up); otherwise a composition of
    /// existing ops.
    ///
    /// ```
    /// use mantissa::{AttentionOptions, Tensor, DType, Device};
    /// let q = Tensor::randn(&[2, 4, 5, 8], DType::F32, Device::Cpu)?;
    /// let kv = Tensor::randn(&[2, 4, 7, 8], DType::F32, Device::Cpu)?;
    /// let y = q.scaled_dot_product_attention(&kv, &kv, AttentionOptions::default())?;
    /// assert_eq!(y.shape(), &[2, 4, 5, 8]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn scaled_dot_product_attention(
        &self,
        key: &Tensor,
        value: &Tensor,
        o: AttentionOptions<'_>,
    ) -> Result<Tensor> {
        let (q, k, v) = (self, key, value);
        let fits = q.rank() >= 2
            && k.rank() >= 2
            && v.rank() >= 2
            && q.shape()[q.rank() - 1] == k.shape()[k.rank() - 1]
            && k.shape()[k.rank() - 2] == v.shape()[v.rank() - 2];
        if !fits {
            return Err(Error::invalid(
                "scaled_dot_product_attention",
                format!(
                    "needs query [.., L, E], key [.., S, E] and value [.., S, Ev], got {:?}, \
                     {:?} and {:?}",
                    q.shape(),
                    k.shape(),
                    v.shape()
                ),
            ));
        }
        if o.is_causal && o.attn_mask.is_some() {
            return Err(Error::invalid(
                "scaled_dot_product_attention",
                "an attn_mask together with is_causal (PyTorch refuses them too): fold the \
                 causal mask into attn_mask",
            ));
        }
        if !(0.0..1.0).contains(&o.dropout_p) {
            return Err(Error::invalid(
                "scaled_dot_product_attention",
                format!("dropout_p {} not in [0, 1)", o.dropout_p),
            ));
        }
        let e = q.shape()[q.rank() - 1];
        let scale = o.scale.unwrap_or(1.0 / (e.max(1) as f64).sqrt());
        if let Some(y) = fused(q, k, v, scale, o)? {
            return Ok(y);
        }
        attention_weights(q, k, scale, o, false)?.matmul(v)
    }
}

/// The attention weights `softmax(q k^T scale + mask)` `[.., L, S]` of the composition, after
/// dropout, a fully masked query's row 0. With `returned` they are what
/// `MultiheadAttention` returns with `need_weights`: made by ops as PyTorch makes them (f32
/// under autocast); otherwise, without a mask, [`scaled_softmax`] makes them in the
/// product's dtype. The caller has checked the arguments as
/// [`Tensor::scaled_dot_product_attention`] does.
pub(crate) fn attention_weights(
    q: &Tensor,
    k: &Tensor,
    scale: f64,
    o: AttentionOptions<'_>,
    returned: bool,
) -> Result<Tensor> {
    let (l, s) = (q.shape()[q.rank() - 2], k.shape()[k.rank() - 2]);
    if o.attn_mask.is_none() && !returned {
        let weights = scaled_softmax(&q.matmul(&k.mt()?)?, scale, o.is_causal)?;
        return match o.dropout_p > 0.0 {
            true => weights.dropout(o.dropout_p, true),
            false => Ok(weights),
        };
    }
    let mut scores = q.matmul(&k.mt()?)?.mul(scale)?;
    if o.is_causal {
        let rows = Tensor::ramp(l, q.device())?;
        let cols = Tensor::ramp(s, q.device())?;
        let later = cols.unsqueeze(0)?.gt(&rows.unsqueeze(1)?)?;
        // Added as a 0 / -inf matrix rather than filled in: the sum's backward passes the
        // gradient through as it is, where a fill's would select it element by element.
        let mask = Tensor::zeros(&[l, s], scores.dtype(), q.device())?
            .masked_fill(&later, f64::NEG_INFINITY)?;
        scores = scores.add(&mask)?;
    }
    // A row with no key left: its scores are all -inf, whose softmax is NaN. Such a row's
    // scores are replaced by zeros (a finite softmax, so that its backward is finite
    // too) and its weights by zeros afterwards (PyTorch 2.5's rule). The causal mask
    // alone never empties a row: query i keeps key 0.
    let mut dead = None;
    if let Some(m) = o.attn_mask {
        scores = match m.dtype() {
            DType::U8 => scores.masked_fill(&m.eq(0)?, f64::NEG_INFINITY)?,
            _ => scores.add(m)?,
        };
        let rows = crate::no_grad(|| scores.max(-1, true)?.0.eq(f64::NEG_INFINITY))?;
        scores = scores.masked_fill(&rows, 0.0)?;
        dead = Some(rows);
    }
    let weights = scores.softmax(-1)?;
    let weights = match &dead {
        Some(rows) => weights.masked_fill(rows, 0.0)?,
        None => weights,
    };
    match o.dropout_p > 0.0 {
        true => weights.dropout(o.dropout_p, true),
        false => Ok(weights),
    }
}

/// `softmax(scores scale)` over the last dim, query `i` (of the `L` in `[.., L, S]`) seeing
/// keys `0..=i` only when `causal`: one op and one backward, each a single pass over the
/// scores, in their dtype (the product's low dtype under autocast) with f32 arithmetic, the
/// scale applied in f32 (autocast's composition rounds the scaled scores to the low dtype
/// first). The weights are rounded once, to the dtype the next product reads, without the
/// scaled, masked and f32 copies of `[.., L, S]` a composition of ops makes; the backward
/// reads them in that dtype.
fn scaled_softmax(scores: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let _prof = crate::profiler::op(Op::Softmax.name());
    let scores = scores.row_major_whole()?;
    let r = scores.rank();
    let p = RowSoftmax {
        cols: scores.shape()[r - 1],
        scale,
        causal: causal.then(|| scores.shape()[r - 2]),
        log: false,
    };
    let y = Tensor::from_storage(scores.storage().softmax_rows(p)?, scores.shape());
    let saved = y.detach();
    let read = saved.clone();
    Ok(
        y.attach_saving("softmax", &[&scores], &[&read], move |g, _| {
            let g = g.to_dtype(saved.dtype())?.row_major_whole()?;
            let dx = saved.storage().softmax_rows_backward(&g.storage(), p)?;
            Ok(vec![Some(Tensor::from_storage(dx, saved.shape()))])
        }),
    )
}

/// Whether the fused op runs on tensor cores for these inputs (the CUDA backend's flash
/// kernels: compute capability 8.0 or later, f16 or bf16 once autocast has cast, one head
/// size of 64 or 128). `Auto` takes it then at every size: one launch forward where the
/// composition has two products and a softmax, and no `[.., L, S]` scores kept.
fn tensor_cores(q: &Tensor, v: &Tensor) -> bool {
    let dt = match crate::amp::active_dtype() {
        Some(low) if q.dtype().is_float() && q.dtype() != DType::F64 => low,
        _ => q.dtype(),
    };
    let (e, ev) = (q.shape()[q.rank() - 1], v.shape()[v.rank() - 1]);
    // bf16 arithmetic and the flash kernels' instructions both start at compute capability
    // 8.0.
    matches!(q.device(), crate::Device::Cuda(_))
        && matches!(dt, DType::F16 | DType::BF16)
        && e == ev
        && matches!(e, 64 | 128)
        && q.device().supports_bf16().unwrap_or(false)
}

/// The fused op when it applies (no mask, no dropout, equal batch dims, one float dtype that
/// is not f64 once autocast has cast, heads up to [`FUSED_MAX_HEAD`], no empty dim) and
/// [`attention_kernel`] wants it, else `None` for the composition.
fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    o: AttentionOptions<'_>,
) -> Result<Option<Tensor>> {
    let Some((out, run)) = FusedRun::start(q, k, v, scale, o)? else {
        return Ok(None);
    };
    // Backward reads the inputs and the output: writing one in place since is refused.
    let inputs = run.inputs.clone();
    let read = [&inputs[0], &inputs[1], &inputs[2], &out.detach()].map(|t| t.clone());
    Ok(Some(out.attach_saving(
        "scaled_dot_product_attention",
        &[&inputs[0], &inputs[1], &inputs[2]],
        &read.iter().collect::<Vec<_>>(),
        move |g, _| Ok(run.grads(g)?.into_iter().map(Some).collect()),
    )))
}

/// What the backward of one run of the fused op reads.
pub(super) struct FusedRun {
    /// q, k and v as the op read them (after autocast's casts): what the gradients are for.
    pub(super) inputs: [Tensor; 3],
    views: [Tensor; 3],
    saved_out: Tensor,
    lse: Tensor,
    d: AttnDims,
}

impl FusedRun {
    /// The fused op's forward when it applies and [`attention_kernel`] wants it (see
    /// [`fused`]): its output, not yet attached to a graph, and what its backward reads;
    /// else `None`.
    pub(super) fn start(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        o: AttentionOptions<'_>,
    ) -> Result<Option<(Tensor, FusedRun)>> {
        let r = q.rank();
        let batch = &q.shape()[..r - 2];
        let plain = o.attn_mask.is_none() && o.dropout_p == 0.0;
        let same_batch = k.rank() == r
            && v.rank() == r
            && &k.shape()[..r - 2] == batch
            && &v.shape()[..r - 2] == batch;
        if !plain || !same_batch || [q, k, v].iter().any(|t| t.numel() == 0) {
            return Ok(None);
        }
        let scores = batch.iter().product::<usize>() as u128
            * q.shape()[r - 2] as u128
            * k.shape()[r - 2] as u128;
        let wanted = match attention_kernel() {
            AttentionKernel::Auto => scores >= FUSED_FROM as u128 || tensor_cores(q, v),
            AttentionKernel::Fused => true,
            AttentionKernel::Composed => false,
        };
        if !wanted {
            return Ok(None);
        }
        let _prof = crate::profiler::op(Op::Attention.name());
        let [q, k, v] = dispatch(Op::Attention, [q, k, v])?;
        let dt = q.dtype();
        let floats = matches!(dt, DType::F32 | DType::F16 | DType::BF16);
        let (e, ev) = (q.shape()[r - 1], v.shape()[r - 1]);
        if !floats
            || k.dtype() != dt
            || v.dtype() != dt
            || e > FUSED_MAX_HEAD
            || ev > FUSED_MAX_HEAD
        {
            return Ok(None);
        }
        let d = AttnDims {
            b: batch.iter().product(),
            l: q.shape()[r - 2],
            s: k.shape()[r - 2],
            e,
            ev,
            scale,
            causal: o.is_causal,
        };
        // The views as they are (the backends read the batch dims flattened; the CUDA
        // kernels read `[B, H, T, e]` views in place), detached: the op's node is attached
        // by the caller.
        let views = [q.detach(), k.detach(), v.detach()];
        let ((out, lo), lse) = views[0].storage().attention(
            views[0].layout(),
            (&views[1].storage(), views[1].layout()),
            (&views[2].storage(), views[2].layout()),
            d,
        )?;
        let out = Tensor::from_storage_in(out, lo);
        let lse = Tensor::from_storage(lse, &[d.b, d.l]);
        let run = FusedRun {
            inputs: [q, k, v],
            saved_out: out.detach(),
            views,
            lse,
            d,
        };
        Ok(Some((out, run)))
    }

    /// The gradients of q, k and v from the output's gradient `g`.
    pub(super) fn grads(&self, g: &Tensor) -> Result<Vec<Tensor>> {
        let [q, k, v] = &self.views;
        let grads = q.storage().attention_backward(
            q.layout(),
            (&k.storage(), k.layout()),
            (&v.storage(), v.layout()),
            (&self.saved_out.storage(), self.saved_out.layout()),
            &self.lse.storage(),
            (&g.storage(), g.layout()),
            self.d,
        )?;
        Ok(grads
            .into_iter()
            .map(|(s, l)| Tensor::from_storage_in(s, l))
            .collect())
    }
}
