//! Batch and layer normalisation: the [`NormOps`] family and its dispatch. Batch norm's
//! fused passes work on the `[outer, channels, inner]` view of `spec::ChannelSplit`: forward
//! a reduction that ends in the per-channel coefficients (running statistics updated on the
//! way) and an affine pass; backward the same with the gradient sums.

use super::{Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// An optional operand with its layout.
type Opt<'a, S> = Option<(&'a S, &'a Layout)>;

/// Batch norm's per-channel passes and layer norm's fused rows.
pub(crate) trait NormOps: BackendStorage {
    /// Batch norm's forward statistics `[5, c]` in the statistics dtype (f32, f64 for f64):
    /// `[a | mean | b | invstd | var]` with `invstd = 1 / sqrt(var + eps)` and `a = invstd w`,
    /// the coefficients [`NormOps::channel_affine`] takes for the output and the backward
    /// reads. `self` is the dense `[n, c, ...]` input; see [`BnForward`].
    fn batch_norm_stats(&self, lx: &Layout, p: BnForward<'_, Self>) -> Result<Self>;
    /// Batch norm's backward coefficients `[4, c]` (`[alpha | mean | gamma | beta]` for
    /// [`NormOps::channel_affine`] of `x` and `dy`) and, with sums, the weight's and bias's
    /// gradients `sum dy xhat`, `sum dy` (`[c]` each, in the statistics dtype); see
    /// [`BnGradOut`]. `self` is `dy`, dense in `x`'s format; `stats` the forward's `[5, c]`.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_grad(
        &self,
        ld: &Layout,
        x: &Self,
        lx: &Layout,
        stats: &Self,
        ls: &Layout,
        mode: BnGrad,
        relu: FusedRelu<'_, Self>,
    ) -> Result<BnGradOut<Self>>;
    /// `alpha[c] (x - center[c]) + gamma[c]` plus the [`Addend`] in `x`'s (`self`'s) dtype
    /// and dense layout, with `coef = [alpha | center | gamma | beta]` `[4, c]` in the
    /// statistics dtype; the addend shares `x`'s layout and dtype. Forward it is the output
    /// (`alpha = invstd w`, `center = mean`, `gamma = b`, a residual added), backward the
    /// input's gradient (`beta dy` added). `relu` fuses a ReLU: [`FusedRelu::Output`]
    /// forward (after the residual), [`FusedRelu::Grad`] backward (masking `dy`).
    fn channel_affine(
        &self,
        lx: &Layout,
        add: Addend<'_, Self>,
        coef: &Self,
        lc: &Layout,
        relu: FusedRelu<'_, Self>,
    ) -> Result<Self>;
    /// Training batch norm in one library call, `relu(bn(x) + z)` with the ReLU and the
    /// residual `z` optional (cuDNN's NHWC batch norm on CUDA, when switched on), running
    /// statistics and the batch counter updated on the way; `None` where the backend has no
    /// such call for these operands (the default), and the caller runs the passes above.
    /// `self` is a dense channels-last `[n, c, h, w]` x.
    fn batch_norm_fused(
        &self,
        _lx: &Layout,
        _p: FusedBn<'_, Self>,
    ) -> Result<Option<FusedBnOut<Self>>> {
        Ok(None)
    }
    /// The backward of [`NormOps::batch_norm_fused`]; `self` is `dy`, dense channels-last.
    fn batch_norm_fused_backward(
        &self,
        _ld: &Layout,
        _b: FusedBnBack<'_, Self>,
    ) -> Result<FusedBnGrads<Self>> {
        Err(crate::Error::invalid(
            "batch_norm backward",
            "this device made no fused batch norm to differentiate",
        ))
    }
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
    /// `self + r` (same shapes; `r` in `self`'s dtype or, with an f32 `self`, f16/bf16) and
    /// [`NormOps::layer_norm`] of that sum in one pass where the backend has one: `(sum, y,
    /// stats)`; `None` where it has not (the default), and the caller composes the ops.
    #[allow(clippy::too_many_arguments)]
    fn add_layer_norm(
        &self,
        _lx: &Layout,
        _r: (&Self, &Layout),
        _cols: usize,
        _w: Opt<Self>,
        _b: Opt<Self>,
        _eps: f64,
    ) -> Result<Option<(Self, Self, Self)>> {
        Ok(None)
    }
    /// The gradients of [`NormOps::layer_norm`] from the output's (`self`), as `want` asks:
    /// the input's, and the weight's and bias's (the sums over the rows of `dy xhat` and
    /// `dy`, in `x`'s dtype, summed in f32 or wider), the CUDA backend in one kernel over
    /// `dy` and `x`, the CPU's in a second pass over their rows.
    /// A backend may leave the parameters' out for some shapes (`params: None`); the caller
    /// then sums them itself.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        ld: &Layout,
        x: &Self,
        lx: &Layout,
        cols: usize,
        stats: &Self,
        w: Opt<Self>,
        want: LnWant,
    ) -> Result<LnGrads<Self>>;
}

