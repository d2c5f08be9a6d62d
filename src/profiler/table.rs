//! The key_averages-style tables of a profile: ops and kernels, and the per-step summary with
//! the memory at the peak.

use super::report::{KernelStat, OpStat, Profile};
use std::fmt::Write;

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
