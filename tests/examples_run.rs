//! The examples run as a user runs them: an MNIST run whose loss becomes NaN says so and
//! finishes with its plot, `--profile N --profile-warmup 0` profiles the first N steps, a run
//! with no epoch to train says that nothing was written; the LSTM saves and resumes in bits
//! per character; flags that do not apply and unwritable paths are refused before training.
//!
//! The example's binary is built by `cargo test` (every target, as CI runs it); with a test
//! filter that skips the examples, build them first (`cargo build --release --examples`).

#![cfg(feature = "train-ui")]

mod common;
use common::examples::{fresh_dir, has, run, run_ok, run_refused};
use std::time::Duration;

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

#[test]
fn the_lstm_saves_resumes_and_logs_bits_per_char() {
    let dir = fresh_dir("lstm");
    let (d, ckpt) = (dir.to_str().unwrap(), dir.join("c.safetensors"));
    let ckpt = ckpt.to_str().unwrap();
    let small = [
        "--hidden",
        "16",
        "--layers",
        "1",
        "--embedding",
        "8",
        "--seq-len",
        "20",
        "--device",
        "cpu",
        "--workers",
        "0",
        "--out",
        d,
        "--save",
        ckpt,
    ];
    let first: Vec<&str> = small.iter().copied().chain(["--epochs", "1"]).collect();
    let Some(out) = run_ok("lstm", &first, Duration::from_secs(120)) else {
        return;
    };
    assert!(
        out.contains("bits/char") && has(&dir, "c.safetensors"),
        "{out}"
    );
    let second: Vec<&str> = small
        .iter()
        .copied()
        .chain(["--epochs", "2", "--resume", ckpt])
        .collect();
    let out = run_ok("lstm", &second, Duration::from_secs(120)).unwrap();
    assert!(out.contains("after epoch 1"), "{out}");
    assert!(!out.contains("epoch 1/2"), "epoch 1 ran again:\n{out}");
    assert!(out.contains("epoch 2/2"), "{out}");
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(lines[0].starts_with("epoch,train_bits_per_char,"), "{csv}");
    assert_eq!(lines.len(), 3, "{csv}");
    assert!(
        lines[1].starts_with("1,") && lines[2].starts_with("2,"),
        "{csv}"
    );
    // The epoch line and the CSV agree on the unit: the held-out figure printed is the CSV's.
    let printed = out
        .lines()
        .find(|l| l.starts_with("epoch 2:"))
        .and_then(|l| l.split("held-out loss ").nth(1))
        .and_then(|r| r.split(' ').next())
        .unwrap();
    let logged: f64 = lines[2].split(',').nth(3).unwrap().parse().unwrap();
    assert!(
        (printed.parse::<f64>().unwrap() - logged).abs() < 1e-3,
        "{out}\n{csv}"
    );
    assert!(has(&dir, "curves.png"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flags_that_do_not_apply_and_unwritable_paths_are_refused_before_training() {
    let dir = fresh_dir("refused");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let (d, f) = (dir.to_str().unwrap(), file.to_str().unwrap());
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let cpu = ["--device", "cpu", "--workers", "0"];
        cpu.into_iter().chain(extra.iter().copied()).collect()
    }
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "lstm",
            with(&["--channels-last", "--cudnn-benchmark"]),
            "--channels-last, --cudnn-benchmark apply",
        ),
        (
            "lstm",
            with(&["--synthetic", "--save", "x.safetensors"]),
            "--synthetic times steps",
        ),
        ("lstm", with(&["--synthetic", "--quick"]), "--quick"),
        (
            "resnet",
            with(&["--data", "synthetic", "--resume", f]),
            "--data synthetic",
        ),
        ("resnet", vec!["--device", "cpu", "--out", f], "--out"),
        ("mnist", vec!["--device", "cpu", "--save", d], "--save"),
        (
            "mnist",
            vec!["--device", "cpu", "--resume", "no-such.safetensors"],
            "no such checkpoint",
        ),
        (
            "mnist",
            vec!["--device", "cpu", "--model", "mlp", "--channels-last"],
            "applies",
        ),
        (
            "mnist",
            vec!["--device", "cpu", "--model", "mlp", "--cudnn-deterministic"],
            "--cudnn-deterministic applies",
        ),
    ];
    for (name, args, says) in cases {
        let Some(err) = run_refused(name, &args) else {
            return;
        };
        assert!(err.contains(says), "{name} {args:?}: {err}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    std::fs::remove_dir_all(&dir).unwrap();
}
