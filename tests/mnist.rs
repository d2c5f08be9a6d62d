//! Real MNIST: the files are found or fetched (this fails, not skips, without them), checked,
//! a short CPU training run on a subset reaches a stated accuracy, and the CNN of
//! `examples/mnist.rs` stopped after epoch 2 and resumed reproduces epoch 3 bit-exactly.

mod common;

use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::data::mnist::{locate_or_fetch, Mnist};
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::*;
use std::sync::Arc;

fn splits() -> (Mnist, Mnist) {
    let dir = locate_or_fetch().expect("MNIST must be available for this test");
    (
        Mnist::load(&dir, true).unwrap(),
        Mnist::load(&dir, false).unwrap(),
    )
}

#[test]
fn mnist_subset_training_reaches_93_percent() {
    let (train, test) = splits();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    let mut counts = [0usize; 10];
    for &l in &test.labels {
        counts[l as usize] += 1;
    }
    assert!(
        counts.iter().all(|&c| (800..1200).contains(&c)),
        "{counts:?}"
    );
    let mut x = vec![0f32; 784];
    train.fill(0, &mut x).unwrap();
    let mean = x.iter().sum::<f32>() / 784.0;
    assert!(mean > -0.5 && mean < 1.0, "normalised pixels: {mean}");

    // 784-128-10 MLP, 20k training images, 3 epochs of SGD with momentum.
    let mut g = Generator::new(0);
    let mut net = Sequential::new()
        .push(Flatten)
        .push(Linear::new(784, 128, true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Linear::new(128, 10, true, &mut g).unwrap());
    let mut opt = Sgd::new(
        net.parameters(),
        SgdConfig {
            momentum: 0.9,
            ..SgdConfig::new(0.02)
        },
    )
    .unwrap();
    let cfg = DataLoaderConfig {
        shuffle: true,
        seed: 1,
        num_workers: 2,
        ..DataLoaderConfig::new(64)
    };
    let mut dl = DataLoader::new(Arc::new(train.take(20_000)), cfg).unwrap();
    for epoch in 0..3 {
        for b in dl.epoch(epoch) {
            let b = b.unwrap();
            let loss = net
                .forward(&b.x)
                .unwrap()
                .cross_entropy(&b.y, Default::default())
                .unwrap();
            opt.zero_grad();
            loss.backward().unwrap();
            opt.step().unwrap();
        }
    }
    net.eval();
    let mut test_dl =
        DataLoader::new(Arc::new(test.take(2_000)), DataLoaderConfig::new(500)).unwrap();
    let (mut hits, mut n) = (0.0, 0.0);
    for b in test_dl.epoch(0) {
        let b = b.unwrap();
        let pred = no_grad(|| net.forward(&b.x))
            .unwrap()
            .argmax(1, false)
            .unwrap();
        hits += pred
            .eq(&b.y)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .item()
            .unwrap();
        n += b.y.numel() as f64;
    }
    let acc = hits / n;
    eprintln!("MNIST subset test accuracy: {:.2}%", 100.0 * acc);
    assert!(acc >= 0.93, "accuracy {acc}");
}

/// The CNN of `examples/mnist.rs` (pytorch/examples' MNIST net), with its two Dropout layers.
fn cnn(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    let conv = |i, o, g: &mut Generator| Conv2d::new(i, o, 3, Conv2dOptions::default(), true, g);
    Sequential::new()
        .push(conv(1, 32, &mut g).unwrap())
        .push(Activation::Relu)
        .push(conv(32, 64, &mut g).unwrap())
        .push(Activation::Relu)
        .push(MaxPool2d(MaxPool2dOptions::new(2)))
        .push(Dropout::new(0.25, seed ^ 1))
        .push(Flatten)
        .push(Linear::new(9216, 128, true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Dropout::new(0.5, seed ^ 2))
        .push(Linear::new(128, 10, true, &mut g).unwrap())
}

/// The example's training run, on `images` MNIST images: Adam under a per-step one-cycle
/// schedule, shuffled batches of 64 from two workers, 3 epochs.
struct CnnRun {
    net: Sequential,
    opt: Adam,
    scaler: GradScaler,
    dl: DataLoader,
    cycle: OneCycle,
}

impl CnnRun {
    const EPOCHS: usize = 3;

    fn new(images: usize, seed: u64) -> CnnRun {
        let train = Mnist::load(&locate_or_fetch().unwrap(), true).unwrap();
        let net = cnn(seed);
        let opt = Adam::new(net.parameters(), AdamConfig::adam(3e-3)).unwrap();
        let cfg = DataLoaderConfig {
            shuffle: true,
            seed: 1,
            num_workers: 2,
            ..DataLoaderConfig::new(64)
        };
        let dl = DataLoader::new(Arc::new(train.take(images)), cfg).unwrap();
        let cycle = OneCycle::new(3e-3, Self::EPOCHS * dl.len());
        let scaler = GradScaler::new(GradScalerConfig {
            enabled: false,
            ..Default::default()
        })
        .unwrap();
        CnnRun {
            net,
            opt,
            scaler,
            dl,
            cycle,
        }
    }

    /// Trains epoch `epoch` and returns its losses, read back after the epoch.
    fn epoch(&mut self, epoch: usize) -> Vec<f32> {
        self.net.train();
        let first = epoch * self.dl.len();
        let mut losses = Vec::new();
        for (k, b) in self.dl.epoch(epoch).enumerate() {
            let b = b.unwrap();
            self.opt.set_lr(self.cycle.lr(first + k));
            let (loss, _) =
                train::classify_step(&self.net, &mut self.opt, &mut self.scaler, None, &b.x, &b.y)
                    .unwrap();
            losses.push(loss);
        }
        losses.iter().map(|l| l.item().unwrap() as f32).collect()
    }

    fn values(&self) -> Vec<Vec<f32>> {
        self.net
            .parameters()
            .iter()
            .map(|p| p.to_vec::<f32>().unwrap())
            .collect()
    }
}

#[test]
fn cnn_resumed_after_epoch_2_reproduces_epoch_3_bit_exactly() {
    let images = 384;
    let p = common::temp_checkpoint("mnist", "resume");
    let mut full = CnnRun::new(images, 7);
    for e in 0..2 {
        full.epoch(e);
    }
    checkpoint::save(&p, &full.net, Some(&full.opt), &[("epoch", "2".into())]).unwrap();
    let want_losses = full.epoch(2);
    let want = full.values();

    // A run built from another seed loads the checkpoint and trains epoch 3.
    let mut resumed = CnnRun::new(images, 99);
    let meta = checkpoint::load(&p, &mut resumed.net, Some(&mut resumed.opt)).unwrap();
    assert_eq!(meta["epoch"], "2");
    assert_eq!(resumed.epoch(2), want_losses, "epoch 3's losses");
    assert!(resumed.values() == want, "epoch 3's parameters differ");

    // Without the dropout streams (a checkpoint of the parameters and the optimizer alone,
    // streams restarted from their seeds), epoch 3 comes out otherwise: the states matter.
    let mut restarted = CnnRun::new(images, 7);
    checkpoint::load(&p, &mut restarted.net, Some(&mut restarted.opt)).unwrap();
    for (i, (_, t)) in restarted.net.named_generators().iter().enumerate() {
        let seed = [7 ^ 1, 7 ^ 2][i];
        no_grad(|| t.copy_(&Generator::new(seed).to_tensor()?)).unwrap();
    }
    assert_ne!(restarted.epoch(2), want_losses);
    std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
}
