//! The one error type of the crate.

use crate::{DType, Device};

/// Everything that can go wrong in a tensor operation.
///
/// Every variant names the operation (`op`) and the shapes, dtypes or devices involved, so a
/// message read in a log is enough to find the faulty call. `Debug` prints the same sentence
/// as `Display` (as `anyhow` does), so `fn main() -> mantissa::Result<()>` reports an error
/// in words; match on the variants to read their fields.
///
/// ```
/// use mantissa::{Device, Tensor};
/// let a = Tensor::zeros(&[2, 3], mantissa::DType::F32, Device::Cpu)?;
/// let e = a.matmul(&a).unwrap_err();
/// assert_eq!(format!("{e:?}"), e.to_string());
/// assert!(e.to_string().contains("inner dimensions differ, 3"), "{e}");
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch, {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        op: &'static str,
        lhs: Vec<usize>,
        rhs: Vec<usize>,
    },
    /// A product whose inner dimensions differ: `lhs`'s last dimension (`k_lhs`) against
    /// `rhs`'s `rhs_dim` (`k_rhs`).
    #[error(
        "{op}: cannot multiply {lhs:?} by {rhs:?}: inner dimensions differ, {k_lhs} (the \
         last dim of {lhs:?}) vs {k_rhs} (the {rhs_dim} of {rhs:?})"
    )]
    InnerDims {
        op: &'static str,
        lhs: Vec<usize>,
        rhs: Vec<usize>,
        k_lhs: usize,
        k_rhs: usize,
        rhs_dim: &'static str,
    },
    /// Two shapes cannot be broadcast together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} cannot be broadcast together")]
    Broadcast {
        op: &'static str,
        lhs: Vec<usize>,
        rhs: Vec<usize>,
    },
    /// An op got a dtype it does not accept.
    #[error("{op}: unsupported dtype {dtype:?}{}", if .expected.is_empty() { String::new() } else { format!(" (expected {})", .expected) })]
    DType {
        op: &'static str,
        dtype: DType,
        expected: &'static str,
    },
    /// Two tensors that must share a dtype do not.
    #[error("{op}: dtype mismatch, {lhs:?} vs {rhs:?}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },
    /// Two tensors live on different devices.
    #[error("{op}: device mismatch, {lhs} vs {rhs}")]
    DeviceMismatch {
        op: &'static str,
        lhs: Device,
        rhs: Device,
    },
    /// Work that cannot go into a CUDA graph was asked for while one was being captured (a
    /// host read such as `item()`, an upload from host memory, a host fallback, a draw from
    /// a generator the replay cannot advance...): `op` names it. The capture fails; nothing
    /// is replayed.
    #[error("not capturable: {op} on {device}: {why}")]
    NotCapturable {
        op: String,
        device: Device,
        why: String,
    },
    /// The CUDA backend is not available in this build or on this machine.
    #[error("CUDA backend not available ({device}): {reason}")]
    CudaUnavailable { device: Device, reason: String },
    /// A CUDA driver call failed on a device that is otherwise available (a launch, a copy,
    /// loading a module).
    #[error("{op} on {device}: CUDA driver error: {msg}")]
    CudaDriver {
        op: &'static str,
        device: Device,
        msg: String,
    },
    /// A CUDA library could not be found or loaded; the message says how to install it.
    #[error("CUDA library {lib} not available: {msg}")]
    CudaLibrary { lib: &'static str, msg: String },
    /// A CUDA library that is loaded refused a call or failed in it: `status` is the
    /// library's own (`CUDNN_STATUS_NOT_SUPPORTED`, `CUBLAS_STATUS_INVALID_VALUE`, ...), and
    /// `what` the call or descriptor. Not a missing library ([`Error::CudaLibrary`]).
    #[error("{op} on {device}: {lib} returned {status}: {what}")]
    CudaLibraryStatus {
        lib: &'static str,
        op: &'static str,
        device: Device,
        status: String,
        what: String,
    },
    /// The op has no kernel on this device yet (the CUDA backend is being filled in).
    #[error(
        "{op} is not implemented on {device} yet ({what}); move the tensors to the CPU for it"
    )]
    NotOnDevice {
        op: &'static str,
        device: Device,
        what: String,
    },
    /// A device allocation failed even after the allocator released its cached blocks.
    #[error("out of memory on {device}: {requested} bytes requested; {stats}")]
    OutOfMemory {
        device: Device,
        requested: usize,
        stats: String,
    },
    /// A size that cannot be represented: an element count, offset or byte count that
    /// overflows, a tensor of more than `isize::MAX` bytes, or a size past a library's limit.
    /// Nothing is allocated or read when this is returned.
    #[error("{op}: shape {shape:?}: {msg}")]
    TooLarge {
        op: &'static str,
        shape: Vec<usize>,
        msg: String,
    },
    /// NVRTC rejected a kernel source; `log` is its compiler output.
    #[error("NVRTC could not compile kernel {kernel} for {arch}:\n{log}")]
    KernelCompile {
        kernel: String,
        arch: String,
        log: String,
    },
    /// A dimension index is outside `-rank..rank`.
    #[error("{op}: dimension {dim} out of range for a tensor of rank {rank} (shape {shape:?})")]
    DimOutOfRange {
        op: &'static str,
        dim: isize,
        rank: usize,
        shape: Vec<usize>,
    },
    /// An index value is outside `0..size`.
    #[error("{op}: index {index} out of range for dimension {dim} of size {size}")]
    IndexOutOfRange {
        op: &'static str,
        index: i64,
        dim: usize,
        size: usize,
    },
    /// The op cannot work on a tensor with no elements.
    #[error("{op}: empty tensor of shape {shape:?}")]
    Empty { op: &'static str, shape: Vec<usize> },
    /// A reshape to a shape with another element count.
    #[error("{op}: cannot reshape {from:?} ({from_numel} elements) into {to:?}")]
    Reshape {
        op: &'static str,
        from: Vec<usize>,
        from_numel: usize,
        to: Vec<usize>,
    },
    /// A bad argument value (a negative probability, a zero stride, ...).
    #[error("{op}: {msg}")]
    Invalid { op: &'static str, msg: String },
    /// A data buffer whose length disagrees with the shape.
    #[error("{op}: {len} values given for shape {shape:?} ({numel} elements)")]
    DataLength {
        op: &'static str,
        len: usize,
        shape: Vec<usize>,
        numel: usize,
    },
    /// A file could not be read or written.
    #[error("{op}: {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A file's contents are malformed (bad magic number, truncated, wrong sizes, ...).
    #[error("{op}: {path}: {msg}")]
    Format {
        op: &'static str,
        path: String,
        msg: String,
    },
    /// A checkpoint does not fit the model or optimizer; every mismatch is listed.
    #[error("checkpoint {path} does not match:\n  {}", .problems.join("\n  "))]
    Checkpoint { path: String, problems: Vec<String> },
    /// A collective, the rendezvous or the data-parallel wrapper failed: a peer that never
    /// came, a communicator that broke, tensors that differ between ranks.
    #[error("{op} (rank {rank} of {world_size}): {msg}")]
    Distributed {
        op: &'static str,
        rank: usize,
        world_size: usize,
        msg: String,
    },
    /// Autograd misuse: backward on a non-scalar, twice through a freed graph, ...
    #[error("autograd: {0}")]
    Autograd(String),
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Whether the error says the request was too large for the device rather than wrong:
    /// out of memory, a size past what can be represented ([`Error::TooLarge`]), or a CUDA
    /// library's `NOT_SUPPORTED` for the call (cuDNN's answer to sizes past its limits).
    /// [`crate::train::find_batch_size`] takes any of them as the ceiling of its search.
    ///
    /// ```
    /// use mantissa::{Device, Error};
    /// let oom = Error::OutOfMemory { device: Device::Cpu, requested: 1 << 40, stats: String::new() };
    /// assert!(oom.is_size_limit());
    /// assert!(!Error::Autograd("backward twice".into()).is_size_limit());
    /// ```
    pub fn is_size_limit(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } | Error::TooLarge { .. } => true,
            Error::CudaLibraryStatus { status, .. } => status.contains("NOT_SUPPORTED"),
            _ => false,
        }
    }

    pub(crate) fn io(op: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.display().to_string(),
            source,
        }
    }

    pub(crate) fn format(op: &'static str, path: &std::path::Path, msg: impl Into<String>) -> Self {
        Error::Format {
            op,
            path: path.display().to_string(),
            msg: msg.into(),
        }
    }

    pub(crate) fn too_large(op: &'static str, shape: &[usize], msg: impl Into<String>) -> Self {
        Error::TooLarge {
            op,
            shape: shape.to_vec(),
            msg: msg.into(),
        }
    }

    /// A host allocation of `bytes` that the allocator refused.
    pub(crate) fn host_oom(bytes: usize) -> Self {
        Error::OutOfMemory {
            device: Device::Cpu,
            requested: bytes,
            stats: "the host allocator refused the request".into(),
        }
    }

    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            msg: msg.into(),
        }
    }
}
