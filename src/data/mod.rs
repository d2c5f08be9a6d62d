//! Datasets and a multi-threaded [`DataLoader`].
//!
//! The loader allocates each batch's host buffers ([`HostBatch`]) and workers fill rows in
//! place. On the CPU the buffers move into the batch tensors without a copy. For a CUDA
//! device, `pin_memory` puts the features in pinned host memory, and
//! [`EpochIter::to_device`] uploads the next batches on a copy stream while the current one
//! is in use; the pinned blocks go back to their pool once their copies have run.

mod host;
mod loader;
pub mod mnist;

pub use host::{Batch, DeviceBatches, HostBatch, HostBuffer};
pub use loader::{DataLoader, DataLoaderConfig, EpochIter};

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
