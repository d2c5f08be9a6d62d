//! File-system helpers shared by checkpoints, metrics files and the kernel cache.

use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so a
/// crash leaves either the old file or the new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io("write_atomic", dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // A name no other save uses (process, per-process counter, clock), created exclusively:
    // `create_new` refuses an existing file or a planted symlink instead of following it, and
    // two saves to one path from one process never share a temporary file.
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}-{nanos}",
        std::process::id(),
        SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Persist the rename itself (directories can be opened and synced on Unix).
        #[cfg(unix)]
        std::fs::File::open(dir)?.sync_all()?;
        Ok(())
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io("write_atomic", path, e)
    })
}

/// Checks that a run can write into `dir` before it starts: creates it (and its parents),
/// then creates and removes a probe file in it. A mistyped, read-only or full output path
/// then fails in the first second instead of after the first epoch's work.
///
/// ```
/// let dir = std::env::temp_dir().join("mantissa-doc-writable");
/// mantissa::train::check_writable_dir(&dir, "--out")?;
/// assert!(dir.is_dir());
/// # std::fs::remove_dir(&dir).ok();
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn check_writable_dir(dir: &Path, op: &'static str) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        let e = std::io::Error::new(std::io::ErrorKind::AlreadyExists, "a file, not a folder");
        return Err(Error::io(op, dir, e));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(op, dir, e))?;
    let probe = dir.join(format!(".mantissa-write-probe-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|mut f| f.write_all(b"probe"))
        .map_err(|e| Error::io(op, dir, e))?;
    std::fs::remove_file(&probe).map_err(|e| Error::io(op, &probe, e))
}

/// Checks that a file can be written at `path` (as [`write_atomic`] will: into its folder,
/// through a temporary file): `path` is not a folder, and its folder passes
/// [`check_writable_dir`]. An existing file there is left as it is.
pub fn check_writable_file(path: &Path, op: &'static str) -> Result<()> {
    if path.is_dir() || path.file_name().is_none() {
        let e = std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a folder, not a file name",
        );
        return Err(Error::io(op, path, e));
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    check_writable_dir(dir, op)
}
