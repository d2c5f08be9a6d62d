//! The source tree's structure (ARCHITECTURE.md): neither backend imports the other, the
//! folders of `src/` import each other without cycles, and files stay small enough to read in
//! one sitting. Read from the source text: `crate::...` paths outside unit-test modules.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `src/` as (path relative to `src/`, text without line comments and
/// without its trailing `#[cfg(test)] mod tests`).
fn sources() -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(src())
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let text = fs::read_to_string(&p).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let code: String = code
                .lines()
                .map(|l| l.split("//").next().unwrap())
                .collect::<Vec<_>>()
                .join("\n");
            (rel, code)
        })
        .collect()
}

/// The top-level module a file belongs to: its folder, or the file's own name at the root.
fn unit(rel: &str) -> String {
    match rel.split_once('/') {
        Some((folder, _)) => folder.to_string(),
        None => rel.trim_end_matches(".rs").to_string(),
    }
}

/// The crate-root names re-exported from elsewhere, with the module they come from.
fn root_item(name: &str) -> Option<&'static str> {
    Some(match name {
        "Tensor" | "live_storage_bytes" => "tensor",
        "Device" => "device",
        "DType" => "dtype",
        "Error" | "Result" => "error",
        "Generator" | "manual_seed" => "random",
        "MemoryFormat" => "memory_format",
        "host_reads" => "counters",
        "is_grad_enabled" | "no_grad" | "NoGradGuard" => "grad_mode",
        "bf16" | "f16" => return None,
        _ => return Some(""),
    })
}

/// The modules a file's code names through `crate::` paths (`crate::x::..` and
/// `crate::{x, y::..}`).
fn imports(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut add = |name: &str| {
        let name = name.trim();
        if name.is_empty() {
            return;
        }
        match root_item(name) {
            None => {}
            Some("") => {
                out.insert(name.to_string());
            }
            Some(m) => {
                out.insert(m.to_string());
            }
        }
    };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for item in inner.split(',') {
                add(item.split("::").next().unwrap());
            }
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            add(&rest[..end]);
        }
    }
    out
}

#[test]
fn neither_backend_imports_the_other() {
    for (rel, code) in sources() {
        if rel.starts_with("backend/cuda/") {
            assert!(
                !code.contains("backend::cpu") && !code.contains("super::cpu"),
                "{rel} imports the CPU backend"
            );
        }
        if rel.starts_with("backend/cpu/") {
            assert!(
                !code.contains("backend::cuda") && !code.contains("super::cuda"),
                "{rel} imports the CUDA backend"
            );
        }
    }
}

#[test]
fn folders_of_src_import_each_other_without_cycles() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut folders = BTreeSet::new();
    for (rel, code) in sources() {
        let u = unit(&rel);
        if rel.contains('/') {
            folders.insert(u.clone());
        }
        let e = edges.entry(u.clone()).or_default();
        e.extend(imports(&code).into_iter().filter(|m| *m != u));
    }
    // What each module reaches, and through which module first (to print a cycle).
    let reach = |from: &str| -> BTreeMap<String, String> {
        let mut seen = BTreeMap::new();
        let mut stack = vec![from.to_string()];
        while let Some(x) = stack.pop() {
            for y in edges.get(&x).into_iter().flatten() {
                if !seen.contains_key(y) {
                    seen.insert(y.clone(), x.clone());
                    stack.push(y.clone());
                }
            }
        }
        seen
    };
    let path = |from: &str, to: &str, r: &BTreeMap<String, String>| {
        let mut p = vec![to.to_string()];
        while p.last().unwrap() != from {
            p.push(r[p.last().unwrap()].clone());
        }
        p.reverse();
        p.join(" -> ")
    };
    let mut cycles = Vec::new();
    for a in &folders {
        let ra = reach(a);
        for b in folders.iter().filter(|b| *b > a) {
            let rb = reach(b);
            if ra.contains_key(b) && rb.contains_key(a) {
                cycles.push(format!("{} | {}", path(a, b, &ra), path(b, a, &rb)));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "import cycles between folders:\n{}",
        cycles.join("\n")
    );
    assert!(
        folders.contains("backend") && folders.contains("tensor"),
        "{folders:?}"
    );
}

#[test]
fn files_stay_readable_in_one_sitting() {
    let mut long = Vec::new();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    for p in files {
        let n = fs::read_to_string(&p).unwrap().lines().count();
        let limit = if p.ends_with("backend/mod.rs") {
            300
        } else {
            600
        };
        if n > limit {
            long.push(format!("{} ({n} lines > {limit})", p.display()));
        }
    }
    assert!(long.is_empty(), "files too long:\n{}", long.join("\n"));
}
