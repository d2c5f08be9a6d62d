//! Matrix products: the [`MatmulOps`] family and its dispatch, with the shape checks every
//! backend relies on.

use super::cpu::host_can_hold;
use super::{common_device, on_backend, on_device, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::{Error, Result};

thread_local! {
    /// Whether this thread runs a cuDNN-class op (see [`as_cudnn_class`]).
    static CUDNN_CLASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` as a cuDNN-class op (an LSTM layer, as PyTorch's cuDNN RNN): its f32 products
/// follow the cuDNN TF32 switch (on by default, `torch.backends.cudnn.allow_tf32`) instead
/// of the matmul one (off by default). Restores the previous state even if `f` panics.
pub(crate) fn as_cudnn_class<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            CUDNN_CLASS.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CUDNN_CLASS.with(|c| c.replace(true)));
    f()
}

/// Whether the calling thread is inside [`as_cudnn_class`].
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
pub(crate) fn in_cudnn_class() -> bool {
    CUDNN_CLASS.with(|c| c.get())
}

/// Work a fused product `a [m, k] @ b [k, n]` does after the product (cuBLASLt's epilogues
/// on CUDA), each returning a second result beside the product's.
pub(crate) enum Fused<'a, S> {
    /// `gelu_tanh(a @ b + bias)`, and the pre-activation `a @ b + bias` (both `[m, n]`).
    GeluAuxBias((&'a S, &'a Layout)),
    /// `(a @ b) * gelu_tanh'(pre)` for `pre [m, n]`, and its sums over the `m` rows (`[n]`,
    /// the bias gradient of the layer that made `pre`).
    DGeluBGrad((&'a S, &'a Layout)),
    /// `a @ b`, and `a`'s sums over `k` (`[m]`: with `a = dy^T`, a Linear's bias gradient
    /// beside its weight's).
    SumLhs,
}

impl<'a> Fused<'a, Storage> {
    /// The same work on backend `B`'s storage.
    fn part<B: Backend>(&self) -> Fused<'a, B> {
        match *self {
            Fused::GeluAuxBias((s, l)) => Fused::GeluAuxBias((B::part(s), l)),
            Fused::DGeluBGrad((s, l)) => Fused::DGeluBGrad((B::part(s), l)),
            Fused::SumLhs => Fused::SumLhs,
        }
    }

    fn storages(&self) -> Vec<&'a Storage> {
        match *self {
            Fused::GeluAuxBias((s, _)) | Fused::DGeluBGrad((s, _)) => vec![s],
            Fused::SumLhs => vec![],
        }
    }
}

/// Batched matrix products `[.., m, k] @ [.., k, n]`.
pub(crate) trait MatmulOps: BackendStorage {
    /// `self @ rhs`, plus `bias` (as many elements as the product has columns) added in the
    /// product's accumulator when given.
    fn matmul(
        &self,
        l: &Layout,
        rhs: &Self,
        lr: &Layout,
        bias: Option<(&Self, &Layout)>,
    ) -> Result<Self>;

    /// `relu(self @ rhs + bias)` in one fused call where the backend has one; `None` where
    /// it has not (the default), and the caller composes the ops.
    fn linear_relu(
        &self,
        _l: &Layout,
        _rhs: &Self,
        _lr: &Layout,
        _bias: (&Self, &Layout),
    ) -> Result<Option<Self>> {
        Ok(None)
    }

    /// `self @ rhs` for 2-D operands with `f`'s work done in the same call where the backend
    /// can (its product and second result); `None` where it cannot (the default), and the
    /// caller composes the ops.
    fn matmul_fused(
        &self,
        _l: &Layout,
        _rhs: &Self,
        _lr: &Layout,
        _f: Fused<'_, Self>,
    ) -> Result<Option<(Self, Self)>> {
        Ok(None)
    }

    /// `self[ld] += a @ b` in place, for 2-D `a`, `b` and a destination with unit-stride
    /// rows (checked by the dispatcher).
    fn matmul_acc(
        &mut self,
        ld: &Layout,
        a: &Self,
        la: &Layout,
        b: &Self,
        lb: &Layout,
    ) -> Result<()>;
}

