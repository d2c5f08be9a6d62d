//! Batch and layer normalisation: the [`NormOps`] family and its dispatch. Batch norm's
//! fused passes work on the `[outer, channels, inner]` view of `spec::ChannelSplit`.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// An optional operand with its layout.
type Opt<'a, S> = Option<(&'a S, &'a Layout)>;

/// Batch norm's per-channel passes and layer norm's fused rows.
pub(crate) trait NormOps: BackendStorage {
    /// Per-channel mean and biased variance `[2, c]` (means first) of a dense `[n, c, ...]`
    /// tensor, in f32 (f64 for f64 input).
    fn channel_moments(&self, l: &Layout) -> Result<Self>;
    /// Per-channel `[sum dy, sum dy (x - mean)]` `[2, c]`; `self` is `dy`, `dy` and `x` dense
    /// in one format, `mean` `[c]` in the statistics dtype.
    fn channel_grad_sums(
        &self,
        ld: &Layout,
        x: &Self,
        lx: &Layout,
        mean: &Self,
        lm: &Layout,
    ) -> Result<Self>;
    /// `alpha[c] (x - center[c]) + gamma[c] (+ beta[c] dy)` in `x`'s (`self`'s) dtype and
    /// dense layout, with `coef = [alpha | center | gamma | beta]` `[4, c]` in the statistics
    /// dtype; `dy`, when given, shares `x`'s layout and dtype. Forward it is the output
    /// (`alpha = invstd w`, `center = mean`, `gamma = b`), backward the input's gradient.
    fn channel_affine(&self, lx: &Layout, dy: Opt<Self>, coef: &Self, lc: &Layout) -> Result<Self>;
    /// Layer norm over rows of `cols` elements (the trailing dims of a contiguous `x`): the
    /// output in `x`'s dtype and the statistics `[rows, 2]` (mean, 1 / sqrt(var + eps)) in
    /// f32 (f64 for f64); `w` and `b` (`cols` elements) share `x`'s dtype.
    fn layer_norm(
        &self,
        lx: &Layout,
        cols: usize,
        w: Opt<Self>,
        b: Opt<Self>,
        eps: f64,
    ) -> Result<(Self, Self)>;
    /// The input's gradient of [`NormOps::layer_norm`]; `self` is the output's gradient.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        ld: &Layout,
        x: &Self,
        lx: &Layout,
        cols: usize,
        stats: &Self,
        w: Opt<Self>,
    ) -> Result<Self>;
}

/// `v`'s storage as backend `B`'s (the device already checked).
fn part<'a, B: Backend>(v: Opt<'a, Storage>) -> Opt<'a, B> {
    v.map(|(s, l)| (B::part(s), l))
}

impl Storage {
    /// See [`NormOps::channel_moments`].
    pub(crate) fn channel_moments(&self, l: &Layout) -> Result<Storage> {
        on_backend!("batch_norm", [self], B => Ok(B::part(self).channel_moments(l)?.wrap()))
    }

    /// See [`NormOps::channel_grad_sums`].
    pub(crate) fn channel_grad_sums(
        &self,
        ld: &Layout,
        x: &Storage,
        lx: &Layout,
        mean: &Storage,
        lm: &Layout,
    ) -> Result<Storage> {
        on_backend!("batch_norm backward", [self, x, mean], B => {
            Ok(B::part(self).channel_grad_sums(ld, B::part(x), lx, B::part(mean), lm)?.wrap())
        })
    }

    /// See [`NormOps::channel_affine`].
    pub(crate) fn channel_affine(
        &self,
        lx: &Layout,
        dy: Opt<Storage>,
        coef: &Storage,
        lc: &Layout,
    ) -> Result<Storage> {
        let op = "batch_norm";
        let device = match dy {
            Some((d, _)) => super::common_device(op, &[self, d, coef])?,
            None => super::common_device(op, &[self, coef])?,
        };
        super::on_device!(device, B => {
            Ok(B::part(self).channel_affine(lx, part(dy), B::part(coef), lc)?.wrap())
        })
    }

    /// See [`NormOps::layer_norm`].
    pub(crate) fn layer_norm(
        &self,
        lx: &Layout,
        cols: usize,
        w: Opt<Storage>,
        b: Opt<Storage>,
        eps: f64,
    ) -> Result<(Storage, Storage)> {
        let mut all = vec![self];
        all.extend(w.map(|v| v.0));
        all.extend(b.map(|v| v.0));
        let device = super::common_device("layer_norm", &all)?;
        super::on_device!(device, B => {
            let (y, s) = B::part(self).layer_norm(lx, cols, part(w), part(b), eps)?;
            Ok((y.wrap(), s.wrap()))
        })
    }

    /// See [`NormOps::layer_norm_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_backward(
        &self,
        ld: &Layout,
        x: &Storage,
        lx: &Layout,
        cols: usize,
        stats: &Storage,
        w: Opt<Storage>,
    ) -> Result<Storage> {
        let mut all = vec![self, x, stats];
        all.extend(w.map(|v| v.0));
        let device = super::common_device("layer_norm backward", &all)?;
        super::on_device!(device, B => {
            let (x, s) = (B::part(x), B::part(stats));
            Ok(B::part(self).layer_norm_backward(ld, x, lx, cols, s, part(w))?.wrap())
        })
    }
}
