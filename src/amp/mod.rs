//! Automatic mixed precision: the autocast region and the loss scaler ([`GradScaler`]).
//!
//! Inside [`autocast`] every op applies its [`CastPolicy`](crate::ops::CastPolicy) from the
//! policy table in `ops/mod.rs` at the one dispatch point: GEMM-like ops run in the region's
//! low dtype (f16 or bf16), numerically sensitive ops in f32, mixed inputs in the widest
//! dtype. Only floating, non-f64 inputs are cast. The state is per thread and nests; the
//! guard restores the previous state when dropped, on every exit path.
//!
//! ```
//! use mantissa::{amp, Tensor, DType, Device};
//! let x = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
//! let w = Tensor::ones(&[4, 3], DType::F32, Device::Cpu)?;
//! let y = amp::with_autocast(DType::BF16, || x.linear(&w, None))??;
//! assert_eq!(y.dtype(), DType::BF16);
//! assert_eq!(amp::with_autocast(DType::BF16, || y.softmax(1))??.dtype(), DType::F32);
//! # Ok::<(), mantissa::Error>(())
//! ```

pub(crate) mod cache;
mod scaler;

pub use cache::cached_casts;
pub use scaler::{GradScaler, GradScalerConfig};

use crate::autocast_state::State;
use crate::scope::ScopeEntry;
use crate::{DType, Device, Error, Result};

/// Keeps an autocast region (or an [`autocast_disabled`] hole in one) open until dropped.
///
/// Regions nest and their guards may be dropped in any order: the newest live guard's state
/// is in force, autocast is off once all of them are gone, and the weight-cast cache is
/// cleared then. A guard is not `Send`: it belongs to the thread whose state it changed.
///
/// ```
/// use mantissa::{amp, DType};
/// let outer = amp::autocast(DType::F16)?;
/// let inner = amp::autocast(DType::BF16)?;
/// drop(outer);
/// assert_eq!(amp::active_dtype(), Some(DType::BF16));
/// drop(inner);
/// assert_eq!(amp::active_dtype(), None);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[must_use = "autocast lasts as long as the guard"]
pub struct AutocastGuard {
    entry: ScopeEntry<State>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        crate::autocast_state::leave(&self.entry);
        // The weight casts live as long as some region is open on the thread.
        if crate::autocast_state::outside_regions() {
            cache::clear();
        }
    }
}

fn enter(enabled: bool, dtype: DType) -> AutocastGuard {
    AutocastGuard {
        entry: crate::autocast_state::enter(State { enabled, dtype }),
    }
}

/// Opens an autocast region running GEMM-like ops in `dtype` (F16 or BF16).
pub fn autocast(dtype: DType) -> Result<AutocastGuard> {
    if !dtype.is_half() {
        return Err(Error::DType {
            op: "autocast",
            dtype,
            expected: "F16 or BF16",
        });
    }
    Ok(enter(true, dtype))
}

/// Opens a region where autocast is off (inside an enabled one: `enabled=False`).
pub fn autocast_disabled() -> AutocastGuard {
    let cur = crate::autocast_state::current();
    enter(false, cur.dtype)
}

/// Runs `f` inside an autocast region; the region ends when `f` returns, whatever it returns.
pub fn with_autocast<R>(dtype: DType, f: impl FnOnce() -> R) -> Result<R> {
    let _g = autocast(dtype)?;
    Ok(f())
}

/// The low dtype when autocast is active on this thread.
pub fn active_dtype() -> Option<DType> {
    let s = crate::autocast_state::current();
    s.enabled.then_some(s.dtype)
}

/// The low dtype to autocast to on `device`: `dtype` when the device has it; a bf16 request
/// on a device without bf16 arithmetic (CUDA before compute capability 8.0) falls back to
/// f16, printing a warning once per process (then use a [`GradScaler`], which bf16 does not
/// need). The CPU supports both.
///
/// ```
/// use mantissa::{amp, DType, Device};
/// assert_eq!(amp::supported_dtype(Device::Cpu, DType::BF16)?, DType::BF16);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn supported_dtype(device: Device, dtype: DType) -> Result<DType> {
    if !dtype.is_half() {
        return Err(Error::DType {
            op: "supported_dtype",
            dtype,
            expected: "F16 or BF16",
        });
    }
    let (d, warning) = fallback(dtype, device.supports_bf16()?);
    if let Some(w) = warning {
        // Once per process, to the application's logger (the `log` crate).
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| log::warn!("{w} (device {device})"));
    }
    Ok(d)
}

/// Opens an autocast region for `device`, with [`supported_dtype`]'s fallback.
pub fn autocast_on(device: Device, dtype: DType) -> Result<AutocastGuard> {
    autocast(supported_dtype(device, dtype)?)
}

/// The dtype used for `dtype` when bf16 is (not) supported, and the warning to print.
fn fallback(dtype: DType, bf16_supported: bool) -> (DType, Option<&'static str>) {
    if dtype == DType::BF16 && !bf16_supported {
        (
            DType::F16,
            Some("bf16 autocast is not supported on this device; falling back to f16"),
        )
    } else {
        (dtype, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_falls_back_to_f16_with_a_warning_only_when_unsupported() {
        assert_eq!(fallback(DType::BF16, true), (DType::BF16, None));
        assert_eq!(fallback(DType::F16, false), (DType::F16, None));
        let (d, w) = fallback(DType::BF16, false);
        assert_eq!(d, DType::F16);
        assert!(w.unwrap().contains("falling back to f16"));
        assert_eq!(
            supported_dtype(Device::Cpu, DType::BF16).unwrap(),
            DType::BF16
        );
        assert!(supported_dtype(Device::Cpu, DType::F32).is_err());
        assert!(supported_dtype(Device::Cuda(0), DType::BF16).is_err());
    }
}
