//! `MultiheadAttention` in each of PyTorch's variants against PyTorch: every case of
//! `tests/torch_ref/mha_variants.safetensors` (written by `tests/torch_ref/mha_variants.py`)
//! holds an `nn.MultiheadAttention`'s state_dict, its inputs and masks, and PyTorch's output,
//! attention weights and gradients (of `sum(y * gy) + sum(w * gw)`) computed in float64 from
//! the same f32 values. Each is loaded here by PyTorch's parameter names and run in f32 on the
//! CPU; values and gradients must agree within a norm-wise relative error of 1e-5.

mod common;
use common::stored;
use mantissa::nn::{MhaForward, MhaOptions, Module, MultiheadAttention};
use mantissa::{DType, Device, Generator, Tensor};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};

const FILE: &[u8] = include_bytes!("torch_ref/mha_variants.safetensors");
const TOL: f64 = 1e-5;

/// Norm-wise relative error of `got` against `want`.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.shape(), want.shape());
    let g = got.to_vec_f64().unwrap();
    let w = want.to_vec_f64().unwrap();
    let diff: f64 = g.iter().zip(&w).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f64 = w.iter().map(|b| b * b).sum();
    assert!(norm > 0.0, "a reference of zeros checks nothing");
    (diff / norm).sqrt()
}

struct Case {
    name: String,
    spec: HashMap<String, usize>,
    tensors: HashMap<String, Tensor>,
}

impl Case {
    fn flag(&self, k: &str) -> bool {
        self.spec[k] == 1
    }
    fn t(&self, k: &str) -> &Tensor {
        self.tensors
            .get(k)
            .unwrap_or_else(|| panic!("{}: no {k}", self.name))
    }
}

fn cases() -> Vec<Case> {
    let st = SafeTensors::deserialize(FILE).unwrap();
    let (_, meta) = SafeTensors::read_metadata(FILE).unwrap();
    let meta = meta.metadata().clone().unwrap();
    let mut out = Vec::new();
    for (key, spec) in meta {
        let name = key.strip_prefix("case.").unwrap().to_string();
        let spec = spec
            .split(' ')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.parse().unwrap())
            })
            .collect();
        let tensors = st
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| {
                let rest = n.strip_prefix(&format!("{name}."))?;
                Some((rest.to_string(), stored(&v)))
            })
            .collect();
        out.push(Case {
            name,
            spec,
            tensors,
        });
    }
    assert_eq!(out.len(), 7, "the file's cases");
    out
}

/// The case's module, built with its options and loaded with PyTorch's state_dict.
fn module(c: &Case) -> MultiheadAttention {
    let dim = |k: &str| Some(c.spec[k]);
    let o = MhaOptions {
        bias: c.flag("bias"),
        add_bias_kv: c.flag("add_bias_kv"),
        add_zero_attn: c.flag("add_zero_attn"),
        kdim: dim("kdim"),
        vdim: dim("vdim"),
        batch_first: c.flag("batch_first"),
        dropout: 0.0,
    };
    let mut m = MultiheadAttention::with_options(8, 2, o, &mut Generator::new(1)).unwrap();
    let state: BTreeMap<String, Tensor> = c
        .tensors
        .iter()
        .filter_map(|(k, t)| Some((k.strip_prefix("param.")?.to_string(), t.clone())))
        .collect();
    // Strict: every PyTorch name is one of the module's and every parameter is loaded.
    m.load_state_dict(&state, true)
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
    m
}

