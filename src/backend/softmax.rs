//! Softmax along one dim, and the fused attention built on it: the [`SoftmaxOps`] family and
//! its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

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

/// Softmax and log-softmax along one dim; attention without a mask or dropout.
pub(crate) trait SoftmaxOps: BackendStorage {
    /// Softmax (log-softmax when `log`) along `dim`, contiguous in the view's shape.
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self>;
    /// `softmax(q k^T scale) v` with this storage the queries (views `[b, l, e]`, `[b, s, e]`,
    /// `[b, s, ev]` of one float dtype), the scores never stored: the output `[b, l, ev]` in
    /// the inputs' dtype and each query's log-sum-exp of its scores (F32 `[b, l]`).
    fn attention(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<(Self, Self)>;
    /// The gradients `(dq, dk, dv)` of [`SoftmaxOps::attention`] for the output gradient `g`
    /// (`[b, l, ev]`), from its output `o` and log-sum-exp `lse` (contiguous).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        o: &Self,
        lse: &Self,
        g: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<(Self, Self, Self)>;
}

impl Storage {
    /// See [`SoftmaxOps::softmax`].
    pub(crate) fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Storage> {
        on_backend!("softmax", [self], B => Ok(B::part(self).softmax(l, dim, log)?.wrap()))
    }

    /// See [`SoftmaxOps::attention`].
    pub(crate) fn attention(
        &self,
        lq: &Layout,
        (k, lk): (&Storage, &Layout),
        (v, lv): (&Storage, &Layout),
        d: AttnDims,
    ) -> Result<(Storage, Storage)> {
        on_backend!("scaled_dot_product_attention", [self, k, v], B => {
            let (o, lse) = B::part(self).attention(lq, (B::part(k), lk), (B::part(v), lv), d)?;
            Ok((o.wrap(), lse.wrap()))
        })
    }

    /// See [`SoftmaxOps::attention_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward(
        &self,
        lq: &Layout,
        (k, lk): (&Storage, &Layout),
        (v, lv): (&Storage, &Layout),
        o: &Storage,
        lse: &Storage,
        (g, lg): (&Storage, &Layout),
        d: AttnDims,
    ) -> Result<(Storage, Storage, Storage)> {
        on_backend!("scaled_dot_product_attention backward", [self, k, v, o, lse, g], B => {
            let (dq, dk, dv) = B::part(self).attention_backward(
                lq,
                (B::part(k), lk),
                (B::part(v), lv),
                B::part(o),
                B::part(lse),
                (B::part(g), lg),
                d,
            )?;
            Ok((dq.wrap(), dk.wrap(), dv.wrap()))
        })
    }
}