/// Which gradients [`NormOps::layer_norm_backward`] makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LnWant {
    /// The input's.
    pub dx: bool,
    /// The weight's and the bias's.
    pub params: bool,
}

/// What [`NormOps::layer_norm_backward`] made: the input's gradient, and the weight's and
/// bias's.
pub(crate) struct LnGrads<S> {
    pub dx: Option<S>,
    pub params: Option<(S, S)>,
}

impl<S> Default for LnGrads<S> {
    fn default() -> Self {
        LnGrads {
            dx: None,
            params: None,
        }
    }
}

/// Where batch norm's forward statistics come from.
pub(crate) enum BnSource<'a, S> {
    /// Training: the batch's mean and biased variance. The running statistics, when given
    /// (whole `[c]` storages in the statistics dtype), become `(1 - momentum) running +
    /// momentum batch` (unbiased variance), and `tracked` (a whole one-element i64 storage)
    /// counts the batch, in the same pass.
    Batch {
        running: Option<(&'a mut S, &'a mut S)>,
        tracked: Option<&'a mut S>,
        momentum: f64,
        /// The input's per-channel sums and sums of squares, f32 `[2, c]`, where the op
        /// that made the input computed them (a convolution's epilogue: `ConvOps::
        /// conv2d_with_sums`): the statistics then come from them, with no pass over x.
        /// Backends without such an op never get them.
        sums: Option<&'a S>,
    },
    /// Eval: the running mean and variance (whole `[c]` storages in the statistics dtype).
    Running(&'a S, &'a S),
}

/// The operands of [`NormOps::batch_norm_stats`]: the affine parameters (`[c]` in the
/// statistics dtype; absent, 1 and 0), where the statistics come from, and `eps`.
pub(crate) struct BnForward<'a, S> {
    pub weight: Opt<'a, S>,
    pub bias: Opt<'a, S>,
    pub source: BnSource<'a, S>,
    pub eps: f64,
}

/// A ReLU fused with batch norm (`BatchNorm2d` followed by ReLU in a `Sequential`).
pub(crate) enum FusedRelu<'a, S> {
    None,
    /// Forward: the output clamped below at 0 (NaN stays NaN).
    Output,
    /// Backward: the output's gradient counts only where the forward's output was above 0,
    /// or NaN, as ReLU's own backward. The output is recomputed from the input `x` with the
    /// forward's statistics (`[5, c]` as [`NormOps::batch_norm_stats`] made them: `alpha (x -
    /// center) + gamma`, before the clamp), so nothing is kept for the mask and the passes
    /// read one tensor fewer. In [`NormOps::batch_norm_grad`] they are its `stats` operand.
    Recompute(&'a S, &'a Layout),
    /// Backward with a residual (`relu(bn(x) + r)`): the output's gradient counts only where
    /// the forward's output `y` (dense in the gradient's format) is above 0, or NaN, and
    /// [`NormOps::batch_norm_grad`] also returns the masked gradient (the residual's
    /// gradient), written in the pass that sums it.
    GradKept(&'a S, &'a Layout),
}

// By hand: a derive would ask `S: Copy`, and the variants only hold references.
impl<S> Clone for FusedRelu<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for FusedRelu<'_, S> {}

impl<'a, S> FusedRelu<'a, S> {
    /// The forward output a backward masks with, if any.
    pub(crate) fn mask(self) -> Option<(&'a S, &'a Layout)> {
        match self {
            FusedRelu::GradKept(y, l) => Some((y, l)),
            _ => None,
        }
    }

