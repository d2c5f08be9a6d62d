//! Two independent parts of one op's backward (the two products of a matmul's gradient) run
//! side by side on the CPU, each with its share of the compute pool.
//!
//! On small-batch training shapes one product split across all threads pays a wake-up and a
//! join per product and runs on narrow tiles; two products side by side, each on half the
//! threads, do neither. The two gradient products of a 128 x 512 x 512 linear layer took
//! 475 us side by side on two threads against 525 us one after the other, each split in two.

use crate::parallel::{threads, ShareGuard};

/// Runs `a` and `b` and returns both results: side by side, each on half of this thread's
/// share of the pool, when `on_cpu` and this thread is in a backward pass (graph recording
/// and autocast off, as the autograd engine sets them); one after the other otherwise.
///
/// The side that another pool thread picks up runs with graph recording and autocast off,
/// as on the calling thread, whatever that thread was doing before.
pub(crate) fn join_backward<RA: Send, RB: Send>(
    on_cpu: bool,
    a: impl FnOnce() -> RA + Send,
    b: impl FnOnce() -> RB + Send,
) -> (RA, RB) {
    let share = threads();
    if !on_cpu || share < 2 || crate::is_grad_enabled() || crate::amp::active_dtype().is_some() {
        return (a(), b());
    }
    let half = share / 2;
    // The calling thread runs other tasks while it waits for the second side.
    let _iso = crate::parallel::Isolated::new();
    rayon::join(|| side(half, a), || side(half, b))
}

/// Runs `f` as one side of [`join_backward`]: recording and autocast off, `share` threads.
fn side<R>(share: usize, f: impl FnOnce() -> R) -> R {
    let _ng = crate::NoGradGuard::new();
    let _ac = crate::amp::autocast_disabled();
    let _share = ShareGuard::new(share);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a side sees: graph recording, autocast, its thread share.
    fn probe() -> (bool, Option<crate::DType>, usize) {
        // Long enough for the other pool thread to pick up the second side.
        std::thread::sleep(std::time::Duration::from_millis(20));
        (
            crate::is_grad_enabled(),
            crate::amp::active_dtype(),
            threads(),
        )
    }

    #[test]
    fn sides_run_as_a_backward_on_half_the_share() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        pool.install(|| {
            let _ng = crate::NoGradGuard::new();
            let _ac = crate::amp::autocast_disabled();
            assert_eq!(threads(), 4);
            let (a, b) = join_backward(true, probe, probe);
            assert_eq!(a, (false, None, 2));
            assert_eq!(b, (false, None, 2));
            // Nested: a quarter each; the share is restored afterwards.
            let (a, _) = join_backward(true, || join_backward(true, probe, probe).0, probe);
            assert_eq!(a, (false, None, 1));
            assert_eq!(threads(), 4);
            // Not on the CPU: one after the other, each with the whole share.
            assert_eq!(join_backward(false, probe, probe).1, (false, None, 4));
        });
        // Outside a backward (recording on): one after the other, state untouched.
        pool.install(|| {
            assert_eq!(join_backward(true, probe, probe).1, (true, None, 4));
            let _ac = crate::amp::autocast(crate::DType::BF16).unwrap();
            let _ng = crate::NoGradGuard::new();
            let got = join_backward(true, probe, probe).1;
            assert_eq!(got, (false, Some(crate::DType::BF16), 4));
        });
    }
}