#[test]
fn every_variant_matches_pytorch_in_values_and_gradients() {
    let mut bad = Vec::new();
    for c in cases() {
        let m = module(&c);
        let leaf = |k: &str| c.t(k).detach().requires_grad(true).unwrap();
        let (q, k, v) = (leaf("in.query"), leaf("in.key"), leaf("in.value"));
        let a = MhaForward {
            key_padding_mask: c.tensors.get("in.key_padding_mask"),
            attn_mask: c.tensors.get("in.attn_mask"),
            need_weights: c.flag("need_weights"),
            average_attn_weights: c.flag("average_attn_weights"),
            is_causal: false,
        };
        let (y, w) = m.forward_with(&q, &k, &v, a).unwrap();
        let mut loss = y.mul(c.t("g.y")).unwrap().sum_all().unwrap();
        let mut check = vec![("output".to_string(), y.clone(), c.t("out.y").clone())];
        match (w, c.tensors.get("out.w")) {
            (Some(w), Some(want)) => {
                loss = loss
                    .add(&w.mul(c.t("g.w")).unwrap().sum_all().unwrap())
                    .unwrap();
                check.push(("weights".into(), w, want.clone()));
            }
            (None, None) => {}
            (w, want) => panic!(
                "{}: weights {:?} vs PyTorch {:?}",
                c.name,
                w.is_some(),
                want
            ),
        }
        loss.backward().unwrap();
        for (name, t) in [("query", &q), ("key", &k), ("value", &v)] {
            let want = c.t(&format!("grad.{name}")).clone();
            check.push((format!("grad of {name}"), t.grad().unwrap(), want));
        }
        let params = m.named_parameters();
        let n_grads = c.tensors.keys().filter(|k| k.starts_with("pgrad.")).count();
        assert_eq!(params.len(), n_grads, "{}: parameter count", c.name);
        for (name, p) in params {
            let want = c.t(&format!("pgrad.{name}")).clone();
            check.push((format!("grad of {name}"), p.grad().unwrap(), want));
        }
        for (what, got, want) in check {
            let e = rel_err(&got, &want);
            if e.is_nan() || e > TOL {
                bad.push(format!("{}: {what}: relative error {e:.2e}", c.name));
            }
        }
    }
    assert!(bad.is_empty(), "mismatches:\n{}", bad.join("\n"));
}

#[test]
fn parameters_have_pytorchs_names_and_shapes() {
    let mut g = Generator::new(0);
    let names = |m: &MultiheadAttention| -> Vec<(String, Vec<usize>)> {
        m.named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec()))
            .collect()
    };
    let packed = MultiheadAttention::new(8, 2, false, &mut g).unwrap();
    let s = |n: &str, sh: &[usize]| (n.to_string(), sh.to_vec());
    assert_eq!(
        names(&packed),
        vec![
            s("in_proj_weight", &[24, 8]),
            s("in_proj_bias", &[24]),
            s("out_proj.weight", &[8, 8]),
            s("out_proj.bias", &[8]),
        ]
    );
    let o = MhaOptions {
        kdim: Some(3),
        vdim: Some(5),
        bias: false,
        add_bias_kv: true,
        ..Default::default()
    };
    let split = MultiheadAttention::with_options(8, 2, o, &mut g).unwrap();
    assert_eq!(
        names(&split),
        vec![
            s("q_proj_weight", &[8, 8]),
            s("k_proj_weight", &[8, 3]),
            s("v_proj_weight", &[8, 5]),
            s("bias_k", &[1, 1, 8]),
            s("bias_v", &[1, 1, 8]),
            s("out_proj.weight", &[8, 8]),
        ]
    );
    // kdim and vdim equal to E keep the packed projection, as in PyTorch.
    let o = MhaOptions {
        kdim: Some(8),
        vdim: Some(8),
        ..Default::default()
    };
    let same = MultiheadAttention::with_options(8, 2, o, &mut g).unwrap();
    assert!(same.in_proj_weight.is_some() && same.q_proj_weight.is_none());
}

#[test]
fn bad_arguments_are_errors_naming_the_shapes() {
    let mut g = Generator::new(0);
    for (embed, heads, o) in [
        (8, 3, MhaOptions::default()),
        (
            8,
            2,
            MhaOptions {
                kdim: Some(0),
                ..Default::default()
            },
        ),
        (
            8,
            2,
            MhaOptions {
                dropout: 1.0,
                ..Default::default()
            },
        ),
    ] {
        assert!(MultiheadAttention::with_options(embed, heads, o, &mut g).is_err());
    }
    let o = MhaOptions {
        kdim: Some(3),
        ..Default::default()
    };
    let m = MultiheadAttention::with_options(8, 2, o, &mut g).unwrap();
    let x = |s: &[usize]| Tensor::randn(s, DType::F32, Device::Cpu).unwrap();
    let a = MhaForward::default();
    // A key of E features where kdim is 3.
    let e = m
        .forward_with(&x(&[4, 2, 8]), &x(&[5, 2, 8]), &x(&[5, 2, 8]), a)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[5, 2, 8]") && e.contains("[S, N, 3]"), "{e}");
    // Unbatched query with a batched key.
    assert!(m
        .forward_with(&x(&[4, 8]), &x(&[5, 2, 3]), &x(&[5, 2, 8]), a)
        .is_err());
    // An unbatched key padding mask must be [S].
    let pad = Tensor::zeros(&[1, 5], DType::U8, Device::Cpu).unwrap();
    let a = MhaForward {
        key_padding_mask: Some(&pad),
        ..Default::default()
    };
    let e = m
        .forward_with(&x(&[4, 8]), &x(&[5, 3]), &x(&[5, 8]), a)
        .unwrap_err()
        .to_string();
    assert!(e.contains("key_padding_mask"), "{e}");
}

