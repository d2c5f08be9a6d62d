//! The MNIST example run as a user runs it: a run whose loss becomes NaN says so and finishes
//! with its plot, `--profile N --profile-warmup 0` profiles the first N steps, and a run with
//! no epoch to train says that nothing was written.
//!
//! The example's binary is built by `cargo test` (every target, as CI runs it); with a test
//! filter that skips the examples, build them first (`cargo build --release --examples`).

#![cfg(feature = "train-ui")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/examples/mnist`, beside this test's own directory.
fn mnist_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("examples").join("mnist");
    bin.exists().then_some(bin)
}

/// Runs the example with `args`; its stdout, or a failure naming what went wrong (an exit
/// other than 0, or no exit within `limit`: the run is killed).
fn run(args: &[&str], limit: Duration) -> Option<String> {
    let Some(bin) = mnist_binary() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "examples/mnist is not built (cargo test builds it with every target)"
        );
        eprintln!("skipped: examples/mnist is not built (cargo build --release --examples)");
        return None;
    };
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("mnist {args:?} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(
        out.status.success(),
        "mnist {args:?}: {}\n{stdout}\n{stderr}",
        out.status
    );
    Some(stdout)
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mantissa-ex-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn has(dir: &Path, file: &str) -> bool {
    dir.join(file).is_file()
}

#[test]
fn a_nan_loss_run_says_so_and_finishes_with_its_plot() {
    let dir = fresh_dir("nan");
    let d = dir.to_str().unwrap();
    let args = [
        "--model",
        "mlp",
        "--quick",
        "--lr",
        "1e6",
        "--device",
        "cpu",
        "--workers",
        "0",
        "--out",
        d,
        "--profile",
        "2",
        "--profile-warmup",
        "0",
    ];
    let Some(out) = run(&args, Duration::from_secs(300)) else {
        return;
    };
    assert!(out.contains("became non-finite"), "{out}");
    assert!(
        out.contains("profile of 2 steps after 0 warm-up steps"),
        "{out}"
    );
    for file in ["metrics.csv", "curves.png", "trace.json"] {
        assert!(has(&dir, file), "{file} in {d}:\n{out}");
    }
    assert!(out.contains(&format!("metrics and curves in {d}")), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_with_no_epoch_writes_nothing_and_says_so() {
    let dir = fresh_dir("none");
    let d = dir.to_str().unwrap();
    let args = [
        "--model",
        "mlp",
        "--epochs",
        "0",
        "--device",
        "cpu",
        "--workers",
        "0",
        "--out",
        d,
    ];
    let Some(out) = run(&args, Duration::from_secs(300)) else {
        return;
    };
    assert!(out.contains("no epoch was run"), "{out}");
    assert!(!out.contains("metrics and curves in"), "{out}");
    assert!(
        !has(&dir, "metrics.csv") && !has(&dir, "curves.png"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
