//! The batch-size finder: the largest batch whose training step fits in a device's memory,
//! found by trying steps (doubling until out of memory comes back as an `Err`, then
//! bisecting back), the allocator's cache emptied before each try.

use super::classify::autocast_maybe;
use crate::nn::{Module, TensorKind};
use crate::optim::Optimizer;
use crate::{memory, no_grad, DType, Device, Error, Result, Tensor};

/// Where [`find_batch_size`] starts and how far it may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSizeSearch {
    /// The first size tried (it must fit).
    pub start: usize,
    /// The largest size worth trying (the dataset's length, say).
    pub max: usize,
}

/// The sizes [`find_batch_size`] tried and what came of them, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchSizeTrials {
    /// The largest size that fitted.
    pub size: usize,
    /// Every size tried, with whether it fitted.
    pub tried: Vec<(usize, bool)>,
}

/// Finds the largest batch size, between `search.start` and `search.max`, for which
/// `trial(size)` succeeds on `device`: sizes double from `start` until a trial returns
/// [`Error::OutOfMemory`] or another size refusal ([`Error::is_size_limit`]: a size past
/// what the device's libraries take) (or `max` fits), then the largest fitting size below
/// the first failing one is bisected. The allocator's cache is emptied before every trial, so each
/// starts from the memory the caller holds. Any other error is returned as it is.
///
/// `trial` should do what a training step does and leave no trace: [`classifier_fits`] does
/// so for a classifier. The CPU has no memory limit to find (its allocations do not fail
/// as a GPU's do), so the CPU is an error.
///
/// ```
/// use mantissa::train::{find_batch_size, BatchSizeSearch};
/// use mantissa::{memory, Device, DType, Tensor};
/// if let Ok(d) = Device::cuda(0) {
///     let search = BatchSizeSearch { start: 8, max: 1 << 20 };
///     let found = find_batch_size(d, search, |b| {
///         Tensor::zeros(&[b, 1 << 20], DType::F32, d).map(drop)
///     })?;
///     println!("{} x 4 MiB fit", found.size);
/// }
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn find_batch_size(
    device: Device,
    search: BatchSizeSearch,
    mut trial: impl FnMut(usize) -> Result<()>,
) -> Result<BatchSizeTrials> {
    if device == Device::Cpu {
        return Err(Error::invalid(
            "find_batch_size",
            "the CPU's allocations do not fail at a memory limit: give the batch size",
        ));
    }
    if search.start == 0 || search.start > search.max {
        return Err(Error::invalid(
            "find_batch_size",
            format!(
                "start {} must be at least 1 and at most max {}",
                search.start, search.max
            ),
        ));
    }
    let mut out = BatchSizeTrials::default();
    let mut attempt = |size: usize, out: &mut BatchSizeTrials| -> Result<bool> {
        memory::empty_cache(device)?;
        let fits = match trial(size) {
            Ok(()) => true,
            // Out of memory, or a size the device cannot run (past a library's limits):
            // the ceiling either way.
            Err(e) if e.is_size_limit() => false,
            Err(e) => return Err(e),
        };
        out.tried.push((size, fits));
        Ok(fits)
    };
    // Doubling: `good` fits, `bad` (once found) does not.
    let mut size = search.start;
    let mut bad = None;
    loop {
        if !attempt(size, &mut out)? {
            bad = Some(size);
            break;
        }
        out.size = size;
        if size == search.max {
            break;
        }
        size = size.saturating_mul(2).min(search.max);
    }
    if out.size == 0 {
        memory::empty_cache(device)?;
        return Err(Error::invalid(
            "find_batch_size",
            format!(
                "a batch of {} does not fit on {device} ({})",
                search.start,
                memory::memory_stats(device)?
            ),
        ));
    }
    // Bisection between the largest size that fitted and the smallest that did not.
    if let Some(mut bad) = bad {
        while bad - out.size > 1 {
            let mid = out.size + (bad - out.size) / 2;
            if attempt(mid, &mut out)? {
                out.size = mid;
            } else {
                bad = mid;
            }
        }
    }
    memory::empty_cache(device)?;
    Ok(out)
}

/// One training step of a classifier on `(x, y)` that leaves no trace, for
/// [`find_batch_size`]: [`step_fits`] with the mean cross-entropy of `net(x)` against `y`.
pub fn classifier_fits(
    net: &dyn Module,
    opt: &mut dyn Optimizer,
    low: Option<DType>,
    x: &Tensor,
    y: &Tensor,
) -> Result<()> {
    step_fits(net, opt, low, || {
        net.forward(x)?.cross_entropy(y, Default::default())
    })
}

/// One training step that leaves no trace, for [`find_batch_size`]: `loss()` (the forward
/// pass, run under autocast to `low`), backward, and an optimizer step that is skipped (its
/// overflow flag set) but creates the optimizer's state as a first real step would, so the
/// memory counted is a step's. Buffers (batch-norm statistics) and generator states (dropout
/// streams, SGLD's) are restored afterwards, and the gradients dropped, so the run that
/// follows starts as if no trial had been made.
pub fn step_fits(
    net: &dyn Module,
    opt: &mut dyn Optimizer,
    low: Option<DType>,
    loss: impl FnOnce() -> Result<Tensor>,
) -> Result<()> {
    let mut kept = Vec::new();
    net.visit("", &mut |_, t, k| {
        if k != TensorKind::Parameter {
            kept.push(t.clone());
        }
    });
    let saved = no_grad(|| kept.iter().map(|t| t.copy()).collect::<Result<Vec<_>>>())?;
    let generator = opt.generator();
    let step = (|| {
        let loss = autocast_maybe(low, loss)?;
        loss.backward()?;
        let skip = Tensor::ones(&[], DType::F32, loss.device())?;
        opt.step_unless(Some(&skip))
    })();
    opt.zero_grad();
    if let Some(g) = generator {
        opt.set_generator(g);
    }
    no_grad(|| -> Result<()> {
        for (t, s) in kept.iter().zip(&saved) {
            t.copy_(s)?;
        }
        Ok(())
    })?;
    step
}
