//! One sample's features or targets as a dataset writes them ([`SampleMut`]), and
//! [`TensorDataset`], the samples of two tensors.

use super::Dataset;
use crate::dtype::WithDType;
use crate::{DType, Device, Error, Result, Tensor};

/// The elements of one sample's features (or targets) that [`Dataset::fill_sample`] writes:
/// `len()` elements of the dataset's dtype, zeroed beforehand.
///
/// ```
/// use mantissa::data::SampleMut;
/// use mantissa::DType;
/// let mut bytes = [0u8; 8];
/// let mut s = SampleMut::new(&mut bytes, DType::I64)?;
/// s.as_mut::<i64>()?[0] = 7;
/// assert!(s.as_mut::<f32>().is_err());
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct SampleMut<'a> {
    bytes: &'a mut [u8],
    dtype: DType,
}

impl<'a> SampleMut<'a> {
    /// A view of `bytes` as elements of `dtype` (a whole number of them).
    pub fn new(bytes: &'a mut [u8], dtype: DType) -> Result<SampleMut<'a>> {
        if !bytes.len().is_multiple_of(dtype.size_in_bytes()) {
            return Err(Error::invalid(
                "SampleMut::new",
                format!("{} bytes are not whole {dtype:?} elements", bytes.len()),
            ));
        }
        Ok(SampleMut { bytes, dtype })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_in_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The elements as `T`, which must be the sample's dtype.
    pub fn as_mut<T: WithDType + bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "SampleMut::as_mut",
                lhs: self.dtype,
                rhs: T::DTYPE,
            });
        }
        bytemuck::try_cast_slice_mut(self.bytes).map_err(|e| {
            Error::invalid(
                "SampleMut::as_mut",
                format!("{:?} elements: {e}", self.dtype),
            )
        })
    }

    /// The raw bytes (the elements in the host's order).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

/// Samples from two tensors of any dtypes with the same first dimension, as PyTorch's
/// `TensorDataset`: sample `i` is row `i` of the features and row `i` of the targets. The
/// rows are kept on the host (the loader moves batches to the device).
///
/// ```
/// use mantissa::data::{DataLoader, DataLoaderConfig, TensorDataset};
/// use mantissa::{Device, Tensor};
/// use std::sync::Arc;
/// let tokens = Tensor::from_vec((0..12i64).collect(), &[4, 3], Device::Cpu)?;
/// let next = Tensor::from_vec((1..13i64).collect(), &[4, 3], Device::Cpu)?;
/// let ds = TensorDataset::new(&tokens, &next)?;
/// let mut dl = DataLoader::new(Arc::new(ds), DataLoaderConfig::new(2))?;
/// let b = dl.epoch(0).next().unwrap()?;
/// assert_eq!((b.x.shape(), b.y.shape()), (&[2, 3][..], &[2, 3][..]));
/// assert_eq!(b.y.to_vec::<i64>()?, vec![1, 2, 3, 4, 5, 6]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct TensorDataset {
    x: Rows,
    y: Rows,
}

/// A tensor's rows as host bytes.
struct Rows {
    n: usize,
    bytes: Vec<u8>,
    row: usize,
    shape: Vec<usize>,
    dtype: DType,
}

impl Rows {
    fn new(t: &Tensor) -> Result<Rows> {
        let bytes = t.to_device(Device::Cpu)?.to_le_bytes()?;
        let n = t.shape()[0];
        Ok(Rows {
            n,
            row: bytes.len().checked_div(n).unwrap_or(0),
            bytes,
            shape: t.shape()[1..].to_vec(),
            dtype: t.dtype(),
        })
    }

    fn write(&self, i: usize, out: &mut SampleMut) -> Result<()> {
        let src = &self.bytes[i * self.row..(i + 1) * self.row];
        let dst = out.as_bytes_mut();
        if dst.len() != src.len() {
            return Err(Error::invalid(
                "TensorDataset",
                format!("a sample of {} bytes into {}", src.len(), dst.len()),
            ));
        }
        dst.copy_from_slice(src);
        Ok(())
    }
}

impl TensorDataset {
    /// The samples of `features` and `targets` (at least one dimension each, the first the
    /// same), copied to the host.
    pub fn new(features: &Tensor, targets: &Tensor) -> Result<TensorDataset> {
        let (fx, fy) = (features.shape(), targets.shape());
        if fx.is_empty() || fy.is_empty() || fx[0] != fy[0] {
            return Err(Error::invalid(
                "TensorDataset::new",
                format!(
                    "features {fx:?} and targets {fy:?} need a first dimension, the same in both"
                ),
            ));
        }
        Ok(TensorDataset {
            x: Rows::new(features)?,
            y: Rows::new(targets)?,
        })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.x.n
    }
    fn sample_shape(&self) -> Vec<usize> {
        self.x.shape.clone()
    }
    fn feature_dtype(&self) -> DType {
        self.x.dtype
    }
    fn target_shape(&self) -> Vec<usize> {
        self.y.shape.clone()
    }
    fn target_dtype(&self) -> DType {
        self.y.dtype
    }
    fn fill_sample(&self, index: usize, x: &mut SampleMut, y: &mut SampleMut) -> Result<()> {
        if index >= self.len() {
            return Err(Error::invalid(
                "TensorDataset",
                format!("sample {index} of {}", self.len()),
            ));
        }
        self.x.write(index, x)?;
        self.y.write(index, y)
    }
}
