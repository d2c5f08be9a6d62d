//! Running the examples' binaries as a user runs them, for the tests that check their
//! behaviour (tests/examples_run.rs, tests/gpt_example.rs).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/examples/<name>`, beside this test's own directory.
pub fn example_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("examples").join(name);
    bin.exists().then_some(bin)
}

/// Runs the example `name` with `args` and returns its exit status, stdout and stderr, or
/// `None` when it is not built (a failure under CI). A run past `limit` is killed and fails.
pub fn run_example(
    name: &str,
    args: &[&str],
    limit: Duration,
) -> Option<(std::process::ExitStatus, String, String)> {
    let Some(bin) = example_binary(name) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "examples/{name} is not built (cargo test builds it with every target)"
        );
        eprintln!("skipped: examples/{name} is not built (cargo build --release --examples)");
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
            panic!("{name} {args:?} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    Some((
        out.status,
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    ))
}

/// [`run_example`] of a run that must succeed: its stdout.
pub fn run_ok(name: &str, args: &[&str], limit: Duration) -> Option<String> {
    let (status, stdout, stderr) = run_example(name, args, limit)?;
    assert!(
        status.success(),
        "{name} {args:?}: {status}\n{stdout}\n{stderr}"
    );
    Some(stdout)
}

/// The MNIST example's run that must succeed.
pub fn run(args: &[&str], limit: Duration) -> Option<String> {
    run_ok("mnist", args, limit)
}

/// [`run_example`] of a run that must fail at once: its stderr, which names the mistake.
pub fn run_refused(name: &str, args: &[&str]) -> Option<String> {
    let (status, stdout, stderr) = run_example(name, args, Duration::from_secs(60))?;
    assert_eq!(
        status.code(),
        Some(1),
        "{name} {args:?}\n{stdout}\n{stderr}"
    );
    assert!(
        !stdout.contains("epoch 1"),
        "{name} {args:?} trained:\n{stdout}"
    );
    Some(stderr)
}

pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mantissa-ex-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn has(dir: &Path, file: &str) -> bool {
    dir.join(file).is_file()
}
