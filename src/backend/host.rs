//! The host buffer both backends share: the CPU backend's storage, and the form the CUDA
//! backend takes data to and from the device in. One `Vec` per dtype; dtype dispatch over it
//! is written once, in the `map_*` macros below.

use crate::dtype::WithDType;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use half::{bf16, f16};

/// Host storage of a tensor.
#[derive(Debug, Clone)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

/// An element type the CPU backend stores.
pub trait CpuElem: WithDType {
    fn wrap(v: Vec<Self>) -> CpuStorage;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
}

macro_rules! cpu_elem {
    ($t:ty, $v:ident) => {
        impl CpuElem for $t {
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
cpu_elem!(f32, F32);
cpu_elem!(f16, F16);
cpu_elem!(bf16, BF16);
cpu_elem!(f64, F64);
cpu_elem!(i64, I64);
cpu_elem!(u8, U8);

/// Expands `$body` for every dtype, with `$v` bound to the typed vector.
macro_rules! map_all {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::F64($v) => $body,
            CpuStorage::I64($v) => $body,
            CpuStorage::U8($v) => $body,
        }
    };
}

/// Expands `$body` for the float dtypes; other dtypes give an error naming `$op`.
macro_rules! map_float {
    ($op:expr, $s:expr, $v:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::F64($v) => $body,
            other => {
                return Err($crate::Error::DType {
                    op: $op,
                    dtype: other.dtype(),
                    expected: "a float dtype",
                })
            }
        }
    };
}

/// Expands `$body` for pairs of same-dtype storages (`$a`, `$b` typed alike).
macro_rules! map_pair {
    ($op:expr, $x:expr, $y:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            (CpuStorage::F32($a), CpuStorage::F32($b)) => $body,
            (CpuStorage::F16($a), CpuStorage::F16($b)) => $body,
            (CpuStorage::BF16($a), CpuStorage::BF16($b)) => $body,
            (CpuStorage::F64($a), CpuStorage::F64($b)) => $body,
            (CpuStorage::I64($a), CpuStorage::I64($b)) => $body,
            (CpuStorage::U8($a), CpuStorage::U8($b)) => $body,
            (x, y) => {
                return Err($crate::Error::DTypeMismatch {
                    op: $op,
                    lhs: x.dtype(),
                    rhs: y.dtype(),
                })
            }
        }
    };
}
pub(crate) use {map_all, map_float, map_pair};

/// An empty vector with room for `n` elements, or [`crate::Error::OutOfMemory`] when the
/// request passes the host memory limit ([`super::host_limit`], checked before anything is
/// allocated, whatever the OS's overcommit policy) or the host allocator refuses (instead of
/// the abort or capacity panic of `vec![x; n]`).
pub(crate) fn try_vec<T>(n: usize) -> Result<Vec<T>> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    super::host_limit::check(bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| crate::Error::host_oom(bytes))?;
    Ok(v)
}

/// Checks that the host can hold `n` elements of `dtype` before a kernel that allocates them
/// without a `Result` runs: requests from 256 MiB up are reserved once and released, so one
/// the allocator refuses becomes [`crate::Error::OutOfMemory`] instead of an abort.
pub(crate) fn host_can_hold(n: usize, dtype: DType) -> Result<()> {
    host_can_hold_bytes(n.saturating_mul(dtype.size_in_bytes()))
}

