//! Finding the CUDA libraries at run time.
//!
//! cudarc opens each library by its plain name, so only the loader path is searched. Before
//! its first call we look in the usual places too (the loader path, `MANTISSA_CUDA_LIB_DIR`,
//! `CUDA_HOME` / `CUDA_PATH`, `/usr/local/cuda`, and the `nvidia/*/lib` folders of
//! pip-installed NVIDIA packages) and open the library there by its full path with
//! `RTLD_GLOBAL`; the loader then hands that copy to cudarc's later open by name (the library's
//! soname matches), which is what PyTorch does with the same packages.

use crate::{Error, Result};
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A CUDA library the backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    Driver,
    Nvrtc,
    CublasLt,
    Cublas,
    Cudnn,
    /// NCCL, for collectives between devices (`crate::distributed`).
    Nccl,
}

#[cfg(feature = "cuda-12")]
const MAJOR: &str = "12";
#[cfg(not(feature = "cuda-12"))]
const MAJOR: &str = "13";

impl Lib {
    /// The file name the loader knows the library by.
    pub fn soname(self) -> String {
        match self {
            Lib::Driver => "libcuda.so.1".into(),
            Lib::Nvrtc => format!("libnvrtc.so.{MAJOR}"),
            Lib::CublasLt => format!("libcublasLt.so.{MAJOR}"),
            Lib::Cublas => format!("libcublas.so.{MAJOR}"),
            Lib::Cudnn => "libcudnn.so.9".into(),
            // NCCL's soname has its own major version, whatever the CUDA version.
            Lib::Nccl => "libnccl.so.2".into(),
        }
    }

    /// How a user gets it.
    pub fn install_hint(self) -> String {
        match self {
            Lib::Driver => "install the NVIDIA driver (libcuda comes with it)".into(),
            Lib::Nvrtc => format!("pip install nvidia-cuda-nvrtc (CUDA {MAJOR})"),
            Lib::CublasLt | Lib::Cublas => format!("pip install nvidia-cublas (CUDA {MAJOR})"),
            Lib::Cudnn => format!("pip install nvidia-cudnn-cu{MAJOR}"),
            Lib::Nccl => format!("pip install nvidia-nccl-cu{MAJOR}"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Lib::Driver => "libcuda",
            Lib::Nvrtc => "libnvrtc",
            Lib::CublasLt => "libcublasLt",
            Lib::Cublas => "libcublas",
            Lib::Cudnn => "libcudnn",
            Lib::Nccl => "libnccl",
        }
    }
}

/// Python prefixes whose site-packages may hold NVIDIA wheels.
fn python_prefixes() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .collect();
    out.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        out.push(home.join(".local"));
        out.extend(subdirs(&home.join(".pyenv/versions")));
    }
    out
}

/// The folders inside `dir` (none when it cannot be read).
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Every folder searched, in order.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(v) = std::env::var_os("MANTISSA_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&v));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var).map(PathBuf::from) {
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    for prefix in python_prefixes() {
        for py in subdirs(&prefix.join("lib")).into_iter().filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
        }) {
            for pkgs in ["site-packages", "dist-packages"] {
                // CUDA 13 wheels use nvidia/cu13/lib, CUDA 12 ones nvidia/<package>/lib.
                for d in subdirs(&py.join(pkgs).join("nvidia")) {
                    dirs.push(d.join("lib"));
                }
            }
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs.dedup();
    dirs
}

/// The libraries opened so far, with the path each was found at (`None`: the loader path).
type Opened = Mutex<HashMap<Lib, (Library, Option<PathBuf>)>>;

fn opened() -> &'static Opened {
    static LIBS: OnceLock<Opened> = OnceLock::new();
    LIBS.get_or_init(Default::default)
}

/// Runs `f` on `lib`, opened first ([`load`]): to look up its symbols, which stay valid
/// for the life of the process (a library opened here is never closed).
pub fn with_library<R>(lib: Lib, f: impl FnOnce(&Library) -> R) -> Result<R> {
    load(lib)?;
    let libs = opened().lock().unwrap_or_else(|e| e.into_inner());
    let (l, _) = libs.get(&lib).expect("load keeps what it opened");
    Ok(f(l))
}

/// Opens `lib` (kept open for the life of the process) and returns where it was found
/// (`None`: through the loader path). A missing library is an error naming what to install.
pub fn load(lib: Lib) -> Result<Option<PathBuf>> {
    let mut libs = opened().lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = libs.get(&lib) {
        return Ok(p.clone());
    }
    let soname = lib.soname();
    let flags = RTLD_NOW | RTLD_GLOBAL;
    // SAFETY: opening a CUDA library runs only its initialisers, which have no preconditions.
    if let Ok(l) = unsafe { Library::open(Some(&soname), flags) } {
        libs.insert(lib, (l, None));
        return Ok(None);
    }
    let dirs = search_dirs();
    let mut errors = Vec::new();
    for d in &dirs {
        let path = d.join(&soname);
        if !path.exists() {
            continue;
        }
        // SAFETY: as above.
        match unsafe { Library::open(Some(&path), flags) } {
            Ok(l) => {
                libs.insert(lib, (l, Some(path.clone())));
                return Ok(Some(path));
            }
            Err(e) => errors.push(format!("{}: {e}", path.display())),
        }
    }
    Err(Error::CudaLibrary {
        lib: lib.name(),
        msg: format!(
            "{soname} is not on the loader path nor in {} searched folders{}; {} (or set \
             MANTISSA_CUDA_LIB_DIR to its folder)",
            dirs.len(),
            if errors.is_empty() {
                String::new()
            } else {
                format!(" (found but failed: {})", errors.join("; "))
            },
            lib.install_hint()
        ),
    })
}
