//! Device dispatch of the fused cross-entropy (`cpu/loss.rs`, `cuda/loss.rs`).

use super::{common_device, CpuStorage, Storage};
use crate::layout::Layout;
use crate::{Error, Result};

/// A CPU target storage's values in order.
fn host_targets(op: &'static str, t: &CpuStorage, l: &Layout) -> Result<Vec<i64>> {
    match t {
        CpuStorage::I64(v) => Ok(super::cpu::contiguous(v, l).into_owned()),
        other => Err(Error::DType {
            op,
            dtype: other.dtype(),
            expected: "I64 class indices",
        }),
    }
}

impl Storage {
    /// Per-row `(loss, log-sum-exp)` of logits `[rows, C]` against I64 targets `[rows]`, in
    /// the arithmetic dtype (F64 for F64 logits, F32 otherwise). On the CPU a target out of
    /// range is an `Err` here; on CUDA the kernel finds it and the next read reports it.
    pub(crate) fn cross_entropy(
        &self,
        l: &Layout,
        target: &Storage,
        lt: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<(Storage, Storage)> {
        let op = "cross_entropy";
        common_device(op, &[self, target])?;
        match (self, target) {
            (Storage::Cpu(x), Storage::Cpu(t)) => {
                let t = host_targets(op, t, lt)?;
                let (loss, lse) = super::cpu::cross_entropy(x, l, &t, ignore, eps)?;
                Ok((Storage::Cpu(loss), Storage::Cpu(lse)))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), Storage::Cuda(t)) => {
                let (loss, lse) = super::cuda::loss::cross_entropy(x, l, t, lt, ignore, eps)?;
                Ok((Storage::Cuda(loss), Storage::Cuda(lse)))
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    /// The logits' gradient (contiguous, their dtype) from each row's gradient `g` and the
    /// forward's log-sum-exps, both in the arithmetic dtype.
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
        let op = "cross_entropy backward";
        common_device(op, &[self, target, lse, g])?;
        match (self, target, lse, g) {
            (Storage::Cpu(x), Storage::Cpu(t), Storage::Cpu(z), Storage::Cpu(g)) => {
                let t = host_targets(op, t, lt)?;
                Ok(Storage::Cpu(super::cpu::cross_entropy_backward(
                    x, l, &t, z, g, lg, ignore, eps,
                )?))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), Storage::Cuda(t), Storage::Cuda(z), Storage::Cuda(g)) => {
                Ok(Storage::Cuda(super::cuda::loss::cross_entropy_backward(
                    x, l, t, lt, z, g, lg, ignore, eps,
                )?))
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }
}
