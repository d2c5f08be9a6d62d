//! Kernel files compiled when a run first needs them, in parts, in parallel.
//!
//! NVRTC takes seconds per kernel file, and the files a first run needs would take tens of
//! seconds one after another. So each file compiles as [`PARTS`] units, one per dtype group
//! (`cuda/prelude.cuh`: `MANTISSA_PART`; [`kernels::part_of`] says which holds a kernel),
//! and the first request for part `p` of any file starts part `p` of every other file on
//! background threads: a run that uses f16 kernels compiles the f16 parts of the files
//! together, and a run in f32 never compiles the f16 and bf16 parts. A request waits only
//! for its own part (compiling it on the spot if no thread has started it). Cubins go
//! through the disk cache ([`nvrtc::cubin_part`]), so a second run compiles nothing.
//!
//! [`records`] lists what was compiled or read from the cache, and how long it took.

use super::{kernels, nvrtc};
use crate::sync::lock;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

pub use super::kernels::PARTS;

/// One part's cubin, or the error that compiling it gave (kept as its parts, to be given to
/// every caller that asks for it).
type Outcome = std::result::Result<Arc<Vec<u8>>, Failure>;

/// A compile failure, kept so that each request for the part gets the same error.
#[derive(Debug, Clone)]
enum Failure {
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    Library {
        lib: &'static str,
        msg: String,
    },
    Other(String),
}

impl Failure {
    fn of(e: Error) -> Failure {
        match e {
            Error::KernelCompile { kernel, arch, log } => Failure::Compile { kernel, arch, log },
            Error::CudaLibrary { lib, msg } => Failure::Library { lib, msg },
            e => Failure::Other(e.to_string()),
        }
    }

    fn error(&self) -> Error {
        match self.clone() {
            Failure::Compile { kernel, arch, log } => Error::KernelCompile { kernel, arch, log },
            Failure::Library { lib, msg } => Error::CudaLibrary { lib, msg },
            Failure::Other(msg) => Error::CudaLibrary {
                lib: "libnvrtc",
                msg,
            },
        }
    }
}

/// One compiled (or cached) part, for [`records`].
#[derive(Debug, Clone, PartialEq)]
pub struct CompileRecord {
    /// The kernel file (`cuda/<file>.cu`).
    pub file: &'static str,
    /// The part ([`kernels::part_of`]).
    pub part: usize,
    /// `sm_XY` as XY.
    pub arch: u32,
    /// Seconds from the start of the compile (or the cache read) to the cubin.
    pub seconds: f64,
    /// Whether the cubin came from the disk cache.
    pub cached: bool,
    /// Whether a background thread compiled it (started by a request for another file).
    pub background: bool,
}

/// The parts of every kernel file for one architecture.
struct Parts {
    arch: u32,
    /// One slot per (file index in [`kernels::KERNELS`], part); filled once.
    slots: Vec<OnceLock<Outcome>>,
    /// Which parts' background compiles have been started.
    started: Mutex<[bool; PARTS]>,
}

fn registry() -> &'static Mutex<HashMap<u32, Arc<Parts>>> {
    static PARTS_BY_ARCH: OnceLock<Mutex<HashMap<u32, Arc<Parts>>>> = OnceLock::new();
    PARTS_BY_ARCH.get_or_init(Default::default)
}

fn records_list() -> &'static Mutex<Vec<CompileRecord>> {
    static RECORDS: OnceLock<Mutex<Vec<CompileRecord>>> = OnceLock::new();
    RECORDS.get_or_init(Default::default)
}

/// Every part compiled or read from the cache so far in this process, in the order they
/// finished.
pub fn records() -> Vec<CompileRecord> {
    lock(records_list()).clone()
}

fn parts_for(arch: u32) -> Arc<Parts> {
    lock(registry())
        .entry(arch)
        .or_insert_with(|| {
            Arc::new(Parts {
                arch,
                slots: (0..kernels::KERNELS.len() * PARTS)
                    .map(|_| OnceLock::new())
                    .collect(),
                started: Mutex::new([false; PARTS]),
            })
        })
        .clone()
}

