//! Numerics of amp-semantics.md §6 items 18-20: half-input GEMM against an f64 reference
//! within the §4 bands, f32-forced ops finite on inputs that overflow f16, and a short
//! training run in bf16 (plain autocast, and with master weights) tracking the f32 losses.

mod common;
use common::*;
use mantissa::nn::{Embedding, Linear, Lstm, Module};
use mantissa::optim::*;
use mantissa::*;

/// `mean|got - want| / mean|want|`, the §4 measure.
fn mean_rel(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b).abs()).sum();
    num / want.iter().map(|b| b.abs()).sum::<f64>()
}

/// Item 18: A, B ~ N(0, 1), 256 x K x 256. Inputs rounded to the dtype, products accumulated
/// in f32, output stored in the dtype, against f64 on the unrounded inputs. §4 measured
/// 3e-7 (f32), 2.9e-4 + up to 2.4e-4 output rounding (f16), 2.3e-3 + 2e-3 (bf16); the lower
/// bounds show the half runs really rounded.
#[test]
fn gemm_error_against_f64_stays_in_the_bands() {
    for k in [256usize, 1024] {
        let a = f32s(&[256, k], k as u64);
        let b = f32s(&[k, 256], k as u64 + 1);
        let want = vals(
            &a.to_dtype(DType::F64)
                .unwrap()
                .matmul(&b.to_dtype(DType::F64).unwrap())
                .unwrap(),
        );
        for (dt, lo, hi) in [
            (DType::F32, 0.0, 1.5e-6),
            (DType::F16, 1e-4, 1e-3),
            (DType::BF16, 1e-3, 8e-3),
        ] {
            let c = a
                .to_dtype(dt)
                .unwrap()
                .matmul(&b.to_dtype(dt).unwrap())
                .unwrap();
            assert_eq!(c.dtype(), dt);
            let e = mean_rel(&vals(&c), &want);
            assert!(
                (lo..=hi).contains(&e),
                "{dt:?} K={k}: mean relative error {e:.2e} outside [{lo:.0e}, {hi:.0e}]"
            );
        }
    }
}

/// Item 19: under f16 autocast, softmax, log_softmax, LayerNorm and the losses run in f32
/// and stay finite on inputs beyond f16's range (65504).
#[test]
fn f32_ops_stay_finite_on_inputs_that_overflow_f16() {
    let _g = amp::autocast(DType::F16).unwrap();
    let big = Tensor::from_vec(vec![1e5f32, 3e4, -1e5, 7e4], &[1, 4], Device::Cpu).unwrap();
    let finite = |t: Tensor, what: &str| {
        assert_eq!(t.dtype(), DType::F32, "{what} not in f32");
        assert!(vals(&t).iter().all(|v| v.is_finite()), "{what}: {t:?}");
    };
    finite(big.softmax(1).unwrap(), "softmax");
    finite(big.log_softmax(1).unwrap(), "log_softmax");
    finite(
        big.layer_norm(&[4], None, None, 1e-5).unwrap(),
        "layer_norm",
    );
    let y = Tensor::from_vec(vec![2i64], &[1], Device::Cpu).unwrap();
    finite(
        big.cross_entropy(&y, Default::default()).unwrap(),
        "cross_entropy",
    );
    finite(
        big.mse_loss(&big.mul(0.5).unwrap(), Reduction::Mean)
            .unwrap(),
        "mse_loss",
    );
}

/// A next-token model: embedding, LSTM, linear head.
struct TinyLm {
    emb: Embedding,
    lstm: Lstm,
    head: Linear,
}

const VOCAB: usize = 40;

impl TinyLm {
    fn new(seed: u64) -> TinyLm {
        let mut g = Generator::new(seed);
        TinyLm {
            emb: Embedding::new(VOCAB, 16, &mut g).unwrap(),
            lstm: Lstm::new(16, 32, 1, true, &mut g).unwrap(),
            head: Linear::new(32, VOCAB, true, &mut g).unwrap(),
        }
    }
    fn params(&self) -> Vec<Tensor> {
        let mut p = self.emb.parameters();
        p.extend(self.lstm.parameters());
        p.extend(self.head.parameters());
        p
    }
    fn convert(&mut self, d: DType) {
        self.emb.to_dtype(d).unwrap();
        self.lstm.to_dtype(d).unwrap();
        self.head.to_dtype(d).unwrap();
    }
    fn loss(&self, tokens: &Tensor) -> Tensor {
        let (b, t) = (tokens.shape()[0], tokens.shape()[1]);
        let x = tokens.narrow(1, 0, t - 1).unwrap().contiguous().unwrap();
        let y = tokens
            .narrow(1, 1, t - 1)
            .unwrap()
            .reshape(&[b * (t - 1)])
            .unwrap();
        let h = self.lstm.forward(&self.emb.forward(&x).unwrap()).unwrap();
        let logits = self
            .head
            .forward(&h)
            .unwrap()
            .reshape(&[b * (t - 1), VOCAB])
            .unwrap();
        logits.cross_entropy(&y, Default::default()).unwrap()
    }
}

/// Ten AdamW steps on fixed token batches; the loss before each step.
fn losses(low: Option<DType>, masters: bool) -> Vec<f64> {
    let mut m = TinyLm::new(3);
    if masters {
        m.convert(DType::BF16);
    }
    let mut opt = Adam::new(m.params(), AdamConfig::adamw(1e-2)).unwrap();
    if masters {
        opt.use_master_weights(Rounding::Stochastic { seed: 5 })
            .unwrap();
    }
    let mut gen = Generator::new(9);
    (0..10)
        .map(|_| {
            // Sequences with structure (t, t+1, ...) so the loss has somewhere to go.
            let starts = gen.next_u32s(8);
            let toks: Vec<i64> = starts
                .iter()
                .flat_map(|s| (0..12).map(move |i| ((s + i) as usize % VOCAB) as i64))
                .collect();
            let tokens = Tensor::from_vec(toks, &[8, 12], Device::Cpu).unwrap();
            let _g = low.map(|d| amp::autocast(d).unwrap());
            let loss = m.loss(&tokens);
            drop(_g);
            opt.zero_grad();
            loss.backward().unwrap();
            opt.step().unwrap();
            loss.item().unwrap()
        })
        .collect()
}

/// Item 20: a short bf16 run keeps its losses within 0.05 of the f32 run, with f32
/// parameters under autocast and with bf16 parameters on f32 masters.
#[test]
fn ten_bf16_steps_track_the_f32_losses() {
    let f32_run = losses(None, false);
    assert!(
        f32_run[9] < f32_run[0] - 0.1,
        "the reference did not learn: {f32_run:?}"
    );
    for (name, run) in [
        ("bf16 autocast", losses(Some(DType::BF16), false)),
        ("bf16 master weights", losses(Some(DType::BF16), true)),
    ] {
        for (i, (a, b)) in run.iter().zip(&f32_run).enumerate() {
            assert!(
                (a - b).abs() < 0.05,
                "{name} step {i}: loss {a} vs f32 {b}\n{run:?}\n{f32_run:?}"
            );
        }
    }
}
