//! Compiling kernels with NVRTC to a cubin for one architecture (no PTX: a cubin cannot be
//! "newer than the driver"), cached on disk under a key of source hash, architecture and
//! NVRTC version.

use super::libs::{self, Lib};
use crate::{Error, Result};
use cudarc::nvrtc::{result as nr, sys as ns};
use std::ffi::{c_char, CString};
use std::path::PathBuf;

fn nvrtc_err(kernel: &str, arch: u32, e: impl std::fmt::Debug) -> Error {
    Error::KernelCompile {
        kernel: kernel.to_string(),
        arch: format!("sm_{arch}"),
        log: format!("{e:?}"),
    }
}

/// NVRTC's version (major, minor), loading the library first.
pub fn version() -> Result<(i32, i32)> {
    libs::load(Lib::Nvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes; the library is loaded.
    unsafe { ns::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::CudaLibrary {
            lib: "libnvrtc",
            msg: format!("nvrtcVersion failed: {e:?}"),
        })?;
    Ok((major, minor))
}

fn text(log: Vec<c_char>) -> String {
    let bytes: Vec<u8> = log
        .into_iter()
        .map(|c| c as u8)
        .take_while(|&c| c != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `src` (kernel file `kernel`) to a cubin for `sm_{arch}` (80 for A100, 90 for
/// H100). A source NVRTC rejects gives [`Error::KernelCompile`] with the compiler's log.
pub fn compile(kernel: &str, src: &str, arch: u32) -> Result<Vec<u8>> {
    compile_part(kernel, src, arch, None)
}

/// [`compile`] for one part of the file (`-DMANTISSA_PART=part`: the kernels of one dtype
/// group, see [`super::kernels::part_of`]), or the whole file for `None`.
pub fn compile_part(kernel: &str, src: &str, arch: u32, part: Option<usize>) -> Result<Vec<u8>> {
    libs::load(Lib::Nvrtc)?;
    let c_src = CString::new(src).map_err(|e| nvrtc_err(kernel, arch, e))?;
    let c_name = CString::new(format!("{kernel}.cu")).map_err(|e| nvrtc_err(kernel, arch, e))?;
    let prog = nr::create_program(&c_src, Some(&c_name)).map_err(|e| nvrtc_err(kernel, arch, e))?;
    let mut opts = vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
    ];
    if let Some(p) = part {
        opts.push(format!("-DMANTISSA_PART={p}"));
    }
    // SAFETY: `prog` was created above and is destroyed once, below; the source and name
    // strings outlive it.
    let out = unsafe {
        let compiled = nr::compile_program(prog, &opts);
        let log = nr::get_program_log(prog).map(text).unwrap_or_default();
        let cubin = compiled.map_err(|_| Error::KernelCompile {
            kernel: kernel.to_string(),
            arch: format!("sm_{arch}"),
            log: log.clone(),
        });
        let cubin = cubin.and_then(|()| {
            let mut size = 0usize;
            ns::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| nvrtc_err(kernel, arch, e))?;
            let mut bin = vec![0u8; size];
            ns::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char)
                .result()
                .map_err(|e| nvrtc_err(kernel, arch, e))?;
            Ok(bin)
        });
        let _ = nr::destroy_program(prog);
        cubin
    };
    out
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The folder cubins are cached in: `MANTISSA_CACHE_DIR`, else the user's cache folder.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MANTISSA_CACHE_DIR") {
        return Some(PathBuf::from(d).join("kernels"));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("mantissa").join("kernels"))
}

/// [`compile`] through the disk cache: a hit skips NVRTC; a cache that cannot be written is
/// not an error (the cubin is still returned).
pub fn cubin(kernel: &str, src: &str, arch: u32) -> Result<Vec<u8>> {
    cubin_part(kernel, src, arch, None).map(|(bin, _)| bin)
}

/// [`compile_part`] through the disk cache, and whether the cubin came from it.
pub fn cubin_part(
    kernel: &str,
    src: &str,
    arch: u32,
    part: Option<usize>,
) -> Result<(Vec<u8>, bool)> {
    let (major, minor) = version()?;
    let part_key = part.map(|p| format!("-p{p}")).unwrap_or_default();
    let key = format!(
        "{kernel}{part_key}-sm{arch}-nvrtc{major}.{minor}-{:016x}.cubin",
        fnv1a(src.as_bytes())
    );
    let path = cache_dir().map(|d| d.join(key));
    if let Some(bin) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok((bin, true));
    }
    let bin = compile_part(kernel, src, arch, part)?;
    if let Some(p) = &path {
        if let Some(d) = p.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let _ = crate::fs::write_atomic(p, &bin);
    }
    Ok((bin, false))
}
