//! Each kernel sits in the part of its file that `kernels::part_of` names, so the runtime
//! finds it in the unit it compiles for it: every file is preprocessed for the host as a
//! whole and per part (`-DMANTISSA_PART=k`), and the kernels each unit defines are listed.

use super::super::kernels::{self, part_of, PARTS};
use std::collections::BTreeSet;

/// The kernels defined by kernel file `name` preprocessed with `defines`, or `None` without a
/// C++ compiler.
fn kernels_of(name: &str, defines: &[String]) -> Option<BTreeSet<String>> {
    let dir = std::env::temp_dir().join(format!("mantissa-parts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shim = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/emulator/host_shim.h");
    let cpp = dir.join(format!("{name}-{}.cpp", defines.join("").len()));
    let source = kernels::source(name).expect("a kernel file");
    std::fs::write(&cpp, format!("#include \"{shim}\"\n{source}\n")).unwrap();
    let out = super::cxx(|c| {
        c.args(["-std=c++20", "-w", "-x", "c++", "-E", "-P"])
            .arg("-D__global__=MANTISSA_KERNEL")
            .args(defines)
            .arg(&cpp)
    });
    let _ = std::fs::remove_file(&cpp);
    let _ = std::fs::remove_dir(&dir);
    let out = out?;
    assert!(
        out.status.success(),
        "{name}.cu does not preprocess:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mark = "MANTISSA_KERNEL void ";
    let names = text
        .match_indices(mark)
        .map(|(at, _)| {
            let rest = &text[at + mark.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            rest[..end].to_string()
        })
        .collect();
    Some(names)
}

#[test]
fn every_kernel_is_in_the_part_its_name_says_and_in_no_other() {
    for (name, _) in kernels::KERNELS {
        let Some(all) = kernels_of(name, &[]) else {
            return;
        };
        assert!(!all.is_empty(), "{name}.cu defines no kernel");
        let mut union = BTreeSet::new();
        for part in 0..PARTS {
            let here = kernels_of(name, &[format!("-DMANTISSA_PART={part}")]).unwrap();
            for k in &here {
                assert_eq!(
                    part_of(k),
                    part,
                    "{name}.cu: kernel {k} is in part {part}, its name says {}",
                    part_of(k)
                );
            }
            union.extend(here);
        }
        assert_eq!(
            union, all,
            "{name}.cu: the parts together are the whole file"
        );
    }
}