#[test]
fn weights_sum_to_one_and_a_fully_masked_query_gets_zeros() {
    let mut g = Generator::new(3);
    let o = MhaOptions {
        add_zero_attn: false,
        ..Default::default()
    };
    let mut m = MultiheadAttention::with_options(8, 2, o, &mut g).unwrap();
    let bias: Vec<f32> = (1..=8).map(|i| i as f32 * 0.25).collect();
    m.out_proj.bias = Some(Tensor::from_vec(bias.clone(), &[8], Device::Cpu).unwrap());
    let x = Tensor::randn_with(&[4, 2, 8], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    // The second sequence's keys are all padding.
    let pad = Tensor::from_vec(vec![0u8, 0, 1, 0, 1, 1, 1, 1], &[2, 4], Device::Cpu).unwrap();
    let a = MhaForward {
        key_padding_mask: Some(&pad),
        average_attn_weights: false,
        ..Default::default()
    };
    let (y, w) = m.forward_with(&x, &x, &x, a).unwrap();
    let w = w.unwrap();
    assert_eq!(w.shape(), &[2, 2, 4, 4]);
    let sums = w.sum(&[-1], false).unwrap().to_vec::<f32>().unwrap();
    for (i, s) in sums.iter().enumerate() {
        let want = if i < 8 { 1.0 } else { 0.0 };
        assert!((s - want).abs() < 1e-6, "row {i}: {s}");
    }
    // The padded key of the first sequence gets no weight.
    let w0 = w.select(0, 0).unwrap().to_vec::<f32>().unwrap();
    assert!(w0.chunks(4).all(|row| row[2] == 0.0));
    // The fully masked sequence's output is out_proj's bias, at every position.
    let dead = y.select(1, 1).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(dead, bias.repeat(4));
    let live = y.select(1, 0).unwrap().to_vec::<f32>().unwrap();
    assert!(live.iter().all(|v| v.is_finite()) && live != bias.repeat(4));
}

/// Under bf16 autocast, a masked attention with its weights runs with the mask in the
/// projections' dtype and stays within bf16's rounding of the f32 result, weights included.
#[test]
fn masked_attention_with_weights_runs_under_autocast() {
    let mut g = Generator::new(5);
    let o = MhaOptions {
        add_bias_kv: true,
        add_zero_attn: true,
        ..Default::default()
    };
    let m = MultiheadAttention::with_options(8, 2, o, &mut g).unwrap();
    let x = Tensor::randn_with(&[4, 2, 8], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let pad = Tensor::from_vec(vec![0u8, 0, 1, 0, 0, 1, 1, 0], &[2, 4], Device::Cpu).unwrap();
    let a = MhaForward {
        key_padding_mask: Some(&pad),
        ..Default::default()
    };
    let (y, w) = m.forward_with(&x, &x, &x, a).unwrap();
    let (yl, wl) = {
        let _autocast = mantissa::amp::autocast(DType::BF16);
        m.forward_with(&x, &x, &x, a).unwrap()
    };
    assert_eq!(yl.dtype(), DType::BF16);
    for (got, want, what) in [(&yl, &y, "output"), (&wl.unwrap(), &w.unwrap(), "weights")] {
        let e = rel_err(got, want);
        assert!(e < 3e-2, "{what}: relative error {e:.2e} under autocast");
    }
}