    /// The forward statistics a backward recomputes its mask with, if any.
    pub(crate) fn stats(self) -> Option<(&'a S, &'a Layout)> {
        match self {
            FusedRelu::Recompute(s, l) => Some((s, l)),
            _ => None,
        }
    }
}

impl<'a> FusedRelu<'a, Storage> {
    /// The storage it reads, if any.
    fn operand(&self) -> Option<&'a Storage> {
        self.mask().or(self.stats()).map(|(y, _)| y)
    }

    /// The same seen as backend `B`'s (the device already checked).
    fn part<B: Backend>(self) -> FusedRelu<'a, B> {
        match self {
            FusedRelu::None => FusedRelu::None,
            FusedRelu::Output => FusedRelu::Output,
            FusedRelu::Recompute(s, l) => FusedRelu::Recompute(B::part(s), l),
            FusedRelu::GradKept(y, l) => FusedRelu::GradKept(B::part(y), l),
        }
    }
}

/// What [`NormOps::batch_norm_grad`] gives: the coefficients `[4, c]`, the weight's and
/// bias's gradients when the mode sums them, and the masked gradient (dense in the
/// gradient's format, from offset 0) when the mode reads the gradient (not
/// [`BnGrad::EvalInputOnly`]): always with [`FusedRelu::GradKept`], and with
/// [`FusedRelu::Recompute`] where the backend made it anyway (the CPU; CUDA recomputes the
/// mask in registers and writes none). The caller then reads it in place of `dy`, unmasked.
pub(crate) struct BnGradOut<S> {
    pub coef: S,
    pub params: Option<(S, S)>,
    pub masked: Option<S>,
}

/// What [`NormOps::channel_affine`] adds to `alpha (x - center) + gamma`: an operand in
/// `x`'s dtype and dense format.
pub(crate) enum Addend<'a, S> {
    None,
    /// `beta[c] dy`: the output's gradient, backward.
    Scaled(&'a S, &'a Layout),
    /// `r` itself: a residual added before a fused ReLU (`relu(bn(x) + r)`), forward.
    Residual(&'a S, &'a Layout),
}

// By hand, as for FusedRelu.
impl<S> Clone for Addend<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for Addend<'_, S> {}

impl<'a, S> Addend<'a, S> {
    /// The operand with its layout, if any.
    pub(crate) fn operand(self) -> Option<(&'a S, &'a Layout)> {
        match self {
            Addend::None => None,
            Addend::Scaled(s, l) | Addend::Residual(s, l) => Some((s, l)),
        }
    }
}

impl<'a> Addend<'a, Storage> {
    /// The same seen as backend `B`'s (the device already checked).
    fn part<B: Backend>(self) -> Addend<'a, B> {
        match self {
            Addend::None => Addend::None,
            Addend::Scaled(s, l) => Addend::Scaled(B::part(s), l),
            Addend::Residual(s, l) => Addend::Residual(B::part(s), l),
        }
    }
}

/// The operands of [`NormOps::batch_norm_fused`].
pub(crate) struct FusedBn<'a, S> {
    /// The scale and shift: whole `[c]` storages in f32.
    pub weight: &'a S,
    pub bias: &'a S,
    /// Whole `[c]` f32 running mean and variance, updated in place as in
    /// [`BnSource::Batch`].
    pub running: Option<(&'a mut S, &'a mut S)>,
    /// A whole one-element i64 batch counter, counted once.
    pub tracked: Option<&'a mut S>,
    /// `z`, added before the ReLU: dense in x's format, x's dtype.
    pub residual: Option<(&'a S, &'a Layout)>,
    pub relu: bool,
    pub momentum: f64,
    pub eps: f64,
}

/// What [`NormOps::batch_norm_fused`] gives: the output (dense in x's format), what the
/// backward reads (the batch's mean and `1 / sqrt(var + eps)`, f32, laid out as the backend
/// chooses), and the library's reserve space (bytes; the fused ReLU's mask); the last two
/// are passed back to the backward unchanged.
pub(crate) struct FusedBnOut<S> {
    pub y: S,
    pub saved: S,
    pub reserve: S,
}

