//! A stopped profile: the records aggregated per op, per kernel and per step, the memory at
//! the peak, and the key_averages-style table.

use super::session::{DeviceMemory, DeviceWork, Pass, Session};
use crate::{Device, Error, Result};
use std::collections::HashMap;
use std::fmt::Write;

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
    /// The allocator's allocated bytes at the peak (size classes, as it counts them).
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
}

/// A stopped profile.
#[derive(Debug, Clone)]
pub struct Profile {
    ops: Vec<OpStat>,
    kernels: Vec<KernelStat>,
    steps: Vec<StepStat>,
    memory: Vec<MemoryAtPeak>,
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
        if let Some(op) = w.op {
            let name = op_name(s.ops[op].name, s.ops[op].pass);
            if !e.ops.contains(&name) {
                e.ops.push(name);
            }
        }
    }
    for (r, w) in s.records.iter().zip(work) {
        if let Some(f) = r.launch.flops {
            if let Some(e) = by_name.get_mut(&(w.name.as_str(), w.work)) {
                *e.flops.get_or_insert(0) += f;
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

/// The order of [`Profile::table`]'s rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortBy {
    /// Device time (ops: with nested ops'), largest first; host time breaks ties.
    DeviceTime,
    /// Host time, largest first.
    HostTime,
    /// Calls, most first.
    Count,
}

fn ms(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
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

    /// The ops and kernels as two key_averages-style tables, `top` rows each.
    pub fn table(&self, sort_by: SortBy, top: usize) -> String {
        let device_total: u64 = self
            .kernels
            .iter()
            .filter_map(|k| k.device.map(|d| d.total_ns))
            .sum();
        let share = |ns: u64| match device_total {
            0 => "-".to_string(),
            t => format!("{:.1}%", ns as f64 * 100.0 / t as f64),
        };
        let mut ops: Vec<&OpStat> = self.ops.iter().collect();
        ops.sort_by(|a, b| match sort_by {
            SortBy::DeviceTime => {
                (b.device_ns, b.host.total_ns).cmp(&(a.device_ns, a.host.total_ns))
            }
            SortBy::HostTime => b.host.total_ns.cmp(&a.host.total_ns),
            SortBy::Count => b.count.cmp(&a.count),
        });
        let mut t = String::new();
        // Host-only profiles (the CPU) leave out the device columns.
        if self.kernels.is_empty() {
            let _ = writeln!(
                t,
                "{:<28} {:>7} {:>11} {:>10} {:>10} {:>10}",
                "op", "calls", "host ms", "mean us", "min us", "max us"
            );
            for o in ops.iter().take(top) {
                let us = |ns: f64| format!("{:.1}", ns / 1e3);
                let _ = writeln!(
                    t,
                    "{:<28} {:>7} {:>11} {:>10} {:>10} {:>10}",
                    trim(&o.name, 28),
                    o.count,
                    ms(o.host.total_ns),
                    us(o.host.mean_ns()),
                    us(o.host.min_ns as f64),
                    us(o.host.max_ns as f64)
                );
            }
            return t;
        }
        let _ = writeln!(
            t,
            "{:<28} {:>7} {:>11} {:>10} {:>11} {:>11} {:>7} {:>8} {:>6}",
            "op",
            "calls",
            "host ms",
            "host mean",
            "device ms",
            "self dev",
            "share",
            "launches",
            "libs"
        );
        for o in ops.iter().take(top) {
            let _ = writeln!(
                t,
                "{:<28} {:>7} {:>11} {:>10} {:>11} {:>11} {:>7} {:>8} {:>6}",
                trim(&o.name, 28),
                o.count,
                ms(o.host.total_ns),
                format!("{:.1}us", o.host.mean_ns() / 1e3),
                ms(o.device_ns),
                ms(o.self_device_ns),
                share(o.self_device_ns),
                o.launches,
                o.library_calls
            );
        }
        let mut ks: Vec<&KernelStat> = self.kernels.iter().collect();
        let dev = |k: &KernelStat| k.device.map_or(0, |d| d.total_ns);
        ks.sort_by(|a, b| match sort_by {
            SortBy::DeviceTime => (dev(b), b.host.total_ns).cmp(&(dev(a), a.host.total_ns)),
            SortBy::HostTime => b.host.total_ns.cmp(&a.host.total_ns),
            SortBy::Count => b.count.cmp(&a.count),
        });
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "{:<44} {:>6} {:>10} {:>9} {:>9} {:>9} {:>7} {:>14} {:>8} {:>8}",
            "kernel / call",
            "calls",
            "device ms",
            "mean us",
            "min us",
            "max us",
            "share",
            "grid x block",
            "GB/s",
            "TFLOP/s"
        );
        for k in ks.iter().take(top) {
            let d = k.device.unwrap_or_default();
            let us = |ns: u64| format!("{:.1}", ns as f64 / 1e3);
            let _ = writeln!(
                t,
                "{:<44} {:>6} {:>10} {:>9} {:>9} {:>9} {:>7} {:>14} {:>8} {:>8}",
                trim(&k.name, 44),
                k.count,
                ms(d.total_ns),
                format!("{:.1}", d.mean_ns() / 1e3),
                us(d.min_ns),
                us(d.max_ns),
                share(d.total_ns),
                k.config.clone().unwrap_or_else(|| "-".into()),
                k.gb_per_s().map_or("-".into(), |g| format!("{g:.0}")),
                k.tflop_per_s().map_or("-".into(), |f| format!("{f:.1}"))
            );
        }
        t
    }

    /// The per-step summary (one row per step) and the memory at the peak, as text.
    pub fn step_table(&self) -> String {
        let mib = |b: usize| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:>4} {:>10} {:>11} {:>9} {:>6} {:>12} {:>12} {:>11} {:>12}",
            "step",
            "host ms",
            "device ms",
            "launches",
            "libs",
            "HtoD",
            "DtoH",
            "peak MiB",
            "reserved MiB"
        );
        for (i, s) in self.steps.iter().enumerate() {
            let copies = |n: u64, b: u64| format!("{n} / {:.1}M", b as f64 / 1e6);
            let _ = writeln!(
                t,
                "{:>4} {:>10} {:>11} {:>9} {:>6} {:>12} {:>12} {:>11} {:>12}",
                i,
                ms(s.host_ns),
                ms(s.device_busy_ns),
                s.launches,
                s.library_calls,
                copies(s.h2d_copies, s.h2d_bytes),
                copies(s.d2h_copies, s.d2h_bytes),
                mib(s.peak_allocated),
                mib(s.peak_reserved)
            );
        }
        for m in &self.memory {
            let _ = writeln!(
                t,
                "\nmemory at the peak on {} (step {}): {}",
                m.device,
                m.step,
                bytes(m.peak_allocated)
            );
            for (name, b) in &m.by_op {
                let _ = writeln!(t, "  {:<40} {:>12}", trim(name, 40), bytes(*b));
            }
        }
        t
    }
}

/// `b` bytes in the largest binary unit that keeps a leading digit (`3.5 KiB`).
fn bytes(b: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{b} B"),
        _ => format!("{v:.1} {}", units[u]),
    }
}

fn trim(s: &str, n: usize) -> String {
    match s.chars().count() <= n {
        true => s.to_string(),
        false => s.chars().take(n.saturating_sub(1)).chain(['~']).collect(),
    }
}
