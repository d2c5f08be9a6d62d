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