/// The operands of [`NormOps::batch_norm_fused_backward`]: the forward's input and, with a
/// ReLU, its output, the parameters and what [`FusedBnOut`] saved, and the same call.
pub(crate) struct FusedBnBack<'a, S> {
    pub x: (&'a S, &'a Layout),
    pub y: Option<(&'a S, &'a Layout)>,
    pub weight: &'a S,
    pub bias: &'a S,
    pub saved: &'a S,
    pub reserve: &'a S,
    pub residual: bool,
    pub relu: bool,
    pub eps: f64,
}

/// The gradients of [`NormOps::batch_norm_fused`]: the input's (dense in its format), the
/// scale's and shift's (f32 `[c]`), and the residual's with one.
pub(crate) struct FusedBnGrads<S> {
    pub dx: S,
    pub dweight: S,
    pub dbias: S,
    pub dz: Option<S>,
}

/// What [`NormOps::batch_norm_grad`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BnGrad {
    /// Training: the input's gradient takes in the batch statistics' own gradients; the
    /// parameters' gradients come with it.
    Train,
    /// Eval, with the parameters' gradients: `dx = a dy`, plus the sums.
    EvalWithParams,
    /// Eval, the input's gradient only: no pass over `dy` and `x`.
    EvalInputOnly,
}

/// `v`'s storage as backend `B`'s (the device already checked).
fn part<'a, B: Backend>(v: Opt<'a, Storage>) -> Opt<'a, B> {
    v.map(|(s, l)| (B::part(s), l))
}

impl Storage {
    /// See [`NormOps::batch_norm_stats`]: the running statistics and the batch counter are
    /// written in place, on `self`'s device.
    pub(crate) fn batch_norm_stats(
        &self,
        lx: &Layout,
        p: BnForward<'_, Storage>,
    ) -> Result<Storage> {
        let mut all = vec![self];
        all.extend(p.weight.map(|v| v.0));
        all.extend(p.bias.map(|v| v.0));
        match &p.source {
            BnSource::Batch {
                running,
                tracked,
                sums,
                ..
            } => {
                all.extend(running.iter().flat_map(|(m, v)| [&**m, &**v]));
                all.extend(tracked.as_deref());
                all.extend(*sums);
            }
            BnSource::Running(m, v) => all.extend([*m, *v]),
        }
        let device = super::common_device("batch_norm", &all)?;
        super::on_device!(device, B => {
            let source = match p.source {
                BnSource::Batch { running, tracked, momentum, sums } => BnSource::Batch {
                    running: running.map(|(m, v)| (B::part_mut(m), B::part_mut(v))),
                    tracked: tracked.map(B::part_mut),
                    momentum,
                    sums: sums.map(B::part),
                },
                BnSource::Running(m, v) => BnSource::Running(B::part(m), B::part(v)),
            };
            let p = BnForward {
                weight: part(p.weight),
                bias: part(p.bias),
                source,
                eps: p.eps,
            };
            Ok(B::part(self).batch_norm_stats(lx, p)?.wrap())
        })
    }

    /// See [`NormOps::batch_norm_fused`]: the running statistics and the batch counter are
    /// written in place, on `self`'s device.
    pub(crate) fn batch_norm_fused(
        &self,
        lx: &Layout,
        p: FusedBn<'_, Storage>,
    ) -> Result<Option<FusedBnOut<Storage>>> {
        let mut all = vec![self, p.weight, p.bias];
        all.extend(p.running.iter().flat_map(|(m, v)| [&**m, &**v]));
        all.extend(p.tracked.as_deref());
        all.extend(p.residual.map(|r| r.0));
        let device = super::common_device("batch_norm", &all)?;
        super::on_device!(device, B => {
            let p = FusedBn {
                weight: B::part(p.weight),
                bias: B::part(p.bias),
                running: p.running.map(|(m, v)| (B::part_mut(m), B::part_mut(v))),
                tracked: p.tracked.map(B::part_mut),
                residual: part(p.residual),
                relu: p.relu,
                momentum: p.momentum,
                eps: p.eps,
            };
            Ok(B::part(self).batch_norm_fused(lx, p)?.map(|o| FusedBnOut {
                y: o.y.wrap(),
                saved: o.saved.wrap(),
                reserve: o.reserve.wrap(),
            }))
        })
    }

