//! A stopped profile: the records aggregated per op, per kernel and per step, and the memory
//! at the peak (`table.rs` prints them, `trace.rs` writes the trace).

use super::session::{DeviceMemory, DeviceWork, Pass, Session};
use crate::{Device, Error, Result};
use std::collections::HashMap;

/// Count and total, min and max of a set of durations (nanoseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeStat {
    pub count: u64,
    pub total_ns: u64,
    pub min_ns: u64,
    pub max_ns: u64,
}

impl TimeStat {
    fn add(&mut self, ns: u64) {
        self.min_ns = if self.count == 0 {
            ns
        } else {
            self.min_ns.min(ns)
        };
        self.max_ns = self.max_ns.max(ns);
        self.count += 1;
        self.total_ns += ns;
    }

    /// The mean duration in nanoseconds (0 with no samples).
    pub fn mean_ns(&self) -> f64 {
        match self.count {
            0 => 0.0,
            c => self.total_ns as f64 / c as f64,
        }
    }
}

/// One op (by name and pass) over the whole profile.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OpStat {
    /// The op's name; a backward is `name.backward`.
    pub name: String,
    pub pass: Pass,
    pub count: u64,
    /// Host time of the op's span, nested ops included.
    pub host: TimeStat,
    /// Device time of the work the op and the ops inside it queued.
    pub device_ns: u64,
    /// Device time of the work queued by the op itself, not by ops inside it.
    pub self_device_ns: u64,
    /// Kernel launches of ours (nested ops included), and cuBLAS/cuDNN calls.
    pub launches: u64,
    pub library_calls: u64,
}

/// One kernel, library call or copy kind (by name) over the whole profile.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KernelStat {
    pub name: String,
    pub work: DeviceWork,
    pub count: u64,
    /// Host time to queue it (the launch).
    pub host: TimeStat,
    /// Device time, where the device recorded events.
    pub device: Option<TimeStat>,
    /// `grid x block` of our kernels' launches (the last one's, with `+` when they vary).
    pub config: Option<String>,
    /// Bytes moved and floating-point operations, summed, where the launch site knows them.
    pub bytes: Option<u64>,
    pub flops: Option<u64>,
    /// The ops that queued it.
    pub ops: Vec<String>,
}

impl KernelStat {
    /// Achieved bandwidth over the device time (GB/s), where bytes and device time are known.
    pub fn gb_per_s(&self) -> Option<f64> {
        let t = self.device.filter(|d| d.total_ns > 0)?;
        Some(self.bytes? as f64 / t.total_ns as f64)
    }

    /// Achieved TFLOP/s over the device time, where FLOPs and device time are known.
    pub fn tflop_per_s(&self) -> Option<f64> {
        let t = self.device.filter(|d| d.total_ns > 0)?;
        Some(self.flops? as f64 / t.total_ns as f64 / 1e3)
    }
}

/// One marked step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepStat {
    pub host_ns: u64,
    /// Device time of the step's recorded work (the union of its intervals).
    pub device_busy_ns: u64,
    pub launches: u64,
    pub library_calls: u64,
    pub h2d_copies: u64,
    pub h2d_bytes: u64,
    pub d2h_copies: u64,
    pub d2h_bytes: u64,
    /// Device allocators' peak allocated and reserved bytes in the step (summed over devices).
    pub peak_allocated: usize,
    pub peak_reserved: usize,
}

/// Who held a device's memory at its peak allocation in the profile.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MemoryAtPeak {
    pub device: Device,
    /// The allocator's allocated bytes at the peak (block sizes, as it counts them).
    pub peak_allocated: usize,
    /// The step the peak fell in.
    pub step: usize,
    /// Live bytes by the op that allocated them, largest first; blocks allocated before the
    /// profile or outside any op are `(before the profile or outside ops)`.
    pub by_op: Vec<(String, usize)>,
}

/// The label of memory no op of the profile allocated.
pub const OUTSIDE_OPS: &str = "(before the profile or outside ops)";

