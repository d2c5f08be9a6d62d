//! The training-loop helpers of `mantissa::train`: a small classifier trained with
//! `classify_step` learns a separable problem, and `evaluate_classifier` agrees with the
//! accuracy counted here.

use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::train::{classify_step, evaluate_classifier, parse_precision};
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
