//! Datasets and a multi-threaded [`DataLoader`].
//!
//! Buffer ownership is laid out for pinned host memory: the loader allocates each batch's
//! host buffers ([`HostBatch`]) and workers fill rows in place. On the CPU the buffers move
//! into the batch tensors without a copy; a device path copies from them (pinned, on a copy
//! stream) and hands them back for reuse.

mod loader;
pub mod mnist;

pub use loader::{Batch, DataLoader, DataLoaderConfig, EpochIter, HostBatch};

use crate::Result;

/// Random-access samples: an f32 feature array of a fixed shape and an i64 label.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shape of one sample's features (e.g. `[1, 28, 28]`).
    fn sample_shape(&self) -> Vec<usize>;

    /// Writes sample `index` into `x` (`sample_shape` elements) and returns its label.
    fn fill(&self, index: usize, x: &mut [f32]) -> Result<i64>;
}
