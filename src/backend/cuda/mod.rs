//! The CUDA backend (feature `cuda`): library discovery, device probing and report, the NVRTC
//! kernel compiler with its disk cache, a per-device runtime (context, stream, loaded kernels,
//! caching allocator, cuBLAS and cuDNN handles), device storage with transfers and casts, and
//! one launcher module per op family (`elementwise.rs`, `reduce.rs`, `matmul.rs`, ...) behind
//! the backend traits (`backend.rs`). Index tensors stay on the device: the kernels check them,
//! and an index out of range is reported at the next read (`faults.rs`).

/// Launches `$name` (a `&'static str`: `kname!`) of kernel file `$file` on `$s`'s stream over
/// `$cfg`, with the arguments given as references to locals (cudarc stores argument pointers
/// until the launch). The site keeps the kernels it launched (`sites::Site`): a launch
/// formats nothing and takes no lock to find its kernel. With a leading `bytes = expr;`, a
/// running profile gets the bytes the launch reads and writes.
macro_rules! launch {
    (bytes = $bytes:expr; $s:expr, $file:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        launch!(@go Some($bytes), $s, $file, $name, $cfg, $($arg),+)
    }};
    ($s:expr, $file:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        launch!(@go None, $s, $file, $name, $cfg, $($arg),+)
    }};
    (@go $bytes:expr, $s:expr, $file:expr, $name:expr, $cfg:expr, $($arg:expr),+) => {{
        static SITE: $crate::backend::cuda::sites::Site = $crate::backend::cuda::sites::Site::new();
        let name: &'static str = $name;
        let f = SITE.function($s.rt(), $file, name)?;
        let mut b = $s.rt().stream().launch_builder(&f);
        $( b.arg($arg); )+
        let cfg: cudarc::driver::LaunchConfig = $cfg;
        let bytes: Option<u64> = $bytes;
        let prof = $crate::backend::cuda::profile::kernel($s.rt(), || name.to_string(), &cfg, bytes);
        // SAFETY: the arguments match the kernel's parameter list in `cuda/`, and the
        // pointers address device blocks that hold the elements the kernel touches.
        unsafe { b.launch(cfg) }.map_err(|e| Error::CudaDriver {
            op: "launching a kernel",
            device: $s.device(),
            msg: format!("{name}: {e}"),
        })?;
        if let Some(p) = prof {
            p.end();
        }
    }};
}

/// A kernel's name, `$prefix` and a dtype suffix of `storage::kname` (or a width such as
/// `u16`), then optionally `$mid` and a second suffix, as a `&'static str` spelled from
/// literals: no formatting at a launch. A suffix outside those is interned once
/// (`sites::intern`).
macro_rules! kname {
    ($p:literal, $t:expr) => {
        kname!(@one $p, $t)
    };
    ($p:literal, $t:expr, $m:literal, $u:expr) => {
        match $t {
            "float" => kname!(@one concat!($p, "float", $m), $u),
            "f16" => kname!(@one concat!($p, "f16", $m), $u),
            "bf16" => kname!(@one concat!($p, "bf16", $m), $u),
            "i64" => kname!(@one concat!($p, "i64", $m), $u),
            "u8" => kname!(@one concat!($p, "u8", $m), $u),
            other => $crate::backend::cuda::sites::intern(format!("{}{}{}{}", $p, other, $m, $u)),
        }
    };
    (@one $p:expr, $t:expr) => {
        match $t {
            "float" => concat!($p, "float"),
            "f16" => concat!($p, "f16"),
            "bf16" => concat!($p, "bf16"),
            "i64" => concat!($p, "i64"),
            "u8" => concat!($p, "u8"),
            "u16" => concat!($p, "u16"),
            "u32" => concat!($p, "u32"),
            "u64" => concat!($p, "u64"),
            other => $crate::backend::cuda::sites::intern(format!("{}{}", $p, other)),
        }
    };
}

pub(crate) mod amp;
mod attention;
mod backend;
mod blaslt;
mod capturing;
pub mod compile;
pub mod conv;
mod conv_desc;
pub mod conv_stats;
mod conv_wgrad;
pub(crate) mod copy_list;
mod dnn_graph;
pub mod dnn_norm;
mod dnn_sdpa;
mod dnn_sdpa_graph;
pub(crate) mod elementwise;
mod epilogue;
mod faults;
mod flash;
pub(crate) mod graph;
pub(crate) mod handles;
// The kernel files run on the host against the CPU backend: unit tests of the launchers'
// private argument structs, kept with the other GPU stand-ins under tests/.
#[cfg(test)]
#[path = "../../../tests/host_kernels/mod.rs"]
mod host_kernels;
pub mod index;
pub mod kernels;
pub(crate) mod layer_norm;
mod libraries;
pub mod libs;
pub mod limits;
pub mod loss;
pub mod matmul;
pub(crate) mod nccl;
pub(crate) mod nccl_comm;
pub mod norm;
pub mod nvrtc;
pub mod optim;
pub mod pinned;
pub mod pool;
pub mod probe;
pub(crate) mod profile;
pub(crate) mod random;
pub(crate) mod reduce;
pub mod rnn;
pub mod runtime;
pub mod sites;
pub(crate) mod softmax;
mod sort;
pub mod storage;
pub(crate) mod tf32;
