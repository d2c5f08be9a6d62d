//! The gradient scaler's device work: the [`AmpOps`] family and its dispatch.

use super::spec::{check_disjoint, check_within};
use super::{on_backend, Backend, BackendStorage, Span, Storage};
use crate::{DType, Result};
use std::ops::Range;

/// PyTorch's two AMP kernels, on f32 scalar storages of the backend. The gradients are
/// [`Span`]s: each walked over its range of its storage, in storage order (a range of a larger
/// storage, such as a data-parallel bucket, is walked where it lies).
pub(crate) trait AmpOps: BackendStorage {
    /// `_amp_foreach_non_finite_check_and_unscale_`: every element of each gradient times
    /// `inv_scale`, stored as `out` (the gradient's dtype or f32) in the same order, one new
    /// storage of the range's length per gradient; `found_inf` becomes 1 when an element is
    /// inf or NaN and is left as it is otherwise.
    fn unscale_grads(
        grads: &[Span<'_, Self>],
        inv_scale: &Self,
        found_inf: &mut Self,
        out: DType,
    ) -> Result<Vec<Self>>;
    /// [`AmpOps::unscale_grads`] in place: each `(k, range)` of `ranges` is a gradient, elements
    /// `range` of `grads[k]`, multiplied by `inv_scale` in its own dtype and written over
    /// itself. The dispatch has checked that the ranges lie within their storages and do not
    /// overlap.
    fn unscale_grads_(
        grads: &mut [&mut Self],
        ranges: &[(usize, Range<usize>)],
        inv_scale: &Self,
        found_inf: &mut Self,
    ) -> Result<()>;
    /// The sum of the squares of every element of every gradient, accumulated in f32 or
    /// wider: a one-element f32 storage (gradient clipping's total, PyTorch's
    /// `_foreach_norm`). Needs at least one gradient.
    fn sum_squares(grads: &[Span<'_, Self>]) -> Result<Self>;
    /// `_amp_update_scale_` (`self` is the scale): back off after an overflow, else grow
    /// every `interval` clean steps while finite.
    fn update_scale(
        &mut self,
        tracker: &mut Self,
        found_inf: &Self,
        growth: f32,
        backoff: f32,
        interval: i32,
    ) -> Result<()>;
}

impl Storage {
    /// See [`AmpOps::unscale_grads`]: one pass, and no host read on CUDA.
    pub(crate) fn unscale_grads(
        grads: &[Span<'_, Storage>],
        inv_scale: &Storage,
        found_inf: &mut Storage,
        out: DType,
    ) -> Result<Vec<Storage>> {
        const OP: &str = "GradScaler::unscale_";
        for g in grads {
            check_within(OP, &g.range, g.storage.len())?;
        }
        let mut all: Vec<&Storage> = grads.iter().map(|g| g.storage).collect();
        all.extend([inv_scale, &*found_inf]);
        let device = super::common_device(OP, &all)?;
        super::on_device!(device, B => {
            let parts: Vec<Span<'_, B>> = grads.iter().map(|g| g.map(B::part)).collect();
            let f = B::part_mut(found_inf);
            let outs = B::unscale_grads(&parts, B::part(inv_scale), f, out)?;
            Ok(outs.into_iter().map(|s| s.wrap()).collect())
        })
    }

    /// See [`AmpOps::unscale_grads_`]: one pass, and no host read on CUDA. Each range must
    /// lie within its storage, and the ranges on one storage must not overlap (each element
    /// is scaled once).
    pub(crate) fn unscale_grads_(
        grads: &mut [&mut Storage],
        ranges: &[(usize, Range<usize>)],
        inv_scale: &Storage,
        found_inf: &mut Storage,
    ) -> Result<()> {
        const OP: &str = "GradScaler::unscale_";
        for (k, r) in ranges {
            let Some(g) = grads.get(*k) else {
                return Err(crate::Error::invalid(
                    OP,
                    format!("a range names storage {k} of {}", grads.len()),
                ));
            };
            check_within(OP, r, g.len())?;
        }
        check_disjoint(OP, ranges)?;
        let mut all: Vec<&Storage> = grads.iter().map(|g| &**g).collect();
        all.extend([inv_scale, &*found_inf]);
        let device = super::common_device(OP, &all)?;
        super::on_device!(device, B => {
            let mut parts: Vec<&mut B> = grads.iter_mut().map(|g| B::part_mut(g)).collect();
            B::unscale_grads_(&mut parts, ranges, B::part(inv_scale), B::part_mut(found_inf))
        })
    }

    /// See [`AmpOps::sum_squares`]: no host read on CUDA.
    pub(crate) fn sum_squares(grads: &[Span<'_, Storage>]) -> Result<Storage> {
        const OP: &str = "clip_grad_norm";
        if grads.is_empty() {
            return Err(crate::Error::invalid(OP, "no gradients to sum"));
        }
        for g in grads {
            check_within(OP, &g.range, g.storage.len())?;
        }
        let all: Vec<&Storage> = grads.iter().map(|g| g.storage).collect();
        let device = super::common_device(OP, &all)?;
        super::on_device!(device, B => {
            let parts: Vec<Span<'_, B>> = grads.iter().map(|g| g.map(B::part)).collect();
            Ok(B::sum_squares(&parts)?.wrap())
        })
    }

    /// See [`AmpOps::update_scale`].
    pub(crate) fn update_scale(
        &mut self,
        tracker: &mut Storage,
        found_inf: &Storage,
        growth: f64,
        backoff: f64,
        interval: usize,
    ) -> Result<()> {
        let interval = i32::try_from(interval).unwrap_or(i32::MAX);
        let (growth, backoff) = (growth as f32, backoff as f32);
        on_backend!("GradScaler::update", [self, tracker, found_inf], B => {
            B::part_mut(self).update_scale(
                B::part_mut(tracker),
                B::part(found_inf),
                growth,
                backoff,
                interval,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{CpuStorage, IntoStorage};

    fn f32s(s: &Storage) -> Vec<f32> {
        match s {
            Storage::Cpu(CpuStorage::F32(v)) => v.clone(),
            _ => unreachable!("an f32 CPU storage"),
        }
    }

    fn scalar(v: f32) -> Storage {
        Storage::Cpu(vec![v].into_storage())
    }

    /// Ten values with an inf at element 9, outside the ranges the passes are given.
    fn bucket() -> Storage {
        let mut v: Vec<f32> = (0..10).map(|i| i as f32).collect();
        v[9] = f32::INFINITY;
        Storage::Cpu(v.into_storage())
    }

    #[test]
    fn multi_tensor_passes_walk_ranges_of_a_storage() {
        let b = bucket();
        let spans = [
            Span {
                storage: &b,
                range: 2..5,
            },
            Span {
                storage: &b,
                range: 6..9,
            },
        ];
        // Only the ranges: 2² + 3² + 4² + 6² + 7² + 8², and the inf beyond them unseen.
        let total = Storage::sum_squares(&spans).unwrap();
        assert_eq!(f32s(&total), vec![178.0]);
        let (inv, mut found) = (scalar(0.5), scalar(0.0));
        let outs = Storage::unscale_grads(&spans, &inv, &mut found, DType::F32).unwrap();
        let outs: Vec<Vec<f32>> = outs.iter().map(f32s).collect();
        assert_eq!(outs, vec![vec![1.0, 1.5, 2.0], vec![3.0, 3.5, 4.0]]);
        assert_eq!(f32s(&found), vec![0.0]);
        // In place: two ranges of one storage and the whole of another; the rest unchanged.
        let (mut b, mut other) = (bucket(), Storage::Cpu(vec![8.0f32; 2].into_storage()));
        let ranges = [(0, 2..5), (1, 0..2), (0, 6..9)];
        let mut grads = [&mut b, &mut other];
        Storage::unscale_grads_(&mut grads, &ranges, &inv, &mut found).unwrap();
        let mut want: Vec<f32> = (0..10).map(|i| i as f32).collect();
        for i in [2, 3, 4, 6, 7, 8] {
            want[i] *= 0.5;
        }
        want[9] = f32::INFINITY;
        assert_eq!((f32s(&b), f32s(&other)), (want, vec![4.0; 2]));
        assert_eq!(f32s(&found), vec![0.0]);
        // A range that takes the inf sets the flag.
        let mut grads = [&mut b];
        Storage::unscale_grads_(&mut grads, &[(0, 8..10)], &inv, &mut found).unwrap();
        assert_eq!(f32s(&found), vec![1.0]);
    }

    #[test]
    fn ranges_outside_their_storage_or_written_twice_are_refused() {
        let b = bucket();
        let (inv, mut found) = (scalar(0.5), scalar(0.0));
        let past = [Span {
            storage: &b,
            range: 8..11,
        }];
        let e = Storage::sum_squares(&past).unwrap_err().to_string();
        assert!(e.contains("clip_grad_norm") && e.contains("8..11"), "{e}");
        let e = Storage::unscale_grads(&past, &inv, &mut found, DType::F32).unwrap_err();
        assert!(e.to_string().contains("outside a storage of 10"), "{e}");
        let mut b = bucket();
        for ranges in [vec![(0, 2..5), (0, 4..6)], vec![(0, 3..4), (0, 0..9)]] {
            let mut grads = [&mut b];
            let e = Storage::unscale_grads_(&mut grads, &ranges, &inv, &mut found).unwrap_err();
            assert!(e.to_string().contains("overlap"), "{ranges:?}: {e}");
        }
        let mut grads = [&mut b];
        let e = Storage::unscale_grads_(&mut grads, &[(1, 0..1)], &inv, &mut found).unwrap_err();
        assert!(e.to_string().contains("storage 1 of 1"), "{e}");
        // Nothing was written by the refused calls.
        assert_eq!(
            f32s(&b)[..9],
            (0..9).map(|i| i as f32).collect::<Vec<_>>()[..]
        );
    }
}
