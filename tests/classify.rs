//! The training-loop helpers of `mantissa::train`: a small classifier trained with
//! `classify_step` learns a separable problem, and `evaluate_classifier` agrees with the
//! accuracy counted here.

use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::train::{
    classify_micro_step, classify_step, evaluate_classifier, parse_precision, Accumulation,
};
use mantissa::*;
use std::sync::Arc;

/// Points in the plane, labelled by quadrant (4 classes), away from the axes.
struct Quadrants(Vec<[f32; 2]>);

impl Quadrants {
    fn new(n: usize, seed: u64) -> Quadrants {
        let u = Generator::new(seed).uniform(2 * n);
        let off = |v: f64| (if v < 0.5 { v - 0.6 } else { v - 0.4 }) as f32;
        Quadrants(u.chunks(2).map(|p| [off(p[0]), off(p[1])]).collect())
    }
    fn label(p: &[f32; 2]) -> i64 {
        (p[0] > 0.0) as i64 + 2 * (p[1] > 0.0) as i64
    }
}

impl Dataset for Quadrants {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![2]
    }
    fn fill(&self, i: usize, x: &mut [f32]) -> Result<i64> {
        x.copy_from_slice(&self.0[i]);
        Ok(Quadrants::label(&self.0[i]))
    }
}

#[test]
fn a_classifier_learns_quadrants_with_the_training_helpers() {
    for precision in ["fp32", "bf16", "fp16"] {
        let low = parse_precision(precision, Device::Cpu).unwrap();
        let mut g = Generator::new(4);
        let net = Sequential::new()
            .push(Linear::new(2, 32, true, &mut g).unwrap())
            .push(Activation::Relu)
            .push(Linear::new(32, 4, true, &mut g).unwrap());
        let mut opt = Adam::new(net.parameters(), AdamConfig::adam(1e-2)).unwrap();
        let mut scaler = GradScaler::new(GradScalerConfig {
            enabled: low == Some(DType::F16),
            ..Default::default()
        })
        .unwrap();
        let mut train = DataLoader::new(
            Arc::new(Quadrants::new(512, 1)),
            DataLoaderConfig {
                shuffle: true,
                ..DataLoaderConfig::new(32)
            },
        )
        .unwrap();
        let (mut first, mut last) = (None, 0.0);
        for epoch in 0..8 {
            for b in train.epoch(epoch) {
                let b = b.unwrap();
                let (loss, hits) =
                    classify_step(&net, &mut opt, &mut scaler, low, &b.x, &b.y).unwrap();
                let hits = hits.item().unwrap();
                assert!((0.0..=32.0).contains(&hits) && hits.fract() == 0.0);
                last = loss.item().unwrap();
                first.get_or_insert(last);
            }
        }
        let first = first.unwrap();
        assert!(last < 0.3 * first, "{precision}: loss {first} -> {last}");
        // Accuracy on fresh points: from the helper, and counted here.
        let test = Quadrants::new(300, 2);
        let x: Vec<f32> = test.0.iter().flatten().copied().collect();
        let logits = no_grad(|| net.forward(&Tensor::from_vec(x, &[300, 2], Device::Cpu)?));
        let pred = logits
            .unwrap()
            .argmax(1, false)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        let right = test
            .0
            .iter()
            .zip(&pred)
            .filter(|(p, &k)| Quadrants::label(p) == k);
        let want = right.count() as f64 / 300.0;
        let mut dl = DataLoader::new(Arc::new(test), DataLoaderConfig::new(64)).unwrap();
        let (loss, acc) =
            evaluate_classifier(&net, &mut dl, Device::Cpu, low, MemoryFormat::Contiguous).unwrap();
        assert!(acc > 0.95, "{precision}: accuracy {acc}");
        assert!(loss.is_finite() && loss > 0.0);
        if low.is_none() {
            assert_eq!(acc, want);
        } else {
            assert!((acc - want).abs() <= 0.02, "{precision}: {acc} vs {want}");
        }
    }
    assert!(parse_precision("fp8", Device::Cpu)
        .unwrap_err()
        .to_string()
        .contains("fp8"));
}

/// Parameters after one epoch of 256 quadrant points, SGD with momentum, batches of `batch`
/// samples from the loader, stepping every `every` batches.
fn after_an_epoch(batch: usize, every: usize, low: Option<DType>) -> Vec<Vec<f32>> {
    let mut g = Generator::new(9);
    let net = Sequential::new()
        .push(Linear::new(2, 16, true, &mut g).unwrap())
        .push(Activation::Tanh)
        .push(Linear::new(16, 4, true, &mut g).unwrap());
    let cfg = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.05)
    };
    let mut opt = Sgd::new(net.parameters(), cfg).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: low == Some(DType::F16),
        ..Default::default()
    })
    .unwrap();
    let loader_cfg = DataLoaderConfig {
        shuffle: true,
        seed: 3,
        ..DataLoaderConfig::new(batch)
    };
    let mut train = DataLoader::new(Arc::new(Quadrants::new(256, 5)), loader_cfg).unwrap();
    let mut acc = Accumulation::new(every).unwrap();
    let steps = train.len();
    for (k, b) in train.epoch(0).enumerate() {
        let b = b.unwrap();
        classify_micro_step(
            &net,
            &mut opt,
            &mut scaler,
            low,
            (&b.x, &b.y),
            &mut acc,
            k + 1 == steps,
        )
        .unwrap();
    }
    net.parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect()
}