/// [`host_can_hold`] for a byte count. A request past the host memory limit is refused
/// whatever its size.
pub(crate) fn host_can_hold_bytes(bytes: usize) -> Result<()> {
    super::host_limit::check(bytes)?;
    if bytes >= 256 << 20 {
        drop(try_vec::<u8>(bytes)?);
    }
    Ok(())
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
        }
    }

    pub fn len(&self) -> usize {
        map_all!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `n` copies of `value` (rounded to `dtype`); [`crate::Error::OutOfMemory`] when the host
    /// cannot hold them.
    pub fn full(value: f64, n: usize, dtype: DType) -> Result<CpuStorage> {
        fn go<T: CpuElem>(value: f64, n: usize) -> Result<CpuStorage> {
            let mut v = try_vec(n)?;
            v.resize(n, T::from_f64(value));
            Ok(T::wrap(v))
        }
        match dtype {
            DType::F32 => go::<f32>(value, n),
            DType::F16 => go::<f16>(value, n),
            DType::BF16 => go::<bf16>(value, n),
            DType::F64 => go::<f64>(value, n),
            DType::I64 => go::<i64>(value, n),
            DType::U8 => go::<u8>(value, n),
        }
    }

    /// Builds storage of `dtype` from f64 values (rounding on store), reserving the
    /// iterator's lower size bound up front (an [`crate::Error::OutOfMemory`] when refused).
    pub fn from_f64s(values: impl Iterator<Item = f64>, dtype: DType) -> Result<CpuStorage> {
        fn go<T: CpuElem>(values: impl Iterator<Item = f64>) -> Result<CpuStorage> {
            let mut v = try_vec(values.size_hint().0)?;
            v.extend(values.map(T::from_f64));
            Ok(T::wrap(v))
        }
        match dtype {
            DType::F32 => go::<f32>(values),
            DType::F16 => go::<f16>(values),
            DType::BF16 => go::<bf16>(values),
            DType::F64 => go::<f64>(values),
            DType::I64 => go::<i64>(values),
            DType::U8 => go::<u8>(values),
        }
    }

    /// The whole storage's bytes, borrowed (little-endian, as `to_le_bytes`).
    pub fn as_bytes(&self) -> &[u8] {
        map_all!(self, v => bytemuck::cast_slice(v))
    }

    /// The whole storage's bytes, open for writing (little-endian, as `as_bytes`).
    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        map_all!(self, v => bytemuck::cast_slice_mut(v))
    }

    /// Storage of `dtype` from raw little-endian bytes; `None` if the length does not fit.
    pub fn from_le_bytes(bytes: &[u8], dtype: DType) -> Option<CpuStorage> {
        fn go<T: CpuElem>(b: &[u8]) -> Option<CpuStorage> {
            if !b.len().is_multiple_of(std::mem::size_of::<T>()) {
                return None;
            }
            let mut v = vec![T::zero(); b.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
            Some(T::wrap(v))
        }
        match dtype {
            DType::F32 => go::<f32>(bytes),
            DType::F16 => go::<f16>(bytes),
            DType::BF16 => go::<bf16>(bytes),
            DType::F64 => go::<f64>(bytes),
            DType::I64 => go::<i64>(bytes),
            DType::U8 => go::<u8>(bytes),
        }
    }

    /// Every element as f64, in the row-major order of `layout`.
    pub fn to_f64_vec(&self, layout: &Layout) -> Vec<f64> {
        map_all!(self, v => layout.offsets().map(|o| v[o].to_f64()).collect())
    }
}

/// Helper to turn a typed vector into storage.
pub(crate) trait IntoStorage {
    fn into_storage(self) -> CpuStorage;
}
impl<T: CpuElem> IntoStorage for Vec<T> {
    fn into_storage(self) -> CpuStorage {
        T::wrap(self)
    }
}

/// Reads an I64 index tensor into a vector, checking every entry against `size`.
pub(crate) fn indices(
    op: &'static str,
    s: &CpuStorage,
    l: &Layout,
    dim: usize,
    size: usize,
) -> Result<Vec<usize>> {
    let CpuStorage::I64(v) = s else {
        return Err(Error::DType {
            op,
            dtype: s.dtype(),
            expected: "I64 indices",
        });
    };
    l.offsets()
        .map(|o| {
            let i = v[o];
            if i < 0 || i as usize >= size {
                Err(Error::IndexOutOfRange {
                    op,
                    index: i,
                    dim,
                    size,
                })
            } else {
                Ok(i as usize)
            }
        })
        .collect()
}
