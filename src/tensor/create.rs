//! Creating tensors: constants, ranges, host data, random values; dtype and device moves.

use super::Tensor;
use crate::backend::cpu::CpuElem;
use crate::backend::Storage;
use crate::layout::{checked_bytes, checked_numel};
use crate::random::{default_stream, uniform_values, Generator};
use crate::{DType, Device, Error, Result};

impl Tensor {
    /// A tensor filled with `value` (rounded to `dtype`).
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let t = Tensor::full(&[2, 3], 1.5, DType::F16, Device::Cpu)?;
    /// assert_eq!(t.to_vec_f64()?, vec![1.5; 6]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let _prof = crate::profiler::op("full");
        let n = checked_numel("full", shape)?;
        checked_bytes("full", shape, n, dtype)?;
        Ok(Tensor::from_storage(
            Storage::full(device, value, n, dtype)?,
            shape,
        ))
    }

    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }

    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self.dtype(), self.device())
    }

    /// Ones with this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), self.dtype(), self.device())
    }

    /// `value` with this tensor's shape, dtype and device.
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(self.shape(), value, self.dtype(), self.device())
    }

    /// `start, start + step, ...` up to but excluding `end`.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let t = Tensor::arange(0.0, 5.0, 2.0, DType::I64, Device::Cpu)?;
    /// assert_eq!(t.to_vec::<i64>()?, vec![0, 2, 4]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "arange",
                format!("bad range start={start} end={end} step={step}"),
            ));
        }
        let count = ((end - start) / step).ceil().max(0.0);
        // Past isize::MAX the float-to-usize cast would saturate; such a range cannot exist.
        if count > isize::MAX as f64 {
            return Err(Error::invalid(
                "arange",
                format!("{count} elements in start={start} end={end} step={step}"),
            ));
        }
        let n = count as usize;
        checked_bytes("arange", &[n], n, dtype)?;
        let values = (0..n).map(|i| start + i as f64 * step);
        Ok(Tensor::from_storage(
            Storage::from_f64s(device, values, dtype)?,
            &[n],
        ))
    }

    /// A tensor of `shape` holding `data` (its element type gives the dtype).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// assert!(Tensor::from_vec(vec![1.0f32; 5], &[2, 3], Device::Cpu).is_err());
    /// ```
    pub fn from_vec<T: CpuElem>(data: Vec<T>, shape: &[usize], device: Device) -> Result<Tensor> {
        let numel = checked_numel("from_vec", shape)?;
        if data.len() != numel {
            return Err(Error::DataLength {
                op: "from_vec",
                len: data.len(),
                shape: shape.to_vec(),
                numel,
            });
        }
        let t = Tensor::from_storage(Storage::Cpu(T::wrap(data)), shape);
        match device.check_available()? {
            Device::Cpu => Ok(t),
            d => t.to_device(d),
        }
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: CpuElem>(data: &[T], shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A zero-dimensional tensor holding `value`.
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(&[], value, dtype, device)
    }

    /// Uniform values in `[lo, hi)` from `gen`.
    pub fn rand_with(
        shape: &[usize],
        lo: f64,
        hi: f64,
        dtype: DType,
        device: Device,
        gen: &mut Generator,
    ) -> Result<Tensor> {
        Tensor::rand_from(shape, lo, hi, dtype, device, |b| gen.stream(b))
    }

    /// [`Tensor::rand_with`] from the stream `draw(blocks)` gives, taken once the arguments
    /// are checked.
    fn rand_from(
        shape: &[usize],
        lo: f64,
        hi: f64,
        dtype: DType,
        device: Device,
        draw: impl FnOnce(u64) -> (u64, u64),
    ) -> Result<Tensor> {
        if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less)
            || !lo.is_finite()
            || !hi.is_finite()
        {
            return Err(Error::invalid("rand", format!("bad interval [{lo}, {hi})")));
        }
        let n = checked_numel("rand", shape)?;
        checked_bytes("rand", shape, n, dtype)?;
        // Two words a value, four a block (n is below 2^63: 2n fits).
        let stream = draw((2 * n as u64).div_ceil(4));
        let values = uniform_values(stream, n).map(|u| lo + (hi - lo) * u);
        Ok(Tensor::from_storage(
            Storage::from_f64s(device, values, dtype)?,
            shape,
        ))
    }

    /// Normal values with `mean` and `std` from `gen`.
    pub fn randn_with(
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        device: Device,
        gen: &mut Generator,
    ) -> Result<Tensor> {
        Tensor::randn_from(shape, mean, std, dtype, device, |b| Ok(gen.stream(b)))
    }

    /// [`Tensor::randn_with`] from the stream `draw(blocks)` gives, taken once the arguments
    /// are checked.
    pub(crate) fn randn_from(
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        device: Device,
        draw: impl FnOnce(u64) -> Result<(u64, u64)>,
    ) -> Result<Tensor> {
        if std.is_nan() || std < 0.0 || !mean.is_finite() || !std.is_finite() {
            return Err(Error::invalid(
                "randn",
                format!("bad mean {mean} / std {std}"),
            ));
        }
        let n = checked_numel("randn", shape)?;
        checked_bytes("randn", shape, n, dtype)?;
        if !dtype.is_float() {
            return Err(Error::DType {
                op: "randn",
                dtype,
                expected: "a float dtype",
            });
        }
        // Drawn where the tensor lives, a pair per block, as `gen.normal(n)` would draw them.
        let device = device.check_available()?;
        let stream = draw(n.div_ceil(2) as u64)?;
        let storage = Storage::normal(device, n, mean, std, stream, dtype)?;
        Ok(Tensor::from_storage(storage, shape))
    }

    /// U[0, 1) values from this thread's default generator (see [`crate::manual_seed`]).
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::rand_from(shape, 0.0, 1.0, dtype, device, default_stream)
    }

    /// N(0, 1) values from this thread's default generator (see [`crate::manual_seed`]).
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::randn_from(shape, 0.0, 1.0, dtype, device, |b| Ok(default_stream(b)))
    }

    /// This tensor converted to `dtype`. Differentiable between float dtypes: the gradient is
    /// cast back.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let _prof = crate::profiler::op("to_dtype");
        let src = self.dtype();
        let (s, l) = crate::memory_format::elementwise("to_dtype", [self.layout()], |[l]| {
            self.storage().to_dtype(l, dtype)
        })?;
        let out = Tensor::from_storage_in(s, l);
        if !dtype.is_float() {
            return Ok(out);
        }
        Ok(out.attach("to_dtype", &[self], move |g, _| {
            Ok(vec![Some(g.to_dtype(src)?)])
        }))
    }

    /// This tensor on `device` (a copy; differentiable).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let _prof = crate::profiler::op("to_device");
        let src = self.device();
        let s = self.storage().to_device(self.layout(), device)?;
        Ok(
            Tensor::from_storage(s, self.shape()).attach("to_device", &[self], move |g, _| {
                Ok(vec![Some(g.to_device(src)?)])
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::random::Generator;

    #[test]
    fn rand_is_the_generators_uniform_stream() {
        use crate::{DType, Device, Tensor};
        let n = 3 * crate::backend::cpu::CHUNK + 5;
        let (mut a, mut b) = (Generator::new(7), Generator::new(7));
        let t = Tensor::rand_with(&[n], -1.0, 3.0, DType::F64, Device::Cpu, &mut a).unwrap();
        let want: Vec<f64> = b.uniform(n).iter().map(|u| -1.0 + 4.0 * u).collect();
        assert_eq!(t.to_vec::<f64>().unwrap(), want);
        assert_eq!(a, b, "both generators moved past the same blocks");
    }

    #[test]
    fn randn_is_the_generators_normal_stream_drawn_in_parallel() {
        use crate::{DType, Device, Tensor};
        // Odd, and over several parallel chunks of the host kernel.
        let n = 3 * crate::backend::cpu::CHUNK + 5;
        let (mut a, mut b) = (Generator::new(9), Generator::new(9));
        a.uniform(3);
        b.uniform(3);
        let t = Tensor::randn_with(&[n], 0.5, 2.0, DType::F64, Device::Cpu, &mut a).unwrap();
        let want: Vec<f64> = b.normal(n).iter().map(|z| 0.5 + 2.0 * z).collect();
        assert_eq!(t.to_vec::<f64>().unwrap(), want);
        assert_eq!(a, b, "both generators moved past the same blocks");
        let t = Tensor::randn_with(&[n], 0.0, 1.0, DType::BF16, Device::Cpu, &mut a).unwrap();
        let want: Vec<f64> = b
            .normal(n)
            .iter()
            .map(|&z| half::bf16::from_f64(z).to_f64())
            .collect();
        assert_eq!(t.to_vec_f64().unwrap(), want);
        assert!(Tensor::randn_with(&[2], 0.0, 1.0, DType::I64, Device::Cpu, &mut a).is_err());
    }
}
