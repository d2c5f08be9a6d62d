//! Metrics CSV round trip and the PNG plot.

use mantissa::train::{EpochMetrics, MetricsLog};
use std::path::Path;

fn log() -> MetricsLog {
    let mut log = MetricsLog::default();
    for e in 1..=3 {
        log.push(EpochMetrics {
            epoch: e,
            train_loss: 1.0 / e as f64,
            train_acc: 0.9 + 0.02 * e as f64,
            test_loss: 1.2 / e as f64,
            test_acc: 0.88 + 0.03 * e as f64,
            lr: 0.1 * 0.7f64.powi(e as i32 - 1),
            seconds: 10.0 + e as f64,
            samples_per_s: 5000.0,
            // A GPU run's memory in the first two epochs, a CPU run's none in the third.
            memory: (e < 3).then(|| mantissa::memory::MemoryStats {
                allocated: (100 + e) << 20,
                reserved: 300 << 20,
                peak_allocated: (200 << 20) + (1 << 19),
                ..Default::default()
            }),
        });
    }
    log
}

#[test]
fn metrics_csv_round_trips_and_rejects_garbage() {
    let l = log();
    let text = l.to_csv();
    assert!(text.starts_with(
        "epoch,train_loss,train_acc,test_loss,test_acc,lr,seconds,samples_per_s,allocated_mib,\
         reserved_mib,peak_allocated_mib\n"
    ));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[1].ends_with(",101.0,300.0,200.5"), "{}", lines[1]);
    assert!(lines[3].ends_with(",5000.0,,,"), "{}", lines[3]);
    let back = MetricsLog::from_csv(&text, Path::new("m.csv")).unwrap();
    assert_eq!(back.epochs.len(), 3);
    for (a, b) in back.epochs.iter().zip(&l.epochs) {
        assert_eq!(a.epoch, b.epoch);
        assert!((a.test_acc - b.test_acc).abs() < 1e-6 && (a.lr - b.lr).abs() < 1e-9);
        // MiB with one decimal: these sizes come back exactly.
        assert_eq!(a.memory, b.memory);
    }
    // A file of the columns before memory was logged still reads.
    let old: String = text
        .lines()
        .map(|l| l.splitn(9, ',').take(8).collect::<Vec<_>>().join(",") + "\n")
        .collect();
    let old = MetricsLog::from_csv(&old, Path::new("m.csv")).unwrap();
    assert_eq!(old.epochs.len(), 3);
    assert!(old.epochs.iter().all(|m| m.memory.is_none()));
    assert!(MetricsLog::from_csv("nope\n1,2", Path::new("m.csv")).is_err());
    assert!(MetricsLog::from_csv(&format!("{}1,x,3\n", text), Path::new("m.csv")).is_err());
    // An empty field outside the memory columns is refused.
    let hole = text.replacen(",5000.0,", ",,", 1);
    assert!(MetricsLog::from_csv(&hole, Path::new("m.csv")).is_err());
}