/// A host span of the trace.
#[derive(Debug, Clone)]
pub(crate) struct TraceOp {
    pub name: String,
    pub thread: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// A device record of the trace.
#[derive(Debug, Clone)]
pub(crate) struct TraceWork {
    pub name: String,
    pub work: DeviceWork,
    pub device: Device,
    pub op: Option<usize>,
    pub thread: u64,
    pub host: (u64, u64),
    pub on_device: Option<(u64, u64)>,
    pub config: Option<(u32, u32)>,
    pub bytes: Option<u64>,
    pub flops: Option<u64>,
}

/// A stopped profile.
#[derive(Debug, Clone)]
pub struct Profile {
    pub(super) ops: Vec<OpStat>,
    pub(super) kernels: Vec<KernelStat>,
    pub(super) steps: Vec<StepStat>,
    pub(super) memory: Vec<MemoryAtPeak>,
    pub(crate) trace_ops: Vec<TraceOp>,
    pub(crate) trace_work: Vec<TraceWork>,
}

fn op_name(name: &str, pass: Pass) -> String {
    match pass {
        Pass::Forward => name.to_string(),
        Pass::Backward => format!("{name}.backward"),
    }
}

/// Aggregates a stopped session; reads the device timers (which waits for the devices).
pub(crate) fn build(s: Session) -> Result<Profile> {
    let end = s.now();
    let mut trace_ops = Vec::with_capacity(s.ops.len());
    for o in &s.ops {
        trace_ops.push(TraceOp {
            name: op_name(o.name, o.pass),
            thread: o.thread,
            start_ns: o.start_ns,
            end_ns: o.end_ns.unwrap_or(end),
        });
    }
    let mut trace_work = Vec::with_capacity(s.records.len());
    for r in &s.records {
        let on_device = match (&r.timer, s.bases.get(&r.launch.device)) {
            (Some(t), Some((base, _))) => {
                let (a, b) = t.elapsed_ms().map_err(|msg| Error::CudaDriver {
                    op: "reading the profile's events",
                    device: r.launch.device,
                    msg,
                })?;
                let at = |ms: f64| base + (ms.max(0.0) * 1e6) as u64;
                Some((at(a), at(b).max(at(a))))
            }
            _ => None,
        };
        trace_work.push(TraceWork {
            name: r.launch.name.clone(),
            work: r.launch.work,
            device: r.launch.device,
            op: r.op,
            thread: r.thread,
            host: (r.host_start_ns, r.host_end_ns),
            on_device,
            config: r.launch.config,
            bytes: r.launch.bytes,
            flops: r.launch.flops,
        });
    }
    let ops = op_stats(&s, &trace_ops, &trace_work);
    let kernels = kernel_stats(&s, &trace_work);
    let steps = step_stats(&s, &trace_work);
    let mut memory: Vec<MemoryAtPeak> = s
        .memory
        .iter()
        .filter(|(_, m)| m.peak > 0)
        .map(|(&device, m)| memory_at_peak(&s, device, m))
        .collect();
    memory.sort_by_key(|m| format!("{}", m.device));
    Ok(Profile {
        ops,
        kernels,
        steps,
        memory,
        trace_ops,
        trace_work,
    })
}

fn op_stats(s: &Session, trace_ops: &[TraceOp], work: &[TraceWork]) -> Vec<OpStat> {
    // Per record: device time and launches, self and with nested ops'.
    let n = s.ops.len();
    let (mut self_dev, mut total_dev) = (vec![0u64; n], vec![0u64; n]);
    let (mut launches, mut calls) = (vec![0u64; n], vec![0u64; n]);
    for w in work {
        let dev = w.on_device.map_or(0, |(a, b)| b - a);
        if let Some(i) = w.op {
            self_dev[i] += dev;
        }
        let mut at = w.op;
        while let Some(i) = at {
            total_dev[i] += dev;
            match w.work {
                DeviceWork::Kernel => launches[i] += 1,
                DeviceWork::Library => calls[i] += 1,
                DeviceWork::Graph { kernels, calls: c } => {
                    launches[i] += u64::from(kernels);
                    calls[i] += u64::from(c);
                }
                _ => {}
            }
            at = s.ops[i].parent;
        }
    }
    let mut by_name: HashMap<(&'static str, Pass), OpStat> = HashMap::new();
    for (i, o) in s.ops.iter().enumerate() {
        let e = by_name.entry((o.name, o.pass)).or_insert_with(|| OpStat {
            name: op_name(o.name, o.pass),
            pass: o.pass,
            count: 0,
            host: TimeStat::default(),
            device_ns: 0,
            self_device_ns: 0,
            launches: 0,
            library_calls: 0,
        });
        e.count += 1;
        e.host.add(trace_ops[i].end_ns - trace_ops[i].start_ns);
        e.device_ns += total_dev[i];
        e.self_device_ns += self_dev[i];
        e.launches += launches[i];
        e.library_calls += calls[i];
    }
    let mut v: Vec<OpStat> = by_name.into_values().collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

fn kernel_stats(s: &Session, work: &[TraceWork]) -> Vec<KernelStat> {
    let mut by_name: HashMap<(&str, DeviceWork), KernelStat> = HashMap::new();
    for w in work {
        let e = by_name
            .entry((w.name.as_str(), w.work))
            .or_insert_with(|| KernelStat {
                name: w.name.clone(),
                work: w.work,
                count: 0,
                host: TimeStat::default(),
                device: None,
                config: None,
                bytes: None,
                flops: None,
                ops: Vec::new(),
            });
        e.count += 1;
        e.host.add(w.host.1 - w.host.0);
        if let Some((a, b)) = w.on_device {
            e.device.get_or_insert_with(TimeStat::default).add(b - a);
        }
        if let Some((g, b)) = w.config {
            let c = format!("{g} x {b}");
            e.config = match e.config.take() {
                Some(prev) if prev.trim_end_matches('+') != c => Some(format!("{c}+")),
                Some(prev) => Some(prev),
                None => Some(c),
            };
        }
        if let Some(b) = w.bytes {
            *e.bytes.get_or_insert(0) += b;
        }
        if let Some(f) = w.flops {
            *e.flops.get_or_insert(0) += f;
        }
        if let Some(op) = w.op {
            let name = op_name(s.ops[op].name, s.ops[op].pass);
            if !e.ops.contains(&name) {
                e.ops.push(name);
            }
        }
    }
    let mut v: Vec<KernelStat> = by_name.into_values().collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// The total length of the union of `spans`.
fn union_ns(mut spans: Vec<(u64, u64)>) -> u64 {
    spans.sort_unstable();
    let (mut total, mut cur): (u64, Option<(u64, u64)>) = (0, None);
    for (a, b) in spans {
        cur = match cur {
            Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
            Some((ca, cb)) => {
                total += cb - ca;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map_or(0, |(a, b)| b - a)
}

fn step_stats(s: &Session, work: &[TraceWork]) -> Vec<StepStat> {
    let mut steps: Vec<StepStat> = vec![StepStat::default(); s.step_ends.len()];
    let mut busy: Vec<Vec<(u64, u64)>> = vec![Vec::new(); steps.len()];
    for (k, st) in steps.iter_mut().enumerate() {
        let start = if k == 0 { 0 } else { s.step_ends[k - 1] };
        st.host_ns = s.step_ends[k] - start;
    }
    for (r, w) in s.records.iter().zip(work) {
        let Some(st) = steps.get_mut(r.step) else {
            continue;
        };
        let bytes = w.bytes.unwrap_or(0);
        match w.work {
            DeviceWork::Kernel => st.launches += 1,
            DeviceWork::Library => st.library_calls += 1,
            DeviceWork::HostToDevice => {
                st.h2d_copies += 1;
                st.h2d_bytes += bytes;
            }
            DeviceWork::DeviceToHost => {
                st.d2h_copies += 1;
                st.d2h_bytes += bytes;
            }
            DeviceWork::DeviceToDevice => {}
            DeviceWork::Graph { kernels, calls } => {
                st.launches += u64::from(kernels);
                st.library_calls += u64::from(calls);
            }
        }
        if let Some(d) = w.on_device {
            busy[r.step].push(d);
        }
    }
    for (st, b) in steps.iter_mut().zip(busy) {
        st.device_busy_ns = union_ns(b);
    }
    for m in s.memory.values() {
        for (st, &(a, r)) in steps.iter_mut().zip(&m.step_peaks) {
            st.peak_allocated += a;
            st.peak_reserved += r;
        }
    }
    steps
}

fn memory_at_peak(s: &Session, device: Device, m: &DeviceMemory) -> MemoryAtPeak {
    let mut by_op: Vec<(String, usize)> = m
        .peak_by_owner
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|&(o, b)| {
            let (name, pass) = s.owners[o as usize];
            (op_name(name, pass), b)
        })
        .collect();
    let attributed: usize = by_op.iter().map(|(_, b)| b).sum();
    if m.peak > attributed {
        by_op.push((OUTSIDE_OPS.to_string(), m.peak - attributed));
    }
    by_op.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    MemoryAtPeak {
        device,
        peak_allocated: m.peak,
        step: m.peak_step,
        by_op,
    }
}

impl Profile {
    /// Every op seen, by name (a backward is `name.backward`).
    pub fn ops(&self) -> &[OpStat] {
        &self.ops
    }

    /// The op called `name`, if it ran.
    pub fn op(&self, name: &str) -> Option<&OpStat> {
        self.ops.iter().find(|o| o.name == name)
    }

    /// Every kernel, library call and copy kind seen, by name.
    pub fn kernels(&self) -> &[KernelStat] {
        &self.kernels
    }

    /// The marked steps (and a last partial one when work followed the last mark).
    pub fn steps(&self) -> &[StepStat] {
        &self.steps
    }

    /// Per device: who held the memory at the peak.
    pub fn memory_at_peak(&self) -> &[MemoryAtPeak] {
        &self.memory
    }

    /// Our kernel launches in the whole profile.
    pub fn launches(&self) -> u64 {
        self.steps.iter().map(|s| s.launches).sum()
    }
}
