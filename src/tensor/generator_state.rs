//! A generator's state as a tensor, the form modules and checkpoints keep it in.

use super::Tensor;
use crate::backend::cpu::CpuStorage;
use crate::backend::Storage;
use crate::{DType, Error, Generator, Result};

impl Generator {
    /// The state as a CPU tensor of two i64 (the bits of seed and offset), the form
    /// checkpoints store it in; [`Generator::from_tensor`] reads it back.
    ///
    /// ```
    /// use mantissa::Generator;
    /// let mut g = Generator::new(3);
    /// g.uniform(10);
    /// let saved = g.to_tensor()?;
    /// let mut back = Generator::from_tensor(&saved)?;
    /// assert_eq!(back.uniform(4), g.uniform(4));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn to_tensor(&self) -> Result<Tensor> {
        Ok(self.state_tensor())
    }

    /// [`Generator::to_tensor`], which cannot fail: a two-element host tensor.
    pub(crate) fn state_tensor(&self) -> Tensor {
        let words = vec![self.seed() as i64, self.offset() as i64];
        let storage = CpuStorage::I64(words);
        Tensor::from_storage(Storage::Cpu(storage), &[2])
    }

    /// A generator from a state written by [`Generator::to_tensor`]: two i64 elements, on
    /// any device.
    pub fn from_tensor(t: &Tensor) -> Result<Generator> {
        if t.dtype() != DType::I64 || t.shape() != [2] {
            return Err(Error::invalid(
                "Generator::from_tensor",
                format!(
                    "a generator state is an i64 tensor of shape [2] (seed, offset), got {:?} {:?}",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        // A state on the host (where modules keep theirs) is read in place: drawing from a
        // module's generator is no transfer.
        if let Storage::Cpu(CpuStorage::I64(v)) = &*t.storage() {
            let (o, s) = (t.layout().offset(), t.strides()[0]);
            return Ok(Generator::at(v[o] as u64, v[o + s] as u64));
        }
        let v = t.to_vec::<i64>()?;
        Ok(Generator::at(v[0] as u64, v[1] as u64))
    }
}

/// The `(seed, first block)` of `blocks` blocks of the generator whose state the tensor
/// `state` holds (two i64 on the host, as modules keep it), advanced past them; an open CUDA
/// graph capture is told, so that each replay advances the state too.
pub(crate) fn state_stream(state: &Tensor, blocks: u64) -> Result<(u64, u64)> {
    let mut gen = Generator::from_tensor(state)?;
    let (seed, start) = gen.stream(blocks);
    crate::no_grad(|| state.copy_(&gen.state_tensor()))?;
    crate::capture::draw(|| Box::new(StateTensor(state.clone())), seed, start);
    Ok((seed, start))
}

/// A generator state kept as a tensor, for a CUDA graph's replay to read and advance.
struct StateTensor(Tensor);

impl crate::capture::GenState for StateTensor {
    fn state(&self) -> Result<(u64, u64)> {
        let g = Generator::from_tensor(&self.0)?;
        Ok((g.seed(), g.offset()))
    }

    fn set_state(&self, (seed, offset): (u64, u64)) -> Result<()> {
        crate::no_grad(|| self.0.copy_(&Generator::at(seed, offset).state_tensor()))
    }

    fn key(&self) -> usize {
        self.0.storage_addr()
    }
}
