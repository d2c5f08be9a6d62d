//! What a running profile records: op spans per thread, kernel launches, library calls and
//! copies with their device timers, step marks, and the device allocators' live bytes grouped
//! by the op that allocated them.

use crate::Device;
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Which pass an op span belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// The op itself (forward, or an optimizer step).
    Forward,
    /// The op's backward, run by `backward()`.
    Backward,
}

/// What a device record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceWork {
    /// One of our kernels (`cuda/*.cu`), one launch.
    Kernel,
    /// A cuBLAS, cuBLASLt or cuDNN call (which may launch several kernels of its own).
    Library,
    /// A host-to-device copy.
    HostToDevice,
    /// A device-to-host copy.
    DeviceToHost,
    /// A copy within the device.
    DeviceToDevice,
    /// A CUDA graph's replay ([`crate::graph::CapturedStep`]): one record for the whole
    /// step, with the kernel launches and library calls it holds.
    Graph { kernels: u32, calls: u32 },
}

impl DeviceWork {
    pub fn label(self) -> &'static str {
        match self {
            DeviceWork::Kernel => "kernel",
            DeviceWork::Library => "library",
            DeviceWork::HostToDevice => "copy HtoD",
            DeviceWork::DeviceToHost => "copy DtoH",
            DeviceWork::DeviceToDevice => "copy DtoD",
            DeviceWork::Graph { .. } => "graph replay",
        }
    }
}

/// Reads a device record's start and end, in milliseconds after its device's base mark
/// (called once, when the profile stops).
pub(crate) trait DeviceTimer: Send {
    fn elapsed_ms(&self) -> std::result::Result<(f64, f64), String>;
}

pub(crate) struct OpRecord {
    pub name: &'static str,
    pub pass: Pass,
    pub thread: u64,
    pub parent: Option<usize>,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
    pub step: usize,
}

/// What a launch site tells about its work.
pub(crate) struct Launch {
    pub name: String,
    pub work: DeviceWork,
    pub device: Device,
    /// Grid and block (x only: every launch of ours is one-dimensional).
    pub config: Option<(u32, u32)>,
    pub bytes: Option<u64>,
    pub flops: Option<u64>,
}

pub(crate) struct DeviceRecord {
    pub launch: Launch,
    pub op: Option<usize>,
    pub thread: u64,
    pub step: usize,
    pub host_start_ns: u64,
    pub host_end_ns: u64,
    pub timer: Option<Box<dyn DeviceTimer>>,
}

/// An allocator's view within one profile.
#[derive(Default)]
pub(crate) struct DeviceMemory {
    pub allocated: usize,
    pub reserved: usize,
    /// Live bytes allocated while profiling, by owner (op) index.
    pub by_owner: HashMap<u32, usize>,
    pub peak: usize,
    pub peak_step: usize,
    pub peak_by_owner: Vec<(u32, usize)>,
    /// Per step: the peak allocated and reserved bytes.
    pub step_peaks: Vec<(usize, usize)>,
}

impl DeviceMemory {
    pub fn step_peak(&mut self, step: usize) -> &mut (usize, usize) {
        while self.step_peaks.len() <= step {
            self.step_peaks.push((self.allocated, self.reserved));
        }
        &mut self.step_peaks[step]
    }
}

pub(crate) struct Session {
    pub id: u64,
    pub t0: Instant,
    pub ops: Vec<OpRecord>,
    pub records: Vec<DeviceRecord>,
    /// Host time at the end of each marked step.
    pub step_ends: Vec<u64>,
    pub memory: HashMap<Device, DeviceMemory>,
    /// Owners of memory: op names with their pass, interned.
    pub owners: Vec<(&'static str, Pass)>,
    owner_ids: HashMap<(&'static str, Pass), u32>,
    /// Per device: the host time of its base mark and the backend's handle for it.
    pub bases: HashMap<Device, (u64, Arc<dyn Any + Send + Sync>)>,
}

impl Session {
    pub fn new(id: u64) -> Session {
        Session {
            id,
            t0: Instant::now(),
            ops: Vec::new(),
            records: Vec::new(),
            step_ends: Vec::new(),
            memory: HashMap::new(),
            owners: Vec::new(),
            owner_ids: HashMap::new(),
            bases: HashMap::new(),
        }
    }

    pub fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    pub fn step(&self) -> usize {
        self.step_ends.len()
    }

    pub fn owner(&mut self, key: (&'static str, Pass)) -> u32 {
        let next = self.owners.len() as u32;
        *self.owner_ids.entry(key).or_insert_with(|| {
            self.owners.push(key);
            next
        })
    }

    /// The allocator of `device` now holds `allocated` and `reserved` bytes, after a block of
    /// `size` was allocated (`delta` > 0) or freed by `owner` (None: allocated before the
    /// profile, or outside any op).
    pub fn memory_change(
        &mut self,
        device: Device,
        owner: Option<u32>,
        size: usize,
        alloc: bool,
        allocated: usize,
        reserved: usize,
    ) {
        let step = self.step();
        let m = self.memory.entry(device).or_default();
        m.allocated = allocated;
        m.reserved = reserved;
        if let Some(o) = owner {
            let live = m.by_owner.entry(o).or_insert(0);
            *live = match alloc {
                true => *live + size,
                false => live.saturating_sub(size),
            };
        }
        let sp = m.step_peak(step);
        sp.0 = sp.0.max(allocated);
        sp.1 = sp.1.max(reserved);
        if alloc && allocated > m.peak {
            m.peak = allocated;
            m.peak_step = step;
            m.peak_by_owner = m.by_owner.iter().map(|(&o, &b)| (o, b)).collect();
        }
    }
}
