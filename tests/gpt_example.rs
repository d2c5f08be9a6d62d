//! The GPT example as a user runs it, on a small text it is given (no download): it trains,
//! writes metrics.csv and curves.png, samples; `--save` then `--resume` gives the losses of
//! an uninterrupted run bit for bit; weights exported in Hugging Face's layout come back with
//! `--init`; flags that do not fit are refused before training.
//!
//! The example's binary is built by `cargo test` (every target, as CI runs it); with a test
//! filter that skips the examples, build them first (`cargo build --release --examples`).

#![cfg(feature = "train-ui")]

mod common;
use common::examples::{fresh_dir, has, run_ok, run_refused};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(180);

/// A text of a few thousand characters: this crate's README.
fn text() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/README.md").to_string()
}

/// Flags for a tiny model on the CPU, writing into `dir`.
fn small(dir: &str, text: &str) -> Vec<String> {
    let flags = [
        "--device",
        "cpu",
        "--text",
        text,
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--warmup-steps",
        "3",
        "--eval-batches",
        "2",
        "--out",
        dir,
    ];
    flags.iter().map(|s| s.to_string()).collect()
}

fn run(args: &[String]) -> String {
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    run_ok("gpt", &args, LIMIT).unwrap_or_default()
}

fn with(base: &[String], extra: &[&str]) -> Vec<String> {
    base.iter()
        .cloned()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
}

/// metrics.csv's rows after the header.
fn rows(dir: &std::path::Path) -> Vec<String> {
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("step,train_loss,val_loss,train_acc,val_acc,lr,seconds,tokens_per_s")
    );
    lines.map(|l| l.to_string()).collect()
}

/// A row's columns without the timing ones (seconds, tokens/s).
fn losses(row: &str) -> String {
    row.split(',').take(6).collect::<Vec<_>>().join(",")
}

#[test]
fn trains_saves_resumes_bit_exactly_and_samples() {
    if common::examples::example_binary("gpt").is_none() && std::env::var_os("CI").is_none() {
        eprintln!("skipped: examples/gpt is not built");
        return;
    }
    let text = text();
    // The uninterrupted run: 20 steps, evaluated every 10.
    let whole = fresh_dir("gpt-whole");
    let base = small(whole.to_str().unwrap(), &text);
    let out = run(&with(
        &base,
        &["--steps", "20", "--eval-interval", "10", "--generate", "30"],
    ));
    assert!(out.contains("step 20: train loss"), "{out}");
    assert!(out.contains("--- sample (30 tokens) ---"), "{out}");
    assert!(has(&whole, "curves.png"));
    let want = rows(&whole);
    assert_eq!(want.len(), 2, "{want:?}");
    // The same run stopped after 10 steps and resumed.
    let parts = fresh_dir("gpt-parts");
    let ckpt = parts.join("c.safetensors");
    let base = small(parts.to_str().unwrap(), &text);
    // The first part decays over the whole run's 20 steps, as the run it stands in for.
    let save = [
        "--eval-interval",
        "10",
        "--generate",
        "0",
        "--decay-steps",
        "20",
        "--save",
        ckpt.to_str().unwrap(),
    ];
    run(&with(&base, &[&["--steps", "10"][..], &save].concat()));
    let out = run(&with(
        &base,
        &[
            &["--steps", "20", "--resume", ckpt.to_str().unwrap()][..],
            &save,
        ]
        .concat(),
    ));
    assert!(out.contains("after step 10"), "{out}");
    assert!(!out.contains("steps 1-10"), "steps ran again:\n{out}");
    let got = rows(&parts);
    assert_eq!(got.len(), 2, "{got:?}");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(losses(g), losses(w), "resumed against uninterrupted");
    }
    // Exported as Hugging Face names the weights, then loaded with --init (the heads from
    // the file's metadata) and sampled from.
    let hf = parts.join("hf.safetensors");
    run(&with(
        &base,
        &[
            "--steps",
            "0",
            "--generate",
            "0",
            "--resume",
            ckpt.to_str().unwrap(),
            "--export",
            hf.to_str().unwrap(),
        ],
    ));
    let init_dir = fresh_dir("gpt-init");
    let init_base = [
        "--device",
        "cpu",
        "--text",
        &text,
        "--tokenizer",
        "char",
        "--batch-size",
        "4",
        "--eval-batches",
        "2",
        "--out",
        init_dir.to_str().unwrap(),
        "--init",
        hf.to_str().unwrap(),
        "--generate",
        "5",
        "--greedy",
    ];
    let args: Vec<String> = init_base.iter().map(|s| s.to_string()).collect();
    let out = run(&with(&args, &["--steps", "0"]));
    assert!(
        out.contains("GPT 2 layers x 2 heads x 32 wide, context 16"),
        "{out}"
    );
    assert!(out.contains("--- sample (5 tokens) ---"), "{out}");
    for d in [whole, parts, init_dir] {
        std::fs::remove_dir_all(d).ok();
    }
}

#[test]
fn flags_that_do_not_fit_are_refused_before_training() {
    let dir = fresh_dir("gpt-refused");
    let d = dir.to_str().unwrap();
    let text = text();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--quick", "--model", "gpt2"],
            "--quick trains the baby model",
        ),
        (
            vec!["--model", "gpt3"],
            "baby, shakespeare-char, gpt2 or gpt2-medium",
        ),
        (
            vec!["--tokenizer", "words", "--text", &text],
            "char or gpt2",
        ),
        (
            vec!["--data", "synthetic", "--save", "x.safetensors"],
            "--data synthetic",
        ),
        (vec!["--data", "images"], "text or synthetic"),
        (
            vec!["--n-embd", "30", "--n-head", "4", "--text", &text],
            "multiple of the heads",
        ),
        (
            vec!["--channels-last", "--text", &text],
            "--channels-last applies",
        ),
        (
            vec!["--master-weights", "--text", &text],
            "--master-weights needs",
        ),
        (
            vec!["--cuda-graph", "--text", &text],
            "--cuda-graph needs a CUDA device",
        ),
        (vec!["--text", "no-such-file.txt"], "no-such-file.txt"),
        (
            vec!["--init", "no-such.safetensors", "--text", &text],
            "no-such.safetensors",
        ),
        (vec!["--temperature", "0"], "temperature"),
        (vec!["--top-p", "1.5"], "top-p"),
        (
            vec!["--attention", "flash"],
            "--attention \"flash\": auto, composed, fused or own",
        ),
        (
            vec!["--gemm-epilogues", "--text", &text],
            "--gemm-epilogues applies to a CUDA device",
        ),
    ];
    for (args, says) in cases {
        let args: Vec<&str> = ["--device", "cpu", "--out", d]
            .into_iter()
            .chain(args)
            .collect();
        let Some(err) = run_refused("gpt", &args) else {
            return;
        };
        assert!(err.contains(says), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
