//! The Chrome trace of a profile (the JSON "trace event" format that Perfetto and
//! chrome://tracing open): host ops per thread, each launch inside its op on the same track,
//! and the device's work per device on a track of its own, a launch and its device work
//! sharing a `correlation` number.

use super::report::Profile;
use super::session::DeviceWork;
use crate::{Device, Error, Result};
use std::fmt::Write;

/// Appends `s` as a JSON string.
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

/// The process id of a track: the host is 0, device `cuda:n` is `n + 1`.
fn pid(d: Device) -> usize {
    match d {
        Device::Cpu => 0,
        Device::Cuda(n) => n + 1,
    }
}

struct Event<'a> {
    name: &'a str,
    cat: &'a str,
    pid: usize,
    tid: u64,
    ts: u64,
    dur: u64,
    args: Vec<(&'a str, String)>,
}

fn event(out: &mut String, e: &Event) {
    if !out.ends_with('[') {
        out.push_str(",\n");
    }
    out.push_str("{\"name\":");
    json_str(out, e.name);
    out.push_str(",\"cat\":");
    json_str(out, e.cat);
    let _ = write!(
        out,
        ",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{},\"args\":{{",
        e.pid,
        e.tid,
        us(e.ts),
        us(e.dur)
    );
    for (k, (key, v)) in e.args.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        json_str(out, key);
        out.push(':');
        json_str(out, v);
    }
    out.push_str("}}");
}

fn meta(out: &mut String, what: &str, pid: usize, tid: u64, name: &str) {
    if !out.ends_with('[') {
        out.push_str(",\n");
    }
    let _ = write!(
        out,
        "{{\"name\":\"{what}\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"ts\":0,\"dur\":0,\"args\":{{\"name\":"
    );
    json_str(out, name);
    out.push_str("}}");
}

impl Profile {
    /// The profile as Chrome trace JSON (see [`Profile::export_chrome_trace`]).
    pub fn chrome_trace_json(&self) -> String {
        let mut out = String::from("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
        meta(&mut out, "process_name", 0, 0, "host");
        let mut threads: Vec<u64> = self.trace_ops.iter().map(|o| o.thread).collect();
        threads.extend(self.trace_work.iter().map(|w| w.thread));
        threads.sort_unstable();
        threads.dedup();
        for t in &threads {
            meta(&mut out, "thread_name", 0, *t, &format!("thread {t}"));
        }
        let mut devices: Vec<Device> = self
            .trace_work
            .iter()
            .filter(|w| w.on_device.is_some())
            .map(|w| w.device)
            .collect();
        devices.sort_by_key(|d| pid(*d));
        devices.dedup();
        for d in &devices {
            meta(&mut out, "process_name", pid(*d), 0, &format!("{d}"));
            meta(&mut out, "thread_name", pid(*d), 1, "stream");
        }
        for o in &self.trace_ops {
            let e = Event {
                name: &o.name,
                cat: "op",
                pid: 0,
                tid: o.thread,
                ts: o.start_ns,
                dur: o.end_ns - o.start_ns,
                args: Vec::new(),
            };
            event(&mut out, &e);
        }
        for (k, w) in self.trace_work.iter().enumerate() {
            let mut args = vec![("correlation", k.to_string())];
            if let Some(op) = w.op {
                args.push(("op", self.trace_ops[op].name.clone()));
            }
            if let Some((g, b)) = w.config {
                args.push(("grid", g.to_string()));
                args.push(("block", b.to_string()));
            }
            if let Some(b) = w.bytes {
                args.push(("bytes", b.to_string()));
            }
            let cat = w.work.label();
            let launch = format!("launch {}", w.name);
            event(
                &mut out,
                &Event {
                    name: if w.work == DeviceWork::Kernel {
                        &launch
                    } else {
                        &w.name
                    },
                    cat: "launch",
                    pid: 0,
                    tid: w.thread,
                    ts: w.host.0,
                    dur: w.host.1 - w.host.0,
                    args: args.clone(),
                },
            );
            if let Some((a, b)) = w.on_device {
                event(
                    &mut out,
                    &Event {
                        name: &w.name,
                        cat,
                        pid: pid(w.device),
                        tid: 1,
                        ts: a,
                        dur: b - a,
                        args,
                    },
                );
            }
        }
        out.push_str("]}\n");
        out
    }

    /// Writes the Chrome trace to `path` (open it in Perfetto or chrome://tracing).
    pub fn export_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.chrome_trace_json())
            .map_err(|e| Error::io("Profile::export_chrome_trace", path, e))
    }
}