/// Checks that the product of `[.., m, k]` and `[.., k, n]` views has a representable
/// output `[.., m, n]` (two expanded operands can each be small in memory while `m * n`
/// overflows) before a kernel sizes its output from it; on the host, that it can be held.
fn product_fits(op: &'static str, s: &Storage, l: &Layout, lr: &Layout) -> Result<()> {
    let (a, b) = (l.shape(), lr.shape());
    let mut out = a[..a.len().saturating_sub(1)].to_vec();
    out.extend(b.last());
    let n = crate::layout::checked_numel(op, &out)?;
    crate::layout::checked_bytes(op, &out, n, s.dtype())?;
    match s {
        Storage::Cpu(_) => host_can_hold(n, s.dtype()),
        Storage::Cuda(_) => Ok(()),
    }
}

impl Storage {
    pub(crate) fn matmul(&self, l: &Layout, rhs: &Storage, lr: &Layout) -> Result<Storage> {
        product_fits("matmul", self, l, lr)?;
        on_backend!("matmul", [self, rhs], B => {
            Ok(B::part(self).matmul(l, B::part(rhs), lr, None)?.wrap())
        })
    }

    /// `relu(self @ rhs + bias)` in one fused call where the device has one (cuBLASLt's
    /// ReLU-bias epilogue on CUDA); `None` where it has not (the CPU), and the caller
    /// composes the ops.
    pub(crate) fn linear_relu(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        bias: &Storage,
        lb: &Layout,
    ) -> Result<Option<Storage>> {
        let device = common_device("linear_relu", &[self, rhs, bias])?;
        product_fits("linear_relu", self, l, lr)?;
        on_device!(device, B => {
            let out = B::part(self).linear_relu(l, B::part(rhs), lr, (B::part(bias), lb))?;
            Ok(out.map(B::wrap))
        })
    }

    /// `self @ rhs` with `f`'s work in the same call where the device has one (cuBLASLt's
    /// epilogues on CUDA): the product and `f`'s second result; `None` where it has not, and
    /// the caller composes the ops.
    pub(crate) fn matmul_fused(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        f: Fused<'_, Storage>,
    ) -> Result<Option<(Storage, Storage)>> {
        let mut all = vec![self, rhs];
        all.extend(f.storages());
        let device = common_device("matmul (fused)", &all)?;
        product_fits("matmul (fused)", self, l, lr)?;
        on_device!(device, B => {
            let out = B::part(self).matmul_fused(l, B::part(rhs), lr, f.part::<B>())?;
            Ok(out.map(|(p, q)| (B::wrap(p), B::wrap(q))))
        })
    }

    /// `self[ld] += a @ b` in place: `a [m, k]`, `b [k, n]`, and a destination view
    /// `[m, n]` with unit-stride rows (an LSTM layer adds each step's recurrent product onto
    /// its input projection this way; on CUDA it is one cuBLAS call with `beta = 1`).
    pub(crate) fn matmul_acc(
        &mut self,
        ld: &Layout,
        a: &Storage,
        la: &Layout,
        b: &Storage,
        lb: &Layout,
    ) -> Result<()> {
        let op = "matmul (accumulate)";
        let device = common_device(op, &[&*self, a, b])?;
        let (sa, sb, sd) = (la.shape(), lb.shape(), ld.shape());
        let fits = sa.len() == 2
            && sb.len() == 2
            && sa[1] == sb[0]
            && sd == [sa[0], sb[1]]
            && (ld.strides()[1] == 1 || sd[1] <= 1)
            && (sd[0] <= 1 || ld.strides()[0] >= sd[1]);
        if !fits {
            return Err(Error::invalid(
                op,
                format!(
                    "{sa:?} @ {sb:?} onto a [{}] view with strides {:?}",
                    sd.iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    ld.strides()
                ),
            ));
        }
        on_device!(device, B => {
            B::part_mut(self).matmul_acc(ld, B::part(a), la, B::part(b), lb)
        })
    }

    /// `self @ rhs + bias` with the bias added in the product's accumulator (on CUDA the
    /// output starts as the bias rows and cuBLAS adds the product, `beta = 1`): `bias` has as
    /// many elements as the product has columns.
    pub(crate) fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        bias: &Storage,
        lb: &Layout,
    ) -> Result<Storage> {
        let device = common_device("linear", &[self, rhs, bias])?;
        product_fits("linear", self, l, lr)?;
        on_device!(device, B => {
            Ok(B::part(self).matmul(l, B::part(rhs), lr, Some((B::part(bias), lb)))?.wrap())
        })
    }
}