impl Parts {
    /// The part's cubin: compiled here, or waited for when another thread compiles it.
    fn get(&self, file: usize, part: usize, background: bool) -> Outcome {
        self.slots[file * PARTS + part]
            .get_or_init(|| {
                let (name, _) = kernels::KERNELS[file];
                let start = Instant::now();
                let src = kernels::source(name).expect("listed kernel files have a source");
                let out = nvrtc::cubin_part(name, &src, self.arch, Some(part));
                let seconds = start.elapsed().as_secs_f64();
                let (bin, cached) = out.map_err(Failure::of)?;
                lock(records_list()).push(CompileRecord {
                    file: name,
                    part,
                    arch: self.arch,
                    seconds,
                    cached,
                    background,
                });
                Ok(Arc::new(bin))
            })
            .clone()
    }

    /// Starts part `part` of every file on background threads, once: one thread per core
    /// but one (the requester compiles its own file meanwhile), each taking the next file
    /// not yet taken. A file no thread reaches is compiled when it is asked for.
    fn start(self: &Arc<Self>, part: usize) {
        {
            let mut started = lock(&self.started);
            if started[part] {
                return;
            }
            started[part] = true;
        }
        let files = kernels::KERNELS.len();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let next = Arc::new(AtomicUsize::new(0));
        for worker in 0..files.min(cores.saturating_sub(1).max(1)) {
            let (parts, next) = (self.clone(), next.clone());
            let _ = std::thread::Builder::new()
                .name(format!("mantissa-nvrtc-{part}-{worker}"))
                .spawn(move || loop {
                    let file = next.fetch_add(1, Ordering::Relaxed);
                    if file >= files {
                        break;
                    }
                    let _ = parts.get(file, part, true);
                });
        }
    }
}

/// The cubin of part `part` of kernel file `file` (a name in [`kernels::KERNELS`]) for
/// `sm_{arch}`; the first request for a part starts that part of every other file in the
/// background.
pub fn cubin(file: &str, part: usize, arch: u32) -> Result<Arc<Vec<u8>>> {
    let index = kernels::KERNELS
        .iter()
        .position(|(n, _)| *n == file)
        .ok_or_else(|| Error::invalid("compile::cubin", format!("no kernel file {file}")))?;
    if part >= PARTS {
        let msg = format!("no part {part} (a file has {PARTS})");
        return Err(Error::invalid("compile::cubin", msg));
    }
    let parts = parts_for(arch);
    parts.start(part);
    let start = Instant::now();
    let out = parts.get(index, part, false).map_err(|f| f.error());
    let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    WAITED_NANOS.fetch_add(nanos, Ordering::Relaxed);
    out
}

/// Nanoseconds callers of [`cubin`] spent waiting for their part.
static WAITED_NANOS: AtomicU64 = AtomicU64::new(0);

/// How long this process's kernel requests waited for compiles (or cache reads) so far:
/// what compiling cost a run, the background's work that finished before it was needed
/// not counted.
pub fn waited() -> std::time::Duration {
    std::time::Duration::from_nanos(WAITED_NANOS.load(Ordering::Relaxed))
}

/// One line for a run's log: the parts compiled or read from the cache, and how long the
/// run waited for them (empty when no kernel was needed).
pub fn summary() -> String {
    let records = records();
    if records.is_empty() {
        return String::new();
    }
    let cached = records.iter().filter(|r| r.cached).count();
    let cpu: f64 = records.iter().map(|r| r.seconds).sum();
    format!(
        "kernels: {} parts ready ({cached} from the disk cache, {cpu:.2} s of compiling), \
         the run waited {:.2} s for them",
        records.len(),
        waited().as_secs_f64()
    )
}

/// Starts the given parts of every kernel file compiling in the background (what a first
/// request does for its part), for a caller that knows it will need them.
pub fn prefetch(arch: u32, parts: &[usize]) {
    let all = parts_for(arch);
    for &p in parts.iter().filter(|&&p| p < PARTS) {
        all.start(p);
    }
}
