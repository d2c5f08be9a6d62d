//! Softmax along one dim, and the fused attention built on it: the [`SoftmaxOps`] family and
//! its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the fused attention may run through cuDNN ([`set_cudnn_attention`]).
static CUDNN_ATTENTION: AtomicBool = AtomicBool::new(true);

/// Lets the fused op on CUDA run through cuDNN's fused attention where cuDNN (9.0 or later)
/// takes the problem (PyTorch's `torch.backends.cuda.enable_cudnn_sdp`; on by default): f16
/// or bf16 on compute capability 8.0 or later, one head size that is a multiple of 8 up to
/// 128. Off, or where cuDNN is missing or declines, the engine's own kernels run.
///
/// ```
/// use mantissa::{cudnn_attention, set_cudnn_attention};
/// set_cudnn_attention(false);
/// assert!(!cudnn_attention());
/// set_cudnn_attention(true);
/// ```
pub fn set_cudnn_attention(on: bool) {
    CUDNN_ATTENTION.store(on, Ordering::Relaxed);
}

/// Whether [`set_cudnn_attention`] lets cuDNN run the fused op.
pub fn cudnn_attention() -> bool {
    CUDNN_ATTENTION.load(Ordering::Relaxed)
}

/// The sizes of a fused attention: `b` batch entries of queries `[l, e]`, keys `[s, e]` and
/// values `[s, ev]`; the scores' factor, and whether query `i` sees keys `0..=i` only.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    pub b: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    pub scale: f64,
    pub causal: bool,
}

impl AttnDims {
    /// The output's contiguous layout: the queries' shape with the last dim `ev`.
    pub(crate) fn out_layout(&self, lq: &Layout) -> Layout {
        let mut shape = lq.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.ev;
        }
        Layout::contiguous(&shape)
    }
}

/// A softmax over rows of `cols` contiguous values ([`SoftmaxOps::softmax_rows`]): the values
/// multiplied by `scale` first; with `causal: Some(l)`, row `r`'s columns past `r % l` taken
/// as -inf (a causal attention's scores, `l` queries per matrix: query `i` sees keys
/// `0..=i`); log-softmax when `log`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RowSoftmax {
    pub cols: usize,
    pub scale: f64,
    pub causal: Option<usize>,
    pub log: bool,
}

/// Softmax and log-softmax along one dim; attention without a mask or dropout.
pub(crate) trait SoftmaxOps: BackendStorage {
    /// Softmax (log-softmax when `log`) along `dim`, contiguous in the view's shape.
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self>;
    /// The softmax `p` describes of each row of this contiguous storage (`[rows, p.cols]`),
    /// in its dtype, computed in f32 or wider.
    fn softmax_rows(&self, p: RowSoftmax) -> Result<Self>;
    /// The input's gradient of [`SoftmaxOps::softmax_rows`] from its output (this storage)
    /// and the output's gradient `g` (contiguous, same dtype): `scale y (g - sum(g y))`, or
    /// `scale (g - exp(y) sum(g))` for log-softmax, per row.
    fn softmax_rows_backward(&self, g: &Self, p: RowSoftmax) -> Result<Self>;
    /// `softmax(q k^T scale) v` with this storage the queries (views `[.., l, e]`,
    /// `[.., s, e]`, `[.., s, ev]` of one float dtype whose batch dims flatten to `b`), the
    /// scores never stored: the output, in the inputs' dtype with the queries' shape (last
    /// dim `ev`) and a layout of the backend's choosing, and each query's log-sum-exp of
    /// its scores (F32 `[b, l]`, contiguous).
    fn attention(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<((Self, Layout), Self)>;
    /// The gradients `[dq, dk, dv]` of [`SoftmaxOps::attention`] for the output gradient `g`,
    /// from its output `o` and log-sum-exp `lse`, each with the shape of its input and a
    /// layout of the backend's choosing.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        o: (&Self, &Layout),
        lse: &Self,
        g: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<[(Self, Layout); 3]>;
}

impl Storage {
    /// See [`SoftmaxOps::softmax`].
    pub(crate) fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Storage> {
        on_backend!("softmax", [self], B => Ok(B::part(self).softmax(l, dim, log)?.wrap()))
    }

    /// See [`SoftmaxOps::softmax_rows`]. A causal mask with log-softmax is refused: its
    /// backward would not know the masked columns (softmax's are its zeros).
    pub(crate) fn softmax_rows(&self, p: RowSoftmax) -> Result<Storage> {
        if p.log && p.causal.is_some() {
            return Err(crate::Error::invalid(
                "log_softmax",
                "a causal mask is applied with softmax only",
            ));
        }
        on_backend!("softmax", [self], B => Ok(B::part(self).softmax_rows(p)?.wrap()))
    }

    /// See [`SoftmaxOps::softmax_rows_backward`].
    pub(crate) fn softmax_rows_backward(&self, g: &Storage, p: RowSoftmax) -> Result<Storage> {
        on_backend!("softmax backward", [self, g], B => {
            Ok(B::part(self).softmax_rows_backward(B::part(g), p)?.wrap())
        })
    }

    /// See [`SoftmaxOps::attention`].
    pub(crate) fn attention(
        &self,
        lq: &Layout,
        (k, lk): (&Storage, &Layout),
        (v, lv): (&Storage, &Layout),
        d: AttnDims,
    ) -> Result<((Storage, Layout), Storage)> {
        on_backend!("scaled_dot_product_attention", [self, k, v], B => {
            let ((o, lo), lse) =
                B::part(self).attention(lq, (B::part(k), lk), (B::part(v), lv), d)?;
            Ok(((o.wrap(), lo), lse.wrap()))
        })
    }

    /// See [`SoftmaxOps::attention_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward(
        &self,
        lq: &Layout,
        (k, lk): (&Storage, &Layout),
        (v, lv): (&Storage, &Layout),
        (o, lo): (&Storage, &Layout),
        lse: &Storage,
        (g, lg): (&Storage, &Layout),
        d: AttnDims,
    ) -> Result<[(Storage, Layout); 3]> {
        on_backend!("scaled_dot_product_attention backward", [self, k, v, o, lse, g], B => {
            let grads = B::part(self).attention_backward(
                lq,
                (B::part(k), lk),
                (B::part(v), lv),
                (B::part(o), lo),
                B::part(lse),
                (B::part(g), lg),
                d,
            )?;
            Ok(grads.map(|(s, l)| (s.wrap(), l)))
        })
    }
}
