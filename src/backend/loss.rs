//! The fused cross-entropy: the [`LossOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Cross-entropy of logits `[rows, C]` against I64 class targets `[rows]`.
pub(crate) trait LossOps: BackendStorage {
    /// Per-row `(loss, log-sum-exp)` in the arithmetic dtype (F64 for F64 logits, F32
    /// otherwise). On the CPU a target out of range is an `Err` here; on CUDA the kernel
    /// finds it and the next read reports it.
    fn cross_entropy(
        &self,
        l: &Layout,
        target: &Self,
        lt: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<(Self, Self)>;
    /// The logits' gradient (contiguous, their dtype) from each row's gradient `g` and the
    /// forward's log-sum-exps, both in the arithmetic dtype.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        &self,
        l: &Layout,
        target: &Self,
        lt: &Layout,
        lse: &Self,
        g: &Self,
        lg: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<Self>;
    /// [`LossOps::cross_entropy_backward`] written over the logits `self` (row-major
    /// `[rows, cols]`, filling the storage), for a backward that holds the only handle to
    /// them (`autograd::reuse`).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward_in_place(
        &mut self,
        cols: usize,
        target: &Self,
        lt: &Layout,
        lse: &Self,
        g: &Self,
        lg: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<()>;
}

impl Storage {
    /// See [`LossOps::cross_entropy`].
    pub(crate) fn cross_entropy(
        &self,
        l: &Layout,
        target: &Storage,
        lt: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<(Storage, Storage)> {
        on_backend!("cross_entropy", [self, target], B => {
            let (loss, lse) = B::part(self).cross_entropy(l, B::part(target), lt, ignore, eps)?;
            Ok((loss.wrap(), lse.wrap()))
        })
    }

    /// See [`LossOps::cross_entropy_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cross_entropy_backward(
        &self,
        l: &Layout,
        target: &Storage,
        lt: &Layout,
        lse: &Storage,
        g: &Storage,
        lg: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<Storage> {
        on_backend!("cross_entropy backward", [self, target, lse, g], B => {
            let (t, z, g) = (B::part(target), B::part(lse), B::part(g));
            Ok(B::part(self).cross_entropy_backward(l, t, lt, z, g, lg, ignore, eps)?.wrap())
        })
    }
}

impl Storage {
    /// See [`LossOps::cross_entropy_backward_in_place`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cross_entropy_backward_in_place(
        &mut self,
        cols: usize,
        target: &Storage,
        lt: &Layout,
        lse: &Storage,
        g: &Storage,
        lg: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<()> {
        let op = "cross_entropy backward";
        let device = super::common_device(op, &[&*self, target, lse, g])?;
        super::on_device!(device, B => {
            let (t, z, g) = (B::part(target), B::part(lse), B::part(g));
            B::part_mut(self).cross_entropy_backward_in_place(cols, t, lt, z, g, lg, ignore, eps)
        })
    }
}
