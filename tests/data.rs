//! IDX reader errors, DataLoader ordering/shuffling/workers, checkpoints.

use mantissa::backend::cpu::CpuStorage;
use mantissa::data::mnist::{parse_idx, read_idx, Mnist};
use mantissa::data::{
    Batch, DataLoader, DataLoaderConfig, Dataset, HostBatch, HostBuffer, TensorDataset,
};
use mantissa::*;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

fn idx_bytes(magic: [u8; 4], dims: &[u32], data_len: usize) -> Vec<u8> {
    let mut b = magic.to_vec();
    for d in dims {
        b.extend(d.to_be_bytes());
    }
    b.extend((0..data_len).map(|i| (i % 10) as u8));
    b
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mantissa-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn idx_reader_rejects_bad_files() {
    let p = Path::new("x.idx");
    let ok = parse_idx(&idx_bytes([0, 0, 8, 3], &[2, 28, 28], 2 * 784), p).unwrap();
    assert_eq!(ok.dims, vec![2, 28, 28]);
    let m = parse_idx(&idx_bytes([0, 0, 9, 3], &[2, 28, 28], 2 * 784), p)
        .unwrap_err()
        .to_string();
    assert!(m.contains("magic"), "{m}");
    let m = parse_idx(&idx_bytes([0, 0, 8, 3], &[2, 28, 28], 784), p)
        .unwrap_err()
        .to_string();
    assert!(m.contains("truncated") && m.contains("1568"), "{m}");
    let m = parse_idx(&idx_bytes([0, 0, 8, 1], &[5], 7), p)
        .unwrap_err()
        .to_string();
    assert!(m.contains("trailing"), "{m}");
    let m = parse_idx(&[0, 0, 8, 3, 0, 0], p).unwrap_err().to_string();
    assert!(m.contains("truncated header"), "{m}");
    assert!(parse_idx(&[], p).is_err());
    // gzip: a good file reads, a corrupt one is an error.
    let dir = tmpdir("idx");
    let gz = dir.join("labels.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::fast(),
    );
    enc.write_all(&idx_bytes([0, 0, 8, 1], &[10], 10)).unwrap();
    enc.finish().unwrap();
    assert_eq!(read_idx(&gz).unwrap().data.len(), 10);
    let mut bytes = std::fs::read(&gz).unwrap();
    let n = bytes.len();
    bytes.truncate(n - 6);
    std::fs::write(&gz, &bytes).unwrap();
    assert!(read_idx(&gz).unwrap_err().to_string().contains("gzip"));
    assert!(read_idx(&dir.join("absent"))
        .unwrap_err()
        .to_string()
        .contains("absent"));
    // A split whose counts do not match MNIST's is refused with the file named.
    for (stem, dims, len) in [
        ("t10k-images-idx3-ubyte", vec![9999u32, 28, 28], 9999 * 784),
        ("t10k-labels-idx1-ubyte", vec![10000], 10000),
    ] {
        std::fs::write(
            dir.join(stem),
            idx_bytes([0, 0, 8, dims.len() as u8], &dims, len),
        )
        .unwrap();
    }
    let m = Mnist::load(&dir, false).unwrap_err().to_string();
    assert!(m.contains("t10k-images") && m.contains("9999"), "{m}");
    assert!(Mnist::load(&dir, true)
        .unwrap_err()
        .to_string()
        .contains("not found"));
    std::fs::remove_dir_all(&dir).unwrap();
}

struct Numbers(usize);
impl Dataset for Numbers {
    fn len(&self) -> usize {
        self.0
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![2]
    }
    fn fill(&self, i: usize, x: &mut [f32]) -> Result<i64> {
        if i == 13 && self.0 == 14 {
            return Err(Error::Invalid {
                op: "numbers",
                msg: "sample 13 is broken".into(),
            });
        }
        x[0] = i as f32;
        x[1] = -(i as f32);
        Ok(i as i64)
    }
}

fn labels(dl: &mut DataLoader, epoch: usize) -> Vec<Vec<i64>> {
    dl.epoch(epoch)
        .map(|b| b.unwrap().y.to_vec::<i64>().unwrap())
        .collect()
}

#[test]
fn loader_batches_in_order_with_workers_and_shuffles_by_seed() {
    for workers in [0, 1, 3] {
        let cfg = DataLoaderConfig {
            num_workers: workers,
            ..DataLoaderConfig::new(4)
        };
        let mut dl = DataLoader::new(Arc::new(Numbers(10)), cfg).unwrap();
        assert_eq!(dl.len(), 3);
        let got = labels(&mut dl, 0);
        assert_eq!(got, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        let b = dl.epoch(0).next().unwrap().unwrap();
        assert_eq!(b.x.shape(), &[4, 2]);
        assert_eq!(b.x.to_vec::<f32>().unwrap()[..4], [0.0, -0.0, 1.0, -1.0]);
    }
    let cfg = DataLoaderConfig {
        shuffle: true,
        seed: 7,
        drop_last: true,
        num_workers: 2,
        ..DataLoaderConfig::new(3)
    };
    let mut dl = DataLoader::new(Arc::new(Numbers(100)), cfg).unwrap();
    assert_eq!(dl.len(), 33);
    let e0: Vec<i64> = labels(&mut dl, 0).concat();
    assert_eq!(e0.len(), 99);
    let mut all = dl.order(0).unwrap();
    all.sort();
    assert_eq!(all, (0..100).collect::<Vec<_>>(), "a permutation");
    assert_ne!(e0, (0..99).collect::<Vec<i64>>());
    // Same seed and epoch, same order (workers kept across epochs); other epochs differ.
    let mut again = DataLoader::new(Arc::new(Numbers(100)), cfg).unwrap();
    assert_eq!(labels(&mut again, 0).concat(), e0);
    assert_ne!(labels(&mut dl, 1).concat(), e0);
    // An abandoned epoch does not leak batches into the next one.
    let _ = dl.epoch(2).take(2).count();
    assert_eq!(labels(&mut dl, 0).concat(), e0);
}

#[test]
fn loader_reports_dataset_errors_and_bad_config() {
    for workers in [0, 2] {
        let cfg = DataLoaderConfig {
            num_workers: workers,
            ..DataLoaderConfig::new(5)
        };
        let mut dl = DataLoader::new(Arc::new(Numbers(14)), cfg).unwrap();
        let res: Vec<_> = dl.epoch(0).collect();
        assert!(res[0].is_ok() && res[1].is_ok());
        assert!(res[2]
            .as_ref()
            .err()
            .unwrap()
            .to_string()
            .contains("sample 13"));
    }
    assert!(DataLoader::new(Arc::new(Numbers(3)), DataLoaderConfig::new(0)).is_err());
}

/// Panics (a bug in the user's dataset) on sample 6.
struct Panicky;
impl Dataset for Panicky {
    fn len(&self) -> usize {
        12
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![1]
    }
    fn fill(&self, i: usize, x: &mut [f32]) -> Result<i64> {
        assert!(i != 6, "sample {i} is cursed");
        x[0] = i as f32;
        Ok(i as i64)
    }
}

#[test]
fn a_panic_in_a_worker_is_that_batch_error_and_the_workers_live_on() {
    for workers in [1, 3] {
        let cfg = DataLoaderConfig {
            num_workers: workers,
            ..DataLoaderConfig::new(4)
        };
        let mut dl = DataLoader::new(Arc::new(Panicky), cfg).unwrap();
        for epoch in 0..2 {
            let res: Vec<_> = dl.epoch(epoch).collect();
            assert_eq!(res.len(), 3);
            assert!(res[0].is_ok() && res[2].is_ok(), "workers {workers}");
            let m = res[1].as_ref().err().unwrap().to_string();
            assert!(
                m.contains("DataLoader")
                    && m.contains("panicked")
                    && m.contains("sample 6 is cursed"),
                "{m}"
            );
        }
    }
}

fn contents(b: Batch) -> (Vec<f32>, Vec<i64>) {
    (b.x.to_vec::<f32>().unwrap(), b.y.to_vec::<i64>().unwrap())
}

#[test]
fn device_batches_are_the_host_batches_in_order() {
    // The CPU, and the GPU where there is one (pinned buffers and the copy stream there).
    let mut devices = vec![Device::Cpu];
    if Device::best() != Device::Cpu {
        devices.push(Device::best());
    }
    for device in devices {
        for (workers, pin) in [(0, None), (2, None), (0, Some(device)), (3, Some(device))] {
            let cfg = DataLoaderConfig {
                shuffle: true,
                seed: 3,
                num_workers: workers,
                pin_memory: pin,
                ..DataLoaderConfig::new(4)
            };
            let mut dl = DataLoader::new(Arc::new(Numbers(10)), cfg).unwrap();
            let host: Vec<_> = dl.epoch(1).map(|b| contents(b.unwrap())).collect();
            assert_eq!(host.len(), 3);
            let it = dl.epoch(1).to_device(device);
            assert_eq!(it.size_hint(), (3, Some(3)));
            let on_device: Vec<_> = it
                .map(|b| {
                    let b = b.unwrap();
                    assert_eq!((b.x.device(), b.y.device()), (device, device));
                    assert_eq!(b.x.shape()[1..], [2]);
                    contents(b)
                })
                .collect();
            assert_eq!(on_device, host, "{device} workers {workers} pin {pin:?}");
            // An epoch abandoned with uploads in flight leaves the next one whole.
            let _ = dl.epoch(2).to_device(device).take(1).count();
            let again: Vec<_> = dl
                .epoch(1)
                .to_device(device)
                .map(|b| contents(b.unwrap()))
                .collect();
            assert_eq!(again, host);
        }
    }
}

/// Batches dropped while work that reads them is still queued: their device blocks go back
/// to the pool and the next uploads reuse them, which must not overwrite them under that work
/// (on the emulated device, `MANTISSA_EMU_STREAMS=others-first` runs the uploads as early as
/// their waits allow).
#[test]
fn device_batches_are_not_overwritten_under_queued_work() {
    for pin in [None, Some(Device::best())] {
        let cfg = DataLoaderConfig {
            num_workers: 2,
            pin_memory: pin,
            ..DataLoaderConfig::new(4)
        };
        let mut dl = DataLoader::new(Arc::new(Numbers(48)), cfg).unwrap();
        let want: Vec<Vec<f32>> = dl
            .epoch(0)
            .map(|b| b.unwrap().x.mul(3.0).unwrap().to_vec::<f32>().unwrap())
            .collect();
        // Each batch read by a queued product, then dropped at once.
        let tripled: Vec<Tensor> = dl
            .epoch(0)
            .to_device(Device::best())
            .map(|b| b.unwrap().x.mul(3.0).unwrap())
            .collect();
        assert_eq!(tripled.len(), 12);
        for (k, (t, w)) in tripled.iter().zip(&want).enumerate() {
            assert_eq!(&t.to_vec::<f32>().unwrap(), w, "batch {k}, pinned {pin:?}");
        }
    }
}

#[test]
fn device_batches_report_dataset_errors_and_bad_buffers() {
    for workers in [0, 2] {
        let cfg = DataLoaderConfig {
            num_workers: workers,
            pin_memory: Some(Device::best()),
            ..DataLoaderConfig::new(5)
        };
        let mut dl = DataLoader::new(Arc::new(Numbers(14)), cfg).unwrap();
        let res: Vec<_> = dl.epoch(0).to_device(Device::best()).collect();
        assert_eq!(res.len(), 3);
        assert!(res[0].is_ok() && res[1].is_ok());
        let e = res[2].as_ref().err().unwrap().to_string();
        assert!(e.contains("sample 13"), "{e}");
    }
    // Pinning for a GPU that cannot be used is an error when the loader is made.
    if Device::Cuda(0).check_available().is_err() {
        let cfg = DataLoaderConfig {
            pin_memory: Some(Device::Cuda(0)),
            ..DataLoaderConfig::new(5)
        };
        let e = DataLoader::new(Arc::new(Numbers(14)), cfg).err().unwrap();
        assert!(e.to_string().contains("cuda:0"), "{e}");
    }
    // Buffers that do not fit their shape are refused, on every path.
    let heap = |v: Vec<f32>| HostBuffer::Heap(CpuStorage::F32(v));
    let labels = |v: Vec<i64>| HostBuffer::Heap(CpuStorage::I64(v));
    let bad = || HostBatch {
        x: heap(vec![0.5; 5]),
        y: labels(vec![1, 2]),
        shape: vec![2, 2],
        y_shape: vec![2],
    };
    let e = bad().into_batch(Device::Cpu).err().unwrap().to_string();
    assert!(
        e.contains("HostBatch::into_batch") && e.contains("[2, 2]"),
        "{e}"
    );
    let wrong_labels = HostBatch {
        x: heap(vec![0.5; 4]),
        y: labels(vec![1, 2, 3]),
        shape: vec![2, 2],
        y_shape: vec![3],
    };
    assert!(wrong_labels.into_batch(Device::best()).is_err());
    assert!(!bad().x.is_pinned());
}

/// Token windows and their next tokens (i64) with a per-window f32 weight pair as targets:
/// shapes and dtypes other than the simple form's.
fn token_tensors(n: usize) -> (Tensor, Tensor, Tensor) {
    let tokens: Vec<i64> = (0..n as i64 * 5).map(|v| (v * 7) % 31).collect();
    let x = Tensor::from_vec(tokens.clone(), &[n, 5], Device::Cpu).unwrap();
    let next: Vec<i64> = tokens.iter().map(|t| (t + 1) % 31).collect();
    let y = Tensor::from_vec(next, &[n, 5], Device::Cpu).unwrap();
    let w: Vec<f32> = (0..n * 2).map(|i| 0.25 * i as f32 - 3.0).collect();
    (x, y, Tensor::from_vec(w, &[n, 2], Device::Cpu).unwrap())
}

#[test]
fn tensor_datasets_of_any_shape_and_dtype_batch_on_every_path() {
    let n = 11;
    let (x, y, w) = token_tensors(n);
    let mut devices = vec![Device::Cpu];
    if Device::best() != Device::Cpu {
        devices.push(Device::best());
    }
    for device in devices {
        for (workers, pin) in [(0, None), (2, Some(device))] {
            for (targets, want_dtype) in [(&y, DType::I64), (&w, DType::F32)] {
                let ds = TensorDataset::new(&x, targets).unwrap();
                assert_eq!((ds.len(), ds.feature_dtype()), (n, DType::I64));
                assert_eq!(ds.target_dtype(), want_dtype);
                let cfg = DataLoaderConfig {
                    shuffle: true,
                    seed: 4,
                    num_workers: workers,
                    pin_memory: pin,
                    ..DataLoaderConfig::new(4)
                };
                let mut dl = DataLoader::new(Arc::new(ds), cfg).unwrap();
                let order: Vec<i64> = dl.order(2).unwrap().iter().map(|&i| i as i64).collect();
                let index = Tensor::from_vec(order, &[n], Device::Cpu).unwrap();
                let (want_x, want_y) = (
                    x.index_select(0, &index).unwrap(),
                    targets.index_select(0, &index).unwrap(),
                );
                let got: Vec<Batch> = dl.epoch(2).to_device(device).map(|b| b.unwrap()).collect();
                assert_eq!(got.len(), 3);
                let cat = |f: &dyn Fn(&Batch) -> &Tensor| {
                    let parts: Vec<Tensor> = got
                        .iter()
                        .map(|b| f(b).to_device(Device::Cpu).unwrap())
                        .collect();
                    Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0).unwrap()
                };
                assert_eq!(got[0].x.device(), device);
                assert_eq!(got[0].y.shape(), &[4, targets.shape()[1]]);
                let what = format!("{device} workers {workers} pin {pin:?} {want_dtype:?}");
                assert_eq!(
                    cat(&|b| &b.x).to_le_bytes().unwrap(),
                    want_x.to_le_bytes().unwrap(),
                    "{what}"
                );
                assert_eq!(
                    cat(&|b| &b.y).to_le_bytes().unwrap(),
                    want_y.to_le_bytes().unwrap(),
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn datasets_that_fill_the_wrong_form_are_errors_that_say_so() {
    let (x, y, _) = token_tensors(3);
    let err = TensorDataset::new(&x, &y.narrow(0, 0, 2).unwrap())
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("[3, 5]") && err.to_string().contains("[2, 5]"),
        "{err}"
    );
    assert!(
        TensorDataset::new(&Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap(), &y).is_err()
    );
    /// The simple form's `fill`, with targets of two elements declared.
    struct PairTargets;
    impl Dataset for PairTargets {
        fn len(&self) -> usize {
            2
        }
        fn sample_shape(&self) -> Vec<usize> {
            vec![1]
        }
        fn target_shape(&self) -> Vec<usize> {
            vec![2]
        }
        fn fill(&self, _: usize, x: &mut [f32]) -> Result<i64> {
            x[0] = 1.0;
            Ok(0)
        }
    }
    /// Neither form.
    struct Nothing;
    impl Dataset for Nothing {
        fn len(&self) -> usize {
            2
        }
        fn sample_shape(&self) -> Vec<usize> {
            vec![1]
        }
    }
    let first = |ds: Arc<dyn Dataset>| {
        let mut dl = DataLoader::new(ds, DataLoaderConfig::new(2)).unwrap();
        dl.epoch(0).next().unwrap().err().unwrap().to_string()
    };
    let m = first(Arc::new(PairTargets));
    assert!(m.contains("fill_sample") && m.contains("2 elements"), "{m}");
    let m = first(Arc::new(Nothing));
    assert!(m.contains("neither fill nor fill_sample"), "{m}");
}

/// A dataset whose `len()` cannot be indexed on this host (its order alone past the host
/// memory limit) is an error from `order` and the epoch's first item, with and without
/// shuffling and workers: not a capacity panic or an 8 TiB allocation that aborts.
#[test]
fn a_dataset_too_large_to_index_is_an_error() {
    for n in [usize::MAX, 1 << 40, usize::MAX / 8 + 1] {
        for (shuffle, workers) in [(false, 0), (true, 0), (true, 2)] {
            let mut cfg = DataLoaderConfig::new(4);
            cfg.shuffle = shuffle;
            cfg.num_workers = workers;
            let mut dl = DataLoader::new(Arc::new(Numbers(n)), cfg).unwrap();
            assert_eq!(dl.len(), n.div_ceil(4));
            let e = dl.order(0).unwrap_err().to_string();
            assert!(
                e.contains("too large to index") && e.contains(&n.to_string()),
                "{e}"
            );
            let mut epoch = dl.epoch(0);
            let e = epoch.next().unwrap().err().expect("an error").to_string();
            assert!(e.contains("too large to index"), "{e}");
            assert!(epoch.next().is_none());
        }
    }
    // A dataset that fits still shuffles as before: a permutation.
    let mut cfg = DataLoaderConfig::new(4);
    cfg.shuffle = true;
    let dl = DataLoader::new(Arc::new(Numbers(1001)), cfg).unwrap();
    let mut order = dl.order(3).unwrap();
    assert_ne!(order, (0..1001).collect::<Vec<_>>());
    order.sort_unstable();
    assert_eq!(order, (0..1001).collect::<Vec<_>>());
}