    /// See [`NormOps::batch_norm_fused_backward`].
    pub(crate) fn batch_norm_fused_backward(
        &self,
        ld: &Layout,
        b: FusedBnBack<'_, Storage>,
    ) -> Result<FusedBnGrads<Storage>> {
        let mut all = vec![self, b.x.0, b.weight, b.bias, b.saved, b.reserve];
        all.extend(b.y.map(|y| y.0));
        let device = super::common_device("batch_norm backward", &all)?;
        super::on_device!(device, B => {
            let b = FusedBnBack {
                x: (B::part(b.x.0), b.x.1),
                y: part(b.y),
                weight: B::part(b.weight),
                bias: B::part(b.bias),
                saved: B::part(b.saved),
                reserve: B::part(b.reserve),
                residual: b.residual,
                relu: b.relu,
                eps: b.eps,
            };
            let g = B::part(self).batch_norm_fused_backward(ld, b)?;
            Ok(FusedBnGrads {
                dx: g.dx.wrap(),
                dweight: g.dweight.wrap(),
                dbias: g.dbias.wrap(),
                dz: g.dz.map(|z| z.wrap()),
            })
        })
    }

    /// See [`NormOps::batch_norm_grad`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn batch_norm_grad(
        &self,
        ld: &Layout,
        x: &Storage,
        lx: &Layout,
        stats: &Storage,
        ls: &Layout,
        mode: BnGrad,
        relu: FusedRelu<'_, Storage>,
    ) -> Result<BnGradOut<Storage>> {
        let mut all = vec![self, x, stats];
        all.extend(relu.operand());
        let device = super::common_device("batch_norm backward", &all)?;
        super::on_device!(device, B => {
            let relu = relu.part::<B>();
            let out = B::part(self)
                .batch_norm_grad(ld, B::part(x), lx, B::part(stats), ls, mode, relu)?;
            Ok(BnGradOut {
                coef: out.coef.wrap(),
                params: out.params.map(|(w, b)| (w.wrap(), b.wrap())),
                masked: out.masked.map(|m| m.wrap()),
            })
        })
    }

    /// See [`NormOps::channel_affine`].
    pub(crate) fn channel_affine(
        &self,
        lx: &Layout,
        add: Addend<'_, Storage>,
        coef: &Storage,
        lc: &Layout,
        relu: FusedRelu<'_, Storage>,
    ) -> Result<Storage> {
        let mut all = vec![self, coef];
        all.extend(add.operand().map(|d| d.0));
        all.extend(relu.operand());
        let device = super::common_device("batch_norm", &all)?;
        super::on_device!(device, B => {
            let (relu, add) = (relu.part::<B>(), add.part::<B>());
            Ok(B::part(self).channel_affine(lx, add, B::part(coef), lc, relu)?.wrap())
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

    /// See [`NormOps::add_layer_norm`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_layer_norm(
        &self,
        lx: &Layout,
        (r, lr): (&Storage, &Layout),
        cols: usize,
        w: Opt<Storage>,
        b: Opt<Storage>,
        eps: f64,
    ) -> Result<Option<(Storage, Storage, Storage)>> {
        let mut all = vec![self, r];
        all.extend(w.map(|v| v.0));
        all.extend(b.map(|v| v.0));
        let device = super::common_device("layer_norm (residual)", &all)?;
        super::on_device!(device, B => {
            let out = B::part(self).add_layer_norm(
                lx,
                (B::part(r), lr),
                cols,
                part(w),
                part(b),
                eps,
            )?;
            Ok(out.map(|(s, y, st)| (s.wrap(), y.wrap(), st.wrap())))
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
        want: LnWant,
    ) -> Result<LnGrads<Storage>> {
        let mut all = vec![self, x, stats];
        all.extend(w.map(|v| v.0));
        let device = super::common_device("layer_norm backward", &all)?;
        super::on_device!(device, B => {
            let (x, s) = (B::part(x), B::part(stats));
            let g = B::part(self).layer_norm_backward(ld, x, lx, cols, s, part(w), want)?;
            Ok(LnGrads {
                dx: g.dx.map(|d| d.wrap()),
                params: g.params.map(|(w, b)| (w.wrap(), b.wrap())),
            })
        })
    }
}
