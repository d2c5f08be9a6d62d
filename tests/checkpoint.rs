//! Checkpoints: round trips, mismatch reports, and exact resumption.

mod common;

use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::*;
use std::sync::Arc;

fn model(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    Sequential::new()
        .push(Conv2d::new(1, 3, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(BatchNorm2d::new(3).unwrap())
        .push(Activation::Relu)
        .push(Flatten)
        .push(Linear::new(3 * 4 * 4, 4, true, &mut g).unwrap())
}

fn all_values(m: &dyn Module) -> Vec<(String, Vec<f64>)> {
    let mut v = Vec::new();
    m.visit("", &mut |n, t, _| v.push((n, t.to_vec_f64().unwrap())));
    v
}

struct Blobs;
impl Dataset for Blobs {
    fn len(&self) -> usize {
        40
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![1, 6, 6]
    }
    fn fill(&self, i: usize, x: &mut [f32]) -> Result<i64> {
        let noise = Generator::new(i as u64).normal(36);
        for (k, o) in x.iter_mut().enumerate() {
            *o = noise[k] as f32 + (i % 4) as f32 * (k % 3) as f32 * 0.5;
        }
        Ok((i % 4) as i64)
    }
}

fn train_epoch(m: &Sequential, opt: &mut dyn Optimizer, dl: &mut DataLoader, epoch: usize) {
    for b in dl.epoch(epoch) {
        let b = b.unwrap();
        let loss = m
            .forward(&b.x)
            .unwrap()
            .cross_entropy(&b.y, Default::default())
            .unwrap();
        opt.zero_grad();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
}

fn path(name: &str) -> std::path::PathBuf {
    common::temp_checkpoint("ckpt", name)
}

#[test]
fn resuming_reproduces_the_uninterrupted_run_exactly() {
    let cfg = DataLoaderConfig {
        shuffle: true,
        seed: 5,
        num_workers: 2,
        ..DataLoaderConfig::new(8)
    };
    let sgd = SgdConfig {
        momentum: 0.9,
        weight_decay: 1e-4,
        ..SgdConfig::new(0.05)
    };
    let p = path("resume");
    // Uninterrupted: 3 epochs, checkpoint after the first.
    let full = model(1);
    let mut opt = Sgd::new(full.parameters(), sgd).unwrap();
    let mut dl = DataLoader::new(Arc::new(Blobs), cfg).unwrap();
    train_epoch(&full, &mut opt, &mut dl, 0);
    checkpoint::save(&p, &full, Some(&opt), &[("epoch", "1".into())]).unwrap();
    for e in 1..3 {
        train_epoch(&full, &mut opt, &mut dl, e);
    }
    // Resumed: a differently initialised model loads the checkpoint and runs epochs 1 and 2.
    let mut resumed = model(99);
    let mut opt2 = Sgd::new(resumed.parameters(), sgd).unwrap();
    let meta = checkpoint::load(&p, &mut resumed, Some(&mut opt2)).unwrap();
    let start: usize = meta["epoch"].parse().unwrap();
    let mut dl2 = DataLoader::new(Arc::new(Blobs), cfg).unwrap();
    for e in start..3 {
        train_epoch(&resumed, &mut opt2, &mut dl2, e);
    }
    assert_eq!(
        all_values(&resumed),
        all_values(&full),
        "bit-identical parameters and buffers"
    );
    std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
}

#[test]
fn round_trip_keeps_every_tensor_and_dtype() {
    let p = path("roundtrip");
    let mut m = model(3);
    m.to_dtype(DType::BF16).unwrap();
    let mut opt = Adam::new(m.parameters(), AdamConfig::adam(1e-3)).unwrap();
    let x = Tensor::randn(&[2, 1, 6, 6], DType::BF16, Device::Cpu).unwrap();
    m.forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    checkpoint::save(&p, &m, Some(&opt), &[]).unwrap();
    let (tensors, _) = checkpoint::read(&p).unwrap();
    assert!(tensors.contains_key("model.1.num_batches_tracked"));
    assert!(tensors.contains_key("optim.0.exp_avg") && tensors.contains_key("optim.5.step"));
    let mut other = model(4);
    other.to_dtype(DType::BF16).unwrap();
    let mut opt2 = Adam::new(other.parameters(), AdamConfig::adam(1e-3)).unwrap();
    checkpoint::load(&p, &mut other, Some(&mut opt2)).unwrap();
    assert_eq!(all_values(&other), all_values(&m));
    let s1 = opt.state_tensors().unwrap();
    let s2 = opt2.state_tensors().unwrap();
    for ((n1, t1), (n2, t2)) in s1.iter().zip(&s2) {
        assert_eq!(n1, n2);
        assert_eq!(
            (t1.dtype(), t1.to_vec_f64().unwrap()),
            (t2.dtype(), t2.to_vec_f64().unwrap())
        );
    }
    // No temporary file is left beside the checkpoint.
    let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
}

#[test]
fn mismatches_are_all_reported_and_nothing_is_changed() {
    let p = path("mismatch");
    let m = model(3);
    checkpoint::save(&p, &m, None, &[]).unwrap();
    let mut g = Generator::new(0);
    let mut other = Sequential::new()
        .push(Conv2d::new(1, 5, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(Linear::new(2, 2, true, &mut g).unwrap())
        .push(Linear::new(2, 2, true, &mut g).unwrap());
    let before = all_values(&other);
    let err = checkpoint::load(&p, &mut other, None)
        .unwrap_err()
        .to_string();
    for needle in [
        "0.weight",
        "[3, 1, 3, 3]",
        "[5, 1, 3, 3]",
        "missing model tensor 2.weight",
        "unexpected tensor model.4.weight",
        "unexpected tensor model.1.running_mean",
    ] {
        assert!(err.contains(needle), "{needle} not in {err}");
    }
    assert_eq!(all_values(&other), before);
    let mut same = model(8);
    let mut opt = Sgd::new(same.parameters(), SgdConfig::new(0.1)).unwrap();
    let err = checkpoint::load(&p, &mut same, Some(&mut opt))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no optimizer state"), "{err}");
    // A file cut short, or not a checkpoint at all, is named so, with its path.
    let whole = std::fs::read(&p).unwrap();
    let cases: [(&[u8], &str); 5] = [
        (&whole[..whole.len() - 7], "truncated"),
        (&whole[..100], "truncated"),
        (&whole[..5], "truncated"),
        (b"not a safetensors file", "not a mantissa checkpoint"),
        (b"PK\x03\x04 a zip archive", "torch.save"),
    ];
    for (bytes, needle) in cases {
        std::fs::write(&p, bytes).unwrap();
        let err = checkpoint::load(&p, &mut same, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(needle) && err.contains(&*p.to_string_lossy()),
            "{err}"
        );
    }
    let mut extra = whole.clone();
    extra.extend([0u8; 3]);
    std::fs::write(&p, &extra).unwrap();
    let err = checkpoint::load(&p, &mut same, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 bytes after the last tensor"), "{err}");
    // A safetensors file of another program: no model tensors.
    let other = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu).unwrap();
    let bytes = safetensors::serialize(
        [(
            "weight",
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![2],
                &other.to_le_bytes().unwrap(),
            )
            .unwrap(),
        )],
        None,
    )
    .unwrap();
    std::fs::write(&p, bytes).unwrap();
    let err = checkpoint::load(&p, &mut same, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a mantissa checkpoint"), "{err}");
    std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
}

/// Blobs' model with a Dropout after the convolution (a generator state at `2.generator`).
fn dropout_model(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    Sequential::new()
        .push(Conv2d::new(1, 3, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Dropout::new(0.3, seed))
        .push(Flatten)
        .push(Linear::new(3 * 4 * 4, 4, true, &mut g).unwrap())
}

#[test]
fn dropout_and_sgld_streams_resume_where_they_stood() {
    let cfg = DataLoaderConfig {
        shuffle: true,
        seed: 2,
        ..DataLoaderConfig::new(8)
    };
    let sgd = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.05)
    };
    let p = path("streams");
    let full = dropout_model(1);
    let mut opt = Sgld::new(full.parameters(), sgd, 1e-3, 11).unwrap();
    let mut dl = DataLoader::new(Arc::new(Blobs), cfg).unwrap();
    train_epoch(&full, &mut opt, &mut dl, 0);
    checkpoint::save(&p, &full, Some(&opt), &[]).unwrap();
    let saved = checkpoint::read(&p).unwrap().0;
    assert!(saved.contains_key("model.2.generator"));
    assert!(saved.contains_key("optim.generator"));
    train_epoch(&full, &mut opt, &mut dl, 1);

    // Another model and optimizer seed: the checkpoint brings both streams.
    let mut resumed = dropout_model(5);
    let mut opt2 = Sgld::new(resumed.parameters(), sgd, 1e-3, 12).unwrap();
    checkpoint::load(&p, &mut resumed, Some(&mut opt2)).unwrap();
    assert_eq!(opt2.generator(), opt.generator().map(|_| saved_gen(&saved)));
    let mut dl2 = DataLoader::new(Arc::new(Blobs), cfg).unwrap();
    train_epoch(&resumed, &mut opt2, &mut dl2, 1);
    assert_eq!(all_values(&resumed), all_values(&full));
    assert_eq!(opt2.generator(), opt.generator());
    std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
}

fn saved_gen(saved: &std::collections::BTreeMap<String, Tensor>) -> Generator {
    Generator::from_tensor(&saved["optim.generator"]).unwrap()
}

#[test]
fn generator_states_follow_the_strict_rules_except_when_absent() {
    let p = path("generators");
    let mut with_dropout = dropout_model(1);
    // A model without the Dropout has the same parameter names ([2] is a ReLU there).
    let mut g = Generator::new(1);
    let mut plain = Sequential::new()
        .push(Conv2d::new(1, 3, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Activation::Relu)
        .push(Flatten)
        .push(Linear::new(3 * 4 * 4, 4, true, &mut g).unwrap());
    // A checkpoint without generator states (an older one) loads; the stream stays put.
    checkpoint::save(&p, &plain, None, &[]).unwrap();
    let before = with_dropout.named_generators()[0]
        .1
        .to_vec::<i64>()
        .unwrap();
    checkpoint::load(&p, &mut with_dropout, None).unwrap();
    assert_eq!(
        with_dropout.named_generators()[0]
            .1
            .to_vec::<i64>()
            .unwrap(),
        before
    );
    // One with a state the model has no place for is refused, naming it.
    checkpoint::save(&p, &with_dropout, None, &[]).unwrap();
    let err = checkpoint::load(&p, &mut plain, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unexpected tensor model.2.generator"), "{err}");

    // An optimizer that draws nothing refuses a generator; SGLD takes a state without one.
    let mut sgld = Sgld::new(with_dropout.parameters(), SgdConfig::new(0.1), 1.0, 3).unwrap();
    for p in with_dropout.parameters() {
        p.set_grad(Some(p.ones_like().unwrap())).unwrap();
    }
    sgld.step().unwrap();
    let state: std::collections::BTreeMap<String, Tensor> =
        sgld.state_tensors().unwrap().into_iter().collect();
    let mut sgd = Sgd::new(with_dropout.parameters(), SgdConfig::new(0.1)).unwrap();
    let err = sgd.load_state_tensors(&state).unwrap_err().to_string();
    assert!(err.contains("generator"), "{err}");
    let at = sgld.generator();
    let mut without = state.clone();
    without.remove("generator");
    sgld.load_state_tensors(&without).unwrap();
    assert_eq!(sgld.generator(), at);
    // A malformed state is refused with its shape.
    let mut bad = state;
    bad.insert(
        "generator".into(),
        Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap(),
    );
    let err = sgld.load_state_tensors(&bad).unwrap_err().to_string();
    assert!(err.contains("[3]"), "{err}");
    std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
}
