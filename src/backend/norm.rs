//! Device dispatch of batch normalisation's fused passes (`cpu/norm.rs`, `cuda/norm.rs`) over
//! the `[outer, channels, inner]` view both backends work on (`spec::ChannelSplit`).

use super::{common_device, CpuStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// An operand already checked to be on the CPU, as the CPU storage.
fn on_cpu<'a>(v: Option<(&'a Storage, &'a Layout)>) -> Option<(&'a CpuStorage, &'a Layout)> {
    v.map(|(s, l)| (s.as_cpu().expect("common_device checked the device"), l))
}

/// An operand already checked to be on a GPU, as the CUDA storage.
#[cfg(feature = "cuda")]
fn on_cuda<'a>(
    v: Option<(&'a Storage, &'a Layout)>,
) -> Option<(&'a super::cuda::storage::CudaStorage, &'a Layout)> {
    v.map(|(s, l)| (s.as_cuda().expect("common_device checked the device"), l))
}

impl Storage {
    /// Per-channel mean and biased variance `[2, c]` (means first) of a dense `[n, c, ...]`
    /// tensor, in f32 (f64 for f64 input).
    pub(crate) fn channel_moments(&self, l: &Layout) -> Result<Storage> {
        match self {
            Storage::Cpu(x) => Ok(Storage::Cpu(super::cpu::norm::channel_moments(x, l)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(x) => Ok(Storage::Cuda(super::cuda::norm::channel_moments(x, l)?)),
        }
    }

    /// Per-channel `[sum dy, sum dy (x - mean)]` `[2, c]`; `self` is `dy`, `dy` and `x` dense
    /// in one format, `mean` `[c]` in the statistics dtype.
    pub(crate) fn channel_grad_sums(
        &self,
        ld: &Layout,
        x: &Storage,
        lx: &Layout,
        mean: &Storage,
        lm: &Layout,
    ) -> Result<Storage> {
        let op = "batch_norm backward";
        common_device(op, &[self, x, mean])?;
        match (self, x, mean) {
            (Storage::Cpu(d), Storage::Cpu(x), Storage::Cpu(m)) => Ok(Storage::Cpu(
                super::cpu::norm::channel_grad_sums(d, ld, x, lx, m, lm)?,
            )),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(d), Storage::Cuda(x), Storage::Cuda(m)) => Ok(Storage::Cuda(
                super::cuda::norm::channel_grad_sums(d, ld, x, lx, m, lm)?,
            )),
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    /// `alpha[c] (x - center[c]) + gamma[c] (+ beta[c] dy)` in `x`'s (`self`'s) dtype and
    /// dense layout, with `coef = [alpha | center | gamma | beta]` `[4, c]` in the statistics
    /// dtype; `dy`, when given, shares `x`'s layout and dtype. Forward it is the output
    /// (`alpha = invstd w`, `center = mean`, `gamma = b`), backward the input's gradient.
    pub(crate) fn channel_affine(
        &self,
        lx: &Layout,
        dy: Option<(&Storage, &Layout)>,
        coef: &Storage,
        lc: &Layout,
    ) -> Result<Storage> {
        let op = "batch_norm";
        match dy {
            Some((d, _)) => common_device(op, &[self, d, coef])?,
            None => common_device(op, &[self, coef])?,
        };
        match (self, dy, coef) {
            (Storage::Cpu(x), None, Storage::Cpu(k)) => Ok(Storage::Cpu(
                super::cpu::norm::channel_affine(x, lx, None, k, lc)?,
            )),
            (Storage::Cpu(x), Some((Storage::Cpu(d), ld)), Storage::Cpu(k)) => Ok(Storage::Cpu(
                super::cpu::norm::channel_affine(x, lx, Some((d, ld)), k, lc)?,
            )),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), None, Storage::Cuda(k)) => Ok(Storage::Cuda(
                super::cuda::norm::channel_affine(x, lx, None, k, lc)?,
            )),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), Some((Storage::Cuda(d), ld)), Storage::Cuda(k)) => {
                Ok(Storage::Cuda(super::cuda::norm::channel_affine(
                    x,
                    lx,
                    Some((d, ld)),
                    k,
                    lc,
                )?))
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    /// Layer norm over rows of `cols` elements (the trailing dims of a contiguous `x`): the
    /// output in `x`'s dtype and the statistics `[rows, 2]` (mean, 1 / sqrt(var + eps)) in
    /// f32 (f64 for f64); `w` and `b` (`cols` elements) share `x`'s dtype.
    pub(crate) fn layer_norm(
        &self,
        lx: &Layout,
        cols: usize,
        w: Option<(&Storage, &Layout)>,
        b: Option<(&Storage, &Layout)>,
        eps: f64,
    ) -> Result<(Storage, Storage)> {
        let op = "layer_norm";
        let mut all = vec![self];
        all.extend(w.map(|v| v.0));
        all.extend(b.map(|v| v.0));
        common_device(op, &all)?;
        match self {
            Storage::Cpu(x) => {
                let (w, b) = (on_cpu(w), on_cpu(b));
                let (y, s) = super::cpu::layer_norm::layer_norm(x, lx, cols, w, b, eps)?;
                Ok((Storage::Cpu(y), Storage::Cpu(s)))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(x) => {
                let (w, b) = (on_cuda(w), on_cuda(b));
                let (y, s) = super::cuda::norm::layer_norm(x, lx, cols, w, b, eps)?;
                Ok((Storage::Cuda(y), Storage::Cuda(s)))
            }
        }
    }

    /// The input's gradient of [`Storage::layer_norm`]; `self` is the output's gradient.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_backward(
        &self,
        ld: &Layout,
        x: &Storage,
        lx: &Layout,
        cols: usize,
        stats: &Storage,
        w: Option<(&Storage, &Layout)>,
    ) -> Result<Storage> {
        let op = "layer_norm backward";
        let mut all = vec![self, x, stats];
        all.extend(w.map(|v| v.0));
        common_device(op, &all)?;
        match (self, x, stats) {
            (Storage::Cpu(d), Storage::Cpu(x), Storage::Cpu(s)) => Ok(Storage::Cpu(
                super::cpu::layer_norm::layer_norm_backward(d, ld, x, lx, cols, s, on_cpu(w))?,
            )),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(d), Storage::Cuda(x), Storage::Cuda(s)) => Ok(Storage::Cuda(
                super::cuda::norm::layer_norm_backward(d, ld, x, lx, cols, s, on_cuda(w))?,
            )),
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }
}
