//! Real MNIST: the files are found or fetched (this fails, not skips, without them), checked,
//! and a short CPU training run on a subset reaches a stated accuracy.

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
