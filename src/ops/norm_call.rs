//! What one batch norm call is ([`BnCall`]) and which running statistics and counter it
//! writes in place ([`InPlace`]): shared by the engine's own passes (`norm.rs`) and the
//! library's fused call (`norm_fused.rs`), which import it from here.

use crate::backend::cpu::norm::stat_dtype;
use crate::backend::Storage;
use crate::{DType, Result, Tensor};

/// How [`Tensor::batch_norm_counted`] runs: training or eval, the running statistics'
/// momentum, eps, and whether a ReLU follows in the same passes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BnCall {
    pub training: bool,
    pub momentum: f64,
    pub eps: f64,
    pub relu: bool,
}

/// The running statistics and the batch counter a batch norm call can write in place: whole
/// `[c]` tensors of the statistics dtype on `x`'s device (mean and variance on storages of
/// their own), a whole one-element i64 counter there. Others are left to tensor ops.
pub(super) struct InPlace<'a> {
    pub running: Option<(&'a Tensor, &'a Tensor)>,
    pub tracked: Option<&'a Tensor>,
}

impl<'a> InPlace<'a> {
    pub fn of(
        x: &Tensor,
        (mean, var): (Option<&'a Tensor>, Option<&'a Tensor>),
        tracked: Option<&'a Tensor>,
    ) -> Self {
        let sd = stat_dtype(x.dtype());
        let direct =
            |t: &Tensor, dtype| t.dtype() == dtype && t.device() == x.device() && t.fills_storage();
        InPlace {
            running: mean
                .zip(var)
                .filter(|(m, v)| direct(m, sd) && direct(v, sd) && !m.shares_storage(v)),
            tracked: tracked.filter(|t| direct(t, DType::I64) && t.numel() == 1),
        }
    }

    /// Runs `f` with write access to the running statistics and the counter taken in place.
    pub fn write<R>(
        &self,
        f: impl FnOnce(Option<(&mut Storage, &mut Storage)>, Option<&mut Storage>) -> Result<R>,
    ) -> Result<R> {
        let mut written: Vec<&Tensor> = self.running.iter().flat_map(|(m, v)| [*m, *v]).collect();
        written.extend(self.tracked);
        Tensor::write_many("batch_norm", &written, |s| {
            let mut s = s.iter_mut();
            let running = match self.running {
                Some(_) => s.next().zip(s.next()).map(|(m, v)| (&mut **m, &mut **v)),
                None => None,
            };
            let tracked = self.tracked.and(s.next()).map(|t| &mut **t);
            f(running, tracked)
        })
    }
}
