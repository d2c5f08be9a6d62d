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
//! The background threads are budgeted by the cores this process may use ([`worker_budget`])
//! and joined before the process exits ([`shutdown`]).
//!
//! [`records`] lists what was compiled or read from the cache, and how long it took.

use super::{kernels, nvrtc};
use crate::sync::lock;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

    /// Starts part `part` of every file on background threads, once: [`worker_budget`]
    /// threads, each taking the next file not yet taken, until [`shutdown`]. A file no
    /// thread reaches is compiled when it is asked for.
    fn start(self: &Arc<Self>, part: usize) {
        {
            let mut started = lock(&self.started);
            if started[part] {
                return;
            }
            started[part] = true;
        }
        let mut workers = lock(workers());
        if workers.stopped {
            return;
        }
        at_exit_shutdown();
        let files = kernels::KERNELS.len();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let next = Arc::new(AtomicUsize::new(0));
        for worker in 0..files.min(worker_budget(cores, local_processes())) {
            let (parts, next) = (self.clone(), next.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("mantissa-nvrtc-{part}-{worker}"))
                .spawn(move || loop {
                    if STOP.load(Ordering::Acquire) {
                        break;
                    }
                    let file = next.fetch_add(1, Ordering::Relaxed);
                    if file >= files {
                        break;
                    }
                    let _ = parts.get(file, part, true);
                });
            if let Ok(handle) = spawned {
                workers.handles.push(handle);
            }
        }
    }
}

/// The background compile threads started so far, joined by [`shutdown`].
#[derive(Default)]
struct Workers {
    handles: Vec<std::thread::JoinHandle<()>>,
    stopped: bool,
}

fn workers() -> &'static Mutex<Workers> {
    static WORKERS: OnceLock<Mutex<Workers>> = OnceLock::new();
    WORKERS.get_or_init(Default::default)
}

/// Set by [`shutdown`]: a background thread takes no new file.
static STOP: AtomicBool = AtomicBool::new(false);

/// How many background compile threads a process starts: one per core it may use, but one
/// (the requester compiles its own file meanwhile), at least one. A process that shares the
/// machine with `local` ranks of a job (a launcher's) takes its share of the cores, so that
/// 8 ranks do not start 8 x (cores - 1) compiles.
pub fn worker_budget(cores: usize, local: usize) -> usize {
    (cores / local.max(1)).saturating_sub(1).max(1)
}

/// The processes of this job on this machine, as the launchers say (torchrun's
/// `LOCAL_WORLD_SIZE`, Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, Slurm's
/// `SLURM_NTASKS_PER_NODE`, or the first count of `SLURM_TASKS_PER_NODE` such as `4(x2)`);
/// 1 without a launcher.
fn local_processes() -> usize {
    local_processes_from(|k| std::env::var(k).ok())
}

fn local_processes_from(get: impl Fn(&str) -> Option<String>) -> usize {
    [
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
    ]
    .iter()
    .find_map(|k| {
        let v = get(k)?;
        let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<usize>().ok().filter(|&n| n > 0)
    })
    .unwrap_or(1)
}

/// Stops the background compiles and waits for those under way (a compile cannot be
/// interrupted; none starts after this): what a process does before it exits, so that it
/// never leaves while NVRTC is mid-compile on another thread (its static destructors would
/// then run under that compile). Registered to run at exit with the first background
/// compile; requests for a part still compile it, on the requesting thread.
pub fn shutdown() {
    STOP.store(true, Ordering::Release);
    let handles = {
        let mut w = lock(workers());
        w.stopped = true;
        std::mem::take(&mut w.handles)
    };
    for h in handles {
        let _ = h.join();
    }
}

/// Background compile threads started and not yet joined.
pub fn background_threads() -> usize {
    lock(workers())
        .handles
        .iter()
        .filter(|h| !h.is_finished())
        .count()
}

/// Registers [`shutdown`] with the C library's `atexit`, once, after NVRTC is loaded (its
/// static destructors were registered when it was loaded: handlers run in the reverse order,
/// so the compiles are joined before NVRTC's destructors run).
fn at_exit_shutdown() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    extern "C" fn on_exit() {
        shutdown();
    }
    ONCE.call_once(|| {
        // Loaded now if it was not yet: then its destructors come before the handler.
        let _ = nvrtc::version();
        // SAFETY: registers a plain function without arguments; it only joins threads.
        unsafe { libc::atexit(on_exit) };
    });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_of_a_machine_share_its_cores() {
        assert_eq!(worker_budget(16, 1), 15);
        assert_eq!(worker_budget(16, 8), 1);
        assert_eq!(worker_budget(16, 4), 3);
        assert_eq!(worker_budget(2, 1), 1);
        assert_eq!(worker_budget(1, 1), 1);
        assert_eq!(worker_budget(4, 0), 3);
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_processes_from(env(&[])), 1);
        assert_eq!(local_processes_from(env(&[("LOCAL_WORLD_SIZE", "8")])), 8);
        assert_eq!(
            local_processes_from(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "4")])),
            4
        );
        assert_eq!(
            local_processes_from(env(&[("SLURM_TASKS_PER_NODE", "4(x2)")])),
            4
        );
        assert_eq!(local_processes_from(env(&[("LOCAL_WORLD_SIZE", "x")])), 1);
    }

    #[test]
    fn shutdown_joins_the_background_compiles_and_requests_still_compile() {
        // Without NVRTC the compiles fail at once; with it they run: either way shutdown
        // returns only once no background thread is left, and none starts afterwards.
        prefetch(80, &[1]);
        shutdown();
        assert_eq!(background_threads(), 0);
        prefetch(80, &[2]);
        assert_eq!(background_threads(), 0);
        assert!(lock(workers()).handles.is_empty());
        // A request compiles its part on the calling thread (or says why it cannot).
        let _ = cubin("cast", 2, 80);
        assert_eq!(background_threads(), 0);
    }
}