fn rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den).sqrt()
}

#[test]
fn accumulating_four_batches_of_16_trains_as_batches_of_64() {
    let big = after_an_epoch(64, 1, None);
    let acc = after_an_epoch(16, 4, None);
    let e = rel(&acc, &big);
    assert!(e < 1e-6, "fp32: relative difference {e:.2e}");
    // The optimizer stepped 4 times, not 16: stepping every batch of 16 goes elsewhere.
    let every = after_an_epoch(16, 1, None);
    assert!(rel(&every, &big) > 1e-3);
    // Under fp16 autocast with the scaler, within half-precision rounding.
    let e = rel(
        &after_an_epoch(16, 4, Some(DType::F16)),
        &after_an_epoch(64, 1, Some(DType::F16)),
    );
    assert!(e < 1e-2, "fp16: relative difference {e:.2e}");
    assert!(Accumulation::new(0).is_err());
}

/// An optimizer whose steps fail while `failing` is above 0 (counting down), else Sgd's.
struct Flaky {
    sgd: Sgd,
    failing: usize,
    steps: usize,
}

impl Optimizer for Flaky {
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        if self.failing > 0 {
            self.failing -= 1;
            return Err(Error::Invalid {
                op: "flaky",
                msg: "this step fails".into(),
            });
        }
        self.steps += 1;
        self.sgd.step_unless(found_inf)
    }
    fn group(&self) -> &ParamGroup {
        self.sgd.group()
    }
    fn group_mut(&mut self) -> &mut ParamGroup {
        self.sgd.group_mut()
    }
    fn lr(&self) -> f64 {
        self.sgd.lr()
    }
    fn set_lr(&mut self, lr: f64) {
        self.sgd.set_lr(lr)
    }
}

/// After a failed step the accumulation goes on: the next group steps on its own
/// micro-batches' gradients (not the failed group's added in), every time.
#[test]
fn a_failed_accumulation_step_leaves_the_next_group_whole() {
    for (every, fails) in [(2, 1), (3, 2), (1, 1)] {
        let x = Tensor::from_vec(
            (0..24).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>(),
            &[12, 2],
            Device::Cpu,
        )
        .unwrap();
        let y = Tensor::from_vec(
            (0..12).map(|i| i % 4).collect::<Vec<i64>>(),
            &[12],
            Device::Cpu,
        )
        .unwrap();
        // The first `failing` steps fail; the first `skip` groups are not run at all.
        let run = |failing: usize, skip: usize| {
            let net = Linear::new(2, 4, true, &mut Generator::new(1)).unwrap();
            let sgd = Sgd::new(net.parameters(), SgdConfig::new(0.1)).unwrap();
            let mut opt = Flaky {
                sgd,
                failing,
                steps: 0,
            };
            let mut scaler = GradScaler::new(Default::default()).unwrap();
            let mut acc = Accumulation::new(every).unwrap();
            let (xs, ys) = (x.split(1, 0).unwrap(), y.split(1, 0).unwrap());
            let (xs, ys) = (&xs[skip * every..], &ys[skip * every..]);
            let mut errors = 0;
            for (i, (xb, yb)) in xs.iter().zip(ys.iter()).enumerate() {
                let r = classify_micro_step(
                    &net,
                    &mut opt,
                    &mut scaler,
                    None,
                    (xb, yb),
                    &mut acc,
                    i + 1 == xs.len(),
                );
                errors += r.is_err() as usize;
            }
            let params: Vec<Vec<f32>> = net
                .parameters()
                .iter()
                .map(|p| p.to_vec::<f32>().unwrap())
                .collect();
            (params, opt.steps, errors)
        };
        let groups = 12usize.div_ceil(every);
        let (after_failures, steps, errors) = run(fails, 0);
        assert_eq!((steps, errors), (groups - fails, fails), "every {every}");
        // Exactly as a run that never saw the failed groups' micro-batches.
        let (clean, steps, _) = run(0, fails);
        assert_eq!(steps, groups - fails);
        assert_eq!(after_failures, clean, "every {every}");
        // And they moved the parameters away from a run whose every step failed.
        assert_ne!(after_failures, run(groups, 0).0, "every {every}");
    }
}
