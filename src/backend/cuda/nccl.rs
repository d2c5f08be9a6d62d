//! NCCL, loaded at run time: the entry points the communicators (`nccl_comm.rs`) use, NCCL's
//! version and unique ids, and the configuration of a non-blocking communicator.
//!
//! cudarc has NCCL bindings, but its loader tries `libnccl.so` and CUDA-versioned names,
//! never `libnccl.so.2`, NCCL's soname and the only file pip's `nvidia-nccl-cu12/13` wheels
//! ship; its `Comm` is not `Send` and aborts (panicking on error) when dropped. So the few
//! entry points used are looked up here in the library `libs` found (the same search as every
//! CUDA library), with NCCL's C types: results as plain integers, so an unknown code is an
//! error, never an invalid enum value.

use super::libs::{self, Lib};
use crate::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UniqueId(pub(super) [c_char; 128]);

pub(super) type CommPtr = *mut c_void;
type Stream = sys::CUstream;

/// The first fields of `ncclConfig_t`, as NCCL 2.17 declares them. NCCL reads the bytes
/// `size` covers and the fields `version` had, taking its defaults for the rest, so a newer
/// library reads this one as its own.
#[repr(C)]
pub(super) struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: NCCL's calls on the communicator return
    /// at once (`ncclInProgress` while they go on), so that a peer that never comes leaves
    /// this rank polling under its deadline instead of inside NCCL.
    pub(super) fn non_blocking() -> Config {
        /// `NCCL_CONFIG_UNDEF_INT`: NCCL's default.
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 17, 0): the layout above.
            version: 21_700,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
        }
    }
}

/// `ncclAllReduce`, `ncclReduceScatter` (send, receive, count, type, op, ...) and
/// `ncclBroadcast` (the same with a root rank for the op).
type Reduction =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;

/// The entry points, as NCCL 2.x declares them; those of NCCL 2.14 and later are optional
/// (an older library gets a blocking communicator).
pub(super) struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub(super) comm_init_rank: unsafe extern "C" fn(*mut CommPtr, c_int, UniqueId, c_int) -> c_int,
    pub(super) comm_init_rank_config:
        Option<unsafe extern "C" fn(*mut CommPtr, c_int, UniqueId, c_int, *mut Config) -> c_int>,
    pub(super) comm_finalize: Option<unsafe extern "C" fn(CommPtr) -> c_int>,
    pub(super) comm_abort: unsafe extern "C" fn(CommPtr) -> c_int,
    pub(super) comm_destroy: unsafe extern "C" fn(CommPtr) -> c_int,
    pub(super) comm_get_async_error: unsafe extern "C" fn(CommPtr, *mut c_int) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    pub(super) all_reduce: Reduction,
    pub(super) broadcast: Reduction,
    pub(super) all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, CommPtr, Stream) -> c_int,
    pub(super) reduce_scatter: Reduction,
}

/// `ncclInProgress`: a non-blocking communicator's call goes on in the background.
pub(super) const IN_PROGRESS: c_int = 7;

pub(super) fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    let api = API.get_or_init(|| {
        libs::with_library(Lib::Nccl, |l| {
            macro_rules! sym {
                ($name:literal) => {
                    // SAFETY: the symbol is NCCL's function of that name, whose C signature
                    // is the field's type (nccl.h, 2.x); the library stays open for the life
                    // of the process (`libs`).
                    *unsafe { l.get($name) }.map_err(|e| {
                        format!(
                            "{}: {e}",
                            String::from_utf8_lossy(&$name[..$name.len() - 1])
                        )
                    })?
                };
            }
            macro_rules! optional {
                ($name:literal) => {
                    // SAFETY: as `sym!`; a library without the symbol gives `None`.
                    unsafe { l.get($name) }.ok().map(|f| *f)
                };
            }
            Ok(Api {
                get_version: sym!(b"ncclGetVersion\0"),
                get_unique_id: sym!(b"ncclGetUniqueId\0"),
                comm_init_rank: sym!(b"ncclCommInitRank\0"),
                comm_init_rank_config: optional!(b"ncclCommInitRankConfig\0"),
                comm_finalize: optional!(b"ncclCommFinalize\0"),
                comm_abort: sym!(b"ncclCommAbort\0"),
                comm_destroy: sym!(b"ncclCommDestroy\0"),
                comm_get_async_error: sym!(b"ncclCommGetAsyncError\0"),
                get_error_string: sym!(b"ncclGetErrorString\0"),
                all_reduce: sym!(b"ncclAllReduce\0"),
                broadcast: sym!(b"ncclBroadcast\0"),
                all_gather: sym!(b"ncclAllGather\0"),
                reduce_scatter: sym!(b"ncclReduceScatter\0"),
            })
        })
        .map_err(|e| e.to_string())
        .and_then(|r| r)
    });
    api.as_ref().map_err(|msg| Error::CudaLibrary {
        lib: "libnccl",
        msg: msg.clone(),
    })
}

/// NCCL's text for a result code.
pub(super) fn describe(code: c_int) -> String {
    let text = api().ok().map(|a| {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let p = unsafe { (a.get_error_string)(code) };
        match p.is_null() {
            true => String::new(),
            // SAFETY: non-null, NUL-terminated and static (above).
            false => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
        }
    });
    format!("NCCL error {code} ({})", text.unwrap_or_default())
}

/// NCCL's version as `major.minor.patch`.
pub fn version() -> Result<String> {
    let a = api()?;
    let mut v: c_int = 0;
    // SAFETY: one int written through a valid pointer.
    let r = unsafe { (a.get_version)(&mut v) };
    if r != 0 {
        return Err(Error::CudaLibrary {
            lib: "libnccl",
            msg: describe(r),
        });
    }
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// A new unique id (rank 0 makes it; the rendezvous hands it to the others).
pub fn unique_id() -> Result<Vec<u8>> {
    let a = api()?;
    let mut id = UniqueId([0; 128]);
    // SAFETY: writes the 128 bytes of `id`.
    let r = unsafe { (a.get_unique_id)(&mut id) };
    if r != 0 {
        return Err(Error::CudaLibrary {
            lib: "libnccl",
            msg: format!("ncclGetUniqueId: {}", describe(r)),
        });
    }
    Ok(id.0.iter().map(|&c| c as u8).collect())
}

/// What a collective does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Collective {
    /// `ncclAllReduce` with an op: 0 sum, 2 max, 3 min, 4 average.
    AllReduce(c_int),
    Broadcast {
        root: usize,
    },
    /// `count` is each rank's part.
    AllGather,
    /// `count` is each rank's part of the result.
    ReduceScatter(c_int),
}

impl Collective {
    /// NCCL's name of the call.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "ncclAllReduce",
            Collective::Broadcast { .. } => "ncclBroadcast",
            Collective::AllGather => "ncclAllGather",
            Collective::ReduceScatter(_) => "ncclReduceScatter",
        }
    }
}

/// NCCL's code for `dtype`.
pub(super) fn nccl_type(dtype: crate::DType) -> c_int {
    use crate::DType;
    match dtype {
        DType::U8 => 1,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}
