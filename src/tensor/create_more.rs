//! More creation functions as PyTorch names them: `eye`, `linspace`, `randint`. Values are
//! made on the host and uploaded as [`Tensor::arange`]'s are.

use crate::backend::Storage;
use crate::layout::{checked_bytes, checked_numel};
use crate::random::uniform_values;
use crate::{DType, Device, Error, Generator, Result, Tensor};

impl Tensor {
    /// The `n x m` identity: ones on the diagonal (PyTorch's `eye(n, m)`).
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let i = Tensor::eye(2, 3, DType::F32, Device::Cpu)?;
    /// assert_eq!(i.to_vec::<f32>()?, vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn eye(n: usize, m: usize, dtype: DType, device: Device) -> Result<Tensor> {
        let count = checked_numel("eye", &[n, m])?;
        checked_bytes("eye", &[n, m], count, dtype)?;
        let values = (0..count).map(|i| f64::from(u8::from(i / m.max(1) == i % m.max(1))));
        Ok(Tensor::from_storage(
            Storage::from_f64s(device, values, dtype)?,
            &[n, m],
        ))
    }

    /// `steps` values evenly spaced from `start` to `end`, both included (PyTorch's
    /// `linspace`, computed as it does: the first half from `start`, the second from `end`,
    /// so both ends are exact).
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let t = Tensor::linspace(0.0, 1.0, 5, DType::F32, Device::Cpu)?;
    /// assert_eq!(t.to_vec::<f32>()?, vec![0.0, 0.25, 0.5, 0.75, 1.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn linspace(
        start: f64,
        end: f64,
        steps: usize,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        if !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "linspace",
                format!("bounds must be finite, got {start} and {end}"),
            ));
        }
        checked_bytes(
            "linspace",
            &[steps],
            checked_numel("linspace", &[steps])?,
            dtype,
        )?;
        let step = (end - start) / (steps.max(2) - 1) as f64;
        let half = steps / 2;
        let values = (0..steps).map(move |i| match i < half || steps == 1 {
            true => start + i as f64 * step,
            false => end - (steps - 1 - i) as f64 * step,
        });
        Ok(Tensor::from_storage(
            Storage::from_f64s(device, values, dtype)?,
            &[steps],
        ))
    }

    /// Integers drawn uniformly from `low..high` by `gen`, as `dtype` (PyTorch's `randint`;
    /// I64 for indices, or a float dtype that holds them).
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device, Generator};
    /// let t = Tensor::randint(-2, 3, &[100], DType::I64, Device::Cpu, &mut Generator::new(0))?;
    /// assert!(t.to_vec::<i64>()?.iter().all(|v| (-2..3).contains(v)));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn randint(
        low: i64,
        high: i64,
        shape: &[usize],
        dtype: DType,
        device: Device,
        gen: &mut Generator,
    ) -> Result<Tensor> {
        // Values are made in f64: exact below 2^53.
        const EXACT: i64 = 1 << 53;
        let span = high.checked_sub(low).filter(|&s| s > 0);
        let Some(span) = span.filter(|_| low.abs() <= EXACT && high.abs() <= EXACT) else {
            return Err(Error::invalid(
                "randint",
                format!("needs low < high within +-2^53, got {low}..{high}"),
            ));
        };
        if dtype == DType::U8 && (low < 0 || high > 256) {
            return Err(Error::invalid(
                "randint",
                format!("{low}..{high} does not fit U8"),
            ));
        }
        let n = checked_numel("randint", shape)?;
        checked_bytes("randint", shape, n, dtype)?;
        let stream = gen.stream((2 * n as u64).div_ceil(4));
        let values = uniform_values(stream, n)
            .map(|u| (low as f64 + (u * span as f64).floor()).min((high - 1) as f64));
        Ok(Tensor::from_storage(
            Storage::from_f64s(device, values, dtype)?,
            shape,
        ))
    }
}
