//! Datasets and a multi-threaded [`DataLoader`].
//!
//! The loader allocates each batch's host buffers ([`HostBatch`]) and workers fill rows in
//! place. On the CPU the buffers move into the batch tensors without a copy. For a CUDA
//! device, `pin_memory` puts features and targets in pinned host memory, and
//! [`EpochIter::to_device`] uploads the next batches on a copy stream while the current one
//! is in use; the pinned blocks go back to their pool once their copies have run.

mod host;
mod loader;
pub mod mnist;
mod sample;

pub use host::{Batch, DeviceBatches, HostBatch, HostBuffer};
pub use loader::{DataLoader, DataLoaderConfig, EpochIter};
pub use sample::{SampleMut, TensorDataset};

use crate::{DType, Error, Result};

/// Random-access samples: features and targets of fixed shapes and dtypes.
///
/// The simple form is f32 features and an i64 class label: implement `len`, `sample_shape`
/// and [`Dataset::fill`]. Other shapes and dtypes (token ids, regression targets, a
/// sequence of labels) declare them with `feature_dtype`, `target_shape` and
/// `target_dtype` and implement [`Dataset::fill_sample`] instead.
///
/// ```
/// use mantissa::data::{Dataset, SampleMut};
/// use mantissa::{DType, Result};
/// /// Windows of 4 tokens and the 4 tokens that follow each.
/// struct Windows(Vec<i64>);
/// impl Dataset for Windows {
///     fn len(&self) -> usize { self.0.len() - 4 }
///     fn sample_shape(&self) -> Vec<usize> { vec![4] }
///     fn feature_dtype(&self) -> DType { DType::I64 }
///     fn target_shape(&self) -> Vec<usize> { vec![4] }
///     fn fill_sample(&self, i: usize, x: &mut SampleMut, y: &mut SampleMut) -> Result<()> {
///         x.as_mut::<i64>()?.copy_from_slice(&self.0[i..i + 4]);
///         y.as_mut::<i64>()?.copy_from_slice(&self.0[i + 1..i + 5]);
///         Ok(())
///     }
/// }
/// ```
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shape of one sample's features (e.g. `[1, 28, 28]`).
    fn sample_shape(&self) -> Vec<usize>;

    /// The features' dtype: f32 unless the dataset says otherwise.
    fn feature_dtype(&self) -> DType {
        DType::F32
    }

    /// Shape of one sample's targets: `[]` (a class label) unless the dataset says otherwise.
    fn target_shape(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The targets' dtype: i64 (class indices) unless the dataset says otherwise.
    fn target_dtype(&self) -> DType {
        DType::I64
    }

    /// Writes sample `index` into `x` (`sample_shape` elements) and returns its label: the
    /// simple form, for f32 features and an i64 label. A dataset that implements
    /// [`Dataset::fill_sample`] need not implement it.
    fn fill(&self, index: usize, x: &mut [f32]) -> Result<i64> {
        let _ = (index, x);
        Err(Error::invalid(
            "Dataset::fill",
            "this dataset implements neither fill nor fill_sample",
        ))
    }

    /// Writes sample `index`'s features into `x` and its targets into `y` (zeroed, of the
    /// declared shapes and dtypes). The default calls [`Dataset::fill`], for the simple
    /// form's dtypes and a one-element target.
    fn fill_sample(&self, index: usize, x: &mut SampleMut, y: &mut SampleMut) -> Result<()> {
        let label = self.fill(index, x.as_mut::<f32>()?)?;
        match y.as_mut::<i64>()? {
            [only] => *only = label,
            other => {
                return Err(Error::invalid(
                    "Dataset::fill_sample",
                    format!(
                        "fill gives one label; the targets have {} elements: implement \
                         fill_sample",
                        other.len()
                    ),
                ))
            }
        }
        Ok(())
    }
}
