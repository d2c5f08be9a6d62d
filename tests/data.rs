//! IDX reader errors, DataLoader ordering/shuffling/workers, checkpoints.

use mantissa::data::mnist::{parse_idx, read_idx, Mnist};
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
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
    let mut all = dl.order(0);
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