#[cfg(feature = "train-ui")]
#[test]
fn plot_writes_a_png() {
    let dir = std::env::temp_dir().join(format!("mantissa-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("curves.png");
    mantissa::train::plot_metrics(&log(), &p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        bytes.len() > 10_000,
        "a drawn chart, not an empty image: {} bytes",
        bytes.len()
    );
    assert!(mantissa::train::plot_metrics(&MetricsLog::default(), &p).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Running figures kept as tensors agree with the host-side path, and are read back once per
/// 25 steps (and at the end), not once per step.
#[test]
fn progress_reads_device_sums_every_few_steps() {
    use mantissa::train::EpochProgress;
    use mantissa::{host_reads, DType, Device, Tensor};
    let steps = 60;
    let (mut host, mut dev) = (
        EpochProgress::new("h", steps),
        EpochProgress::new("d", steps),
    );
    let reads = host_reads();
    for k in 0..steps {
        let (loss, hits, batch) = (0.25 + 0.01 * k as f64, (k % 7) as f64, 8 + k % 3);
        host.step(batch, loss, hits);
        let l = Tensor::scalar(loss, DType::F32, Device::Cpu).unwrap();
        let h = Tensor::scalar(hits, DType::F32, Device::Cpu).unwrap();
        dev.step_tensors(batch, &l, &h).unwrap();
    }
    // Reads after steps 25 and 50, and at the last step.
    assert_eq!(host_reads() - reads, 3);
    dev.finish().unwrap();
    host.finish().unwrap();
    assert!(
        (host.loss() - dev.loss()).abs() < 1e-6,
        "{} vs {}",
        host.loss(),
        dev.loss()
    );
    assert_eq!(host.accuracy(), dev.accuracy());
}

/// The sums kept on the device are the bar's own: a loss or count tensor the caller writes
/// in place afterwards (a CUDA graph's outputs are rewritten by each replay) counts as it was
/// at its step.
#[test]
fn device_sums_do_not_alias_the_step_outputs() {
    use mantissa::train::EpochProgress;
    use mantissa::{no_grad, DType, Device, Tensor};
    let mut bar = EpochProgress::new("epoch", 2);
    let l = Tensor::scalar(0.5, DType::F32, Device::Cpu).unwrap();
    let h = Tensor::scalar(3.0, DType::F32, Device::Cpu).unwrap();
    bar.step_tensors(4, &l, &h).unwrap();
    no_grad(|| {
        l.copy_(&Tensor::scalar(1.5, DType::F32, Device::Cpu)?)?;
        h.copy_(&Tensor::scalar(1.0, DType::F32, Device::Cpu)?)
    })
    .unwrap();
    bar.step_tensors(4, &l, &h).unwrap();
    bar.finish().unwrap();
    assert_eq!((bar.loss(), bar.accuracy()), (1.0, 0.5));
}

/// Plots `log` on another thread: the PNG's bytes, or a failure after 60 s (a plot that
/// spins must fail the test, not hang it).
#[cfg(feature = "train-ui")]
fn plot_within_a_minute(log: MetricsLog, name: &str) -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("mantissa-plot-nan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}.png"));
    let (tx, rx) = std::sync::mpsc::channel();
    let q = p.clone();
    std::thread::spawn(move || {
        let _ = tx.send(mantissa::train::plot_metrics(&log, &q));
    });
    let done = rx.recv_timeout(std::time::Duration::from_secs(60));
    done.unwrap_or_else(|_| panic!("{name}: the plot did not finish in 60 s"))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name}");
    bytes
}

/// Losses that are all NaN, partly NaN or infinite, or finite but huge, plot and return
/// (all NaN used to spin for ever in the axis' tick computation); a NaN is not drawn as the
/// lowest loss.
#[cfg(feature = "train-ui")]
#[test]
fn non_finite_losses_plot_and_return() {
    let with = |losses: &[f64]| {
        let mut l = MetricsLog::default();
        for (i, &v) in losses.iter().enumerate() {
            let mut m = log().epochs[i % 3].clone();
            m.epoch = i + 1;
            (m.train_loss, m.test_loss) = (v, v * 1.1);
            l.push(m);
        }
        l
    };
    let cases: [(&str, &[f64]); 6] = [
        ("all-nan", &[f64::NAN, f64::NAN, f64::NAN]),
        ("one-nan-epoch", &[f64::NAN]),
        ("inf", &[2.0, f64::INFINITY, f64::NEG_INFINITY]),
        ("huge", &[1e300, -1e300, 0.5]),
        ("flat", &[0.25, 0.25]),
        ("nan-then-finite", &[1.0, f64::NAN, 0.5, 0.25]),
    ];
    for (name, losses) in cases {
        plot_within_a_minute(with(losses), name);
    }
    let nan = plot_within_a_minute(with(&[1.0, f64::NAN, 0.5, 0.25]), "gap");
    let low = plot_within_a_minute(with(&[1.0, 0.25, 0.5, 0.25]), "bottom");
    assert_ne!(nan, low, "a NaN loss is drawn apart from the lowest one");
}

/// A loss that becomes non-finite is reported once, at its step with host losses and within
/// the read window with the sums kept as tensors.
#[test]
fn progress_reports_the_step_where_the_loss_became_non_finite() {
    use mantissa::train::EpochProgress;
    use mantissa::{DType, Device, Tensor};
    for bad in [f64::NAN, f64::INFINITY] {
        let (mut host, mut dev) = (EpochProgress::new("h", 60), EpochProgress::new("d", 60));
        for k in 1..=60 {
            let loss = if k >= 31 { bad } else { 0.5 };
            host.step(4, loss, 1.0);
            let l = Tensor::scalar(loss, DType::F32, Device::Cpu).unwrap();
            let h = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
            dev.step_tensors(4, &l, &h).unwrap();
            if k == 30 {
                assert_eq!(
                    (host.first_non_finite(), dev.first_non_finite()),
                    (None, None)
                );
            }
        }
        dev.finish().unwrap();
        assert_eq!(host.first_non_finite(), Some((31, 31)));
        // Sums are read after steps 25 and 50: the first non-finite one is in 26..=50.
        assert_eq!(dev.first_non_finite(), Some((26, 50)));
        assert!(!host.loss().is_finite());
    }
}

#[test]
fn a_log_in_bits_per_char_names_its_unit_and_reads_back_so() {
    use mantissa::train::LossUnit;
    let mut l = log();
    l.loss_unit = LossUnit::BitsPerChar;
    let text = l.to_csv();
    assert!(
        text.starts_with("epoch,train_bits_per_char,train_acc,test_bits_per_char,test_acc,"),
        "{text}"
    );
    let back = MetricsLog::from_csv(&text, Path::new("m.csv")).unwrap();
    assert_eq!(back.loss_unit, LossUnit::BitsPerChar);
    assert_eq!(back.epochs.len(), 3);
    assert_eq!(MetricsLog::default().loss_unit, LossUnit::Nats);
    // ln 2 nats are one bit.
    let one = LossUnit::BitsPerChar.from_nats(std::f64::consts::LN_2);
    assert!((one - 1.0).abs() < 1e-12);
    assert_eq!(LossUnit::Nats.from_nats(0.5), 0.5);
    assert!(LossUnit::BitsPerChar.axis().contains("bits/char"));
}

#[test]
fn output_paths_are_checked_before_a_run() {
    use mantissa::train::{check_writable_dir, check_writable_file};
    let root = std::env::temp_dir().join(format!("mantissa-writable-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // A folder (and its parents) made, nothing left in it.
    let out = root.join("a/b");
    check_writable_dir(&out, "--out").unwrap();
    assert!(out.is_dir());
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    // A file where a folder is wanted, and a folder where a file is wanted, are refused with
    // the flag and the path.
    let file = root.join("f");
    std::fs::write(&file, b"x").unwrap();
    let e = check_writable_dir(&file, "--out").unwrap_err().to_string();
    assert!(e.contains("--out") && e.contains("not a folder"), "{e}");
    let e = check_writable_file(&out, "--save").unwrap_err().to_string();
    assert!(e.contains("--save") && e.contains("b"), "{e}");
    // A file below a file cannot be made.
    assert!(check_writable_file(&file.join("ckpt.safetensors"), "--save").is_err());
    // An existing file to be replaced is left as it is.
    check_writable_file(&file, "--save").unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    // A read-only folder (unless this process ignores permissions, as root does).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let ro = root.join("ro");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o500)).unwrap();
        let writable_anyway = std::fs::write(ro.join("t"), b"t").is_ok();
        let r = check_writable_file(&ro.join("c.safetensors"), "--save");
        assert_eq!(r.is_ok(), writable_anyway, "{r:?}");
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    std::fs::remove_dir_all(&root).unwrap();
}
