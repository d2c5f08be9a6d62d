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

/// A file's module path from `src/`: `backend/cuda/conv.rs` is `backend::cuda::conv`,
/// `backend/cuda/mod.rs` is `backend::cuda`, `lib.rs` the root.
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The module paths a file's code names, resolved from `crate::`, `super::` (chained) and
/// `self::` paths, a `{...}` group giving one path per item (its segments before any inner
/// group).
fn paths_named(rel: &str, code: &str) -> Vec<Vec<String>> {
    let me = module_of(rel);
    let is_mod = rel.ends_with("mod.rs") || rel == "lib.rs";
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    for kw in ["crate::", "super::", "self::"] {
        for (i, _) in code.match_indices(kw) {
            if code[..i].ends_with(ident) || code[..i].ends_with("::") {
                continue; // part of a longer name, or a chained `super::super::`
            }
            let mut rest = &code[i + kw.len()..];
            let mut base: Vec<String> = match kw {
                "crate::" => vec![],
                // `super` of a file is its folder's module; of a mod.rs, the folder's parent.
                "super::" => me[..me.len().saturating_sub(1)].to_vec(),
                _ if is_mod => me.clone(),
                _ => me[..me.len().saturating_sub(1)].to_vec(),
            };
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            let segs = |item: &str| -> Vec<String> {
                item.split('{')
                    .next()
                    .unwrap_or("")
                    .split("::")
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty() && s.chars().all(ident))
                    .collect()
            };
            if let Some(group) = rest.strip_prefix('{') {
                let (mut depth, mut item, mut items) = (0, String::new(), Vec::new());
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            items.push(std::mem::take(&mut item));
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
                items.push(item);
                for it in items {
                    out.push([base.clone(), segs(&it)].concat());
                }
            } else {
                let end = rest
                    .find(|c: char| !(ident(c) || c == ':'))
                    .unwrap_or(rest.len());
                out.push([base.clone(), segs(&rest[..end])].concat());
            }
        }
    }
    out
}

#[test]
fn files_import_each_other_without_cycles() {
    let sources = sources();
    let files: BTreeMap<Vec<String>, String> = sources
        .iter()
        .map(|(rel, _)| (module_of(rel), rel.clone()))
        .collect();
    // Each named path belongs to the file of its longest module prefix (not the root: the
    // crate's re-exports are no file's dependency).
    let file_of = |path: &[String]| -> Option<&String> {
        (1..=path.len()).rev().find_map(|k| files.get(&path[..k]))
    };
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (rel, code) in &sources {
        let to = edges.entry(rel.as_str()).or_default();
        for p in paths_named(rel, code) {
            if let Some(f) = file_of(&p).filter(|f| *f != rel) {
                to.insert(f.as_str());
            }
        }
    }
    // A depth-first walk; a file met again while on the walk's path closes a cycle.
    fn walk<'a>(
        f: &'a str,
        edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        cycles: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|p| *p == f) {
            cycles.push([&path[at..], &[f]].concat().join(" -> "));
            return;
        }
        if !done.insert(f) {
            return;
        }
        path.push(f);
        for &g in edges.get(f).into_iter().flatten() {
            walk(g, edges, path, done, cycles);
        }
        path.pop();
    }
    let (mut done, mut cycles) = (BTreeSet::new(), Vec::new());
    for &f in edges.keys() {
        walk(f, &edges, &mut Vec::new(), &mut done, &mut cycles);
    }
    assert!(
        cycles.is_empty(),
        "files that import each other (split a family by concept: its parts import a shared \
         module, never each other both ways):\n{}",
        cycles.join("\n")
    );
    // The walk sees the imports it must: a CUDA launcher reaches its runtime.
    let conv = edges.get("backend/cuda/conv.rs").expect("conv.rs");
    assert!(conv.contains("backend/cuda/runtime.rs") || conv.contains("backend/cuda/storage.rs"));
}
