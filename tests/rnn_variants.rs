//! `Gru` and `Lstm` in PyTorch's variants (bidirectional, without biases, with `proj_size`,
//! unbatched, batch-first, dropout between layers) against PyTorch: each case of
//! `tests/torch_ref/rnn_variants.safetensors` (written by `tests/torch_ref/rnn_variants.py`)
//! is an `nn.GRU` or `nn.LSTM` with its state_dict, inputs, outputs, final states and the
//! gradients of `sum(out * g) + sum(h_n * gh) (+ sum(c_n * gc))` for the inputs and every
//! parameter, computed by PyTorch in float64 from f32 values. Here the module of the same
//! options loads the state_dict by PyTorch's names (strict: every name must match) and runs
//! in f32; everything must agree within a norm-wise relative error of 1e-5. On a CUDA
//! device, where there is one, too.
//!
//! Then what the file cannot show: the dropout between layers (its masks, its rate, only in
//! training, not on the last layer nor the final states), the reverse direction as a forward
//! layer over the reversed sequence, PyTorch's parameter order, and the refusals.

mod common;
use common::stored;
use mantissa::nn::{Gru, Lstm, Module, RnnOptions};
use mantissa::{DType, Device, Generator, Result, Tensor};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};

const CASES: &[u8] = include_bytes!("torch_ref/rnn_variants.safetensors");
/// Norm-wise relative error allowed for f32 results against PyTorch's float64 ones.
const TOL: f64 = 1e-5;

/// The norm-wise relative error of `got` against `want`, or a shape mismatch.
fn rel_err(got: &Tensor, want: &Tensor) -> std::result::Result<f64, String> {
    if got.shape() != want.shape() {
        return Err(format!(
            "shape {:?}, PyTorch {:?}",
            got.shape(),
            want.shape()
        ));
    }
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let num: f64 = g.iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = w.iter().map(|b| b * b).sum();
    Ok(num.sqrt() / den.sqrt().max(1e-12))
}

/// One case: its configuration and its tensors by name (`x`, `p.weight_ih_l0`, `out.y`, ...).
struct Case {
    spec: HashMap<String, String>,
    t: HashMap<String, Tensor>,
}

impl Case {
    fn num(&self, k: &str) -> usize {
        self.spec[k].parse().unwrap()
    }
    fn flag(&self, k: &str) -> bool {
        self.spec[k] == "1"
    }
    fn options(&self) -> RnnOptions {
        RnnOptions {
            num_layers: self.num("num_layers"),
            bias: self.flag("bias"),
            batch_first: self.flag("batch_first"),
            dropout: self.spec["dropout"].parse().unwrap(),
            bidirectional: self.flag("bidirectional"),
            proj_size: self.num("proj_size"),
        }
    }
}

fn cases() -> Vec<Case> {
    let st = SafeTensors::deserialize(CASES).unwrap();
    let (_, meta) = SafeTensors::read_metadata(CASES).unwrap();
    let meta = meta
        .metadata()
        .as_ref()
        .expect("case specs in the metadata");
    let mut out: Vec<Case> = (0..meta.len())
        .map(|n| Case {
            spec: meta[&format!("case.{n}")]
                .split(' ')
                .map(|kv| kv.split_once('=').unwrap())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            t: HashMap::new(),
        })
        .collect();
    for name in st.names() {
        let (n, rest) = name.split_once('.').unwrap();
        let t = stored(&st.tensor(name).unwrap());
        out[n.parse::<usize>().unwrap()]
            .t
            .insert(rest.to_string(), t);
    }
    out
}

/// A GRU or an LSTM.
enum Rnn {
    Gru(Gru),
    Lstm(Lstm),
}

impl Rnn {
    fn module(&mut self) -> &mut dyn Module {
        match self {
            Rnn::Gru(m) => m,
            Rnn::Lstm(m) => m,
        }
    }
}

/// Runs case `c` on `device`: the mismatches against PyTorch (empty when it agrees), and the
/// largest relative error.
fn check(c: &Case, device: Device) -> Result<(Vec<String>, f64)> {
    let opts = c.options();
    let (inp, hid) = (c.num("input"), c.num("hidden"));
    let mut g = Generator::new(0);
    let mut rnn = match c.spec["kind"].as_str() {
        "lstm" => Rnn::Lstm(Lstm::with_options(inp, hid, opts, &mut g)?),
        _ => Rnn::Gru(Gru::with_options(inp, hid, opts, &mut g)?),
    };
    // PyTorch's names, strictly: a name missing on either side is an error.
    let state: BTreeMap<String, Tensor> =
        c.t.iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("p.")?.to_string(), v.clone())))
            .collect();
    let m = rnn.module();
    m.load_state_dict(&state, true)?;
    m.to_device(device)?;
    if c.spec["mode"] == "eval" {
        m.eval();
    }
    let leaf = |k: &str| -> Result<Option<Tensor>> {
        c.t.get(k)
            .map(|t| t.to_device(device)?.detach().requires_grad(true))
            .transpose()
    };
    let (x, h0, c0) = (leaf("x")?.expect("an input"), leaf("h0")?, leaf("c0")?);
    // sum(t * the case's tensor `k`).
    let dot = |t: &Tensor, k: &str| t.mul(&c.t[k].to_device(device)?)?.sum_all();
    let (outs, loss) = match &rnn {
        Rnn::Lstm(l) => {
            let (y, (h, cn)) = l.forward_with_state(&x, h0.as_ref().zip(c0.as_ref()))?;
            let loss = dot(&y, "g")?.add(&dot(&h, "gh")?)?.add(&dot(&cn, "gc")?)?;
            (vec![("y", y), ("h", h), ("c", cn)], loss)
        }
        Rnn::Gru(gru) => {
            let (y, h) = gru.forward_with_state(&x, h0.as_ref())?;
            let loss = dot(&y, "g")?.add(&dot(&h, "gh")?)?;
            (vec![("y", y), ("h", h)], loss)
        }
    };
    loss.backward()?;
    let (mut bad, mut worst) = (vec![], 0f64);
    let mut compare = |what: String, got: Option<Tensor>| match got {
        None => bad.push(format!("{what}: none")),
        Some(got) => match rel_err(&got, &c.t[&what]) {
            Err(e) => bad.push(format!("{what}: {e}")),
            Ok(e) if e > TOL => bad.push(format!("{what}: relative error {e:.2e}")),
            Ok(e) => worst = worst.max(e),
        },
    };
    for (k, y) in outs {
        compare(format!("out.{k}"), Some(y));
    }
    for (k, t) in [("x", Some(&x)), ("h0", h0.as_ref()), ("c0", c0.as_ref())] {
        if let Some(t) = t {
            compare(format!("grad.{k}"), t.grad());
        }
    }
    let params = rnn.module().named_parameters();
    let counts = (params.len(), state.len());
    for (name, p) in params {
        compare(format!("grad.p.{name}"), p.grad());
    }
    if counts.0 != counts.1 {
        bad.push(format!("{} parameters, PyTorch {}", counts.0, counts.1));
    }
    Ok((bad, worst))
}

#[test]
fn variants_match_pytorch() {
    let mut devices = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(d) => devices.push(d),
        Err(e) => println!("skipped: no CUDA device ({e})"),
    }
    // PyTorch's references are exact f32: the device's LSTM products run without TF32.
    #[cfg(feature = "cuda-backend")]
    mantissa::backend::cuda::conv::set_cudnn_allow_tf32(false);
    let cases = cases();
    assert!(cases.len() >= 14, "only {} cases in the file", cases.len());
    for device in devices {
        let (mut failures, mut worst) = (vec![], 0f64);
        for (n, c) in cases.iter().enumerate() {
            let bad = match check(c, device) {
                Ok((bad, w)) => {
                    worst = worst.max(w);
                    bad
                }
                Err(e) => vec![format!("error: {e}")],
            };
            if !bad.is_empty() {
                failures.push(format!("case {n} {:?}:\n  {}", c.spec, bad.join("\n  ")));
            }
        }
        println!(
            "{device:?}: {} cases, {} differ; the largest relative error of the others {worst:.1e}",
            cases.len(),
            failures.len()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

/// `n` values from N(0, 1) as a CPU tensor of `shape`.
fn randn(shape: &[usize], g: &mut Generator) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = g.normal(n).into_iter().map(|v| v as f32).collect();
    Tensor::from_vec(v, shape, Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// A 2-layer GRU whose second layer passes its input on, scaled down: its update gate is
/// shut (bias -100), its recurrent weights are zero and its new-gate input weights 0.01 I, so
/// each output is `tanh(0.01 v)` of the dropped-out first layer's output `v`, read back with
/// `atanh`.
fn see_through_gru(dropout: f64) -> Gru {
    let (inp, hid) = (4, 16);
    let opts = RnnOptions {
        num_layers: 2,
        dropout,
        ..Default::default()
    };
    let mut gru = Gru::with_options(inp, hid, opts, &mut Generator::new(3)).unwrap();
    let mut w_ih = vec![0f32; 3 * hid * hid];
    let mut b_ih = vec![0f32; 3 * hid];
    for i in 0..hid {
        w_ih[(2 * hid + i) * hid + i] = 0.01;
        b_ih[hid + i] = -100.0;
    }
    let t = |v: Vec<f32>, s: &[usize]| Tensor::from_vec(v, s, Device::Cpu).unwrap();
    let mut state = gru.state_dict();
    state.insert("weight_ih_l1".into(), t(w_ih, &[3 * hid, hid]));
    state.insert(
        "weight_hh_l1".into(),
        t(vec![0.0; 3 * hid * hid], &[3 * hid, hid]),
    );
    state.insert("bias_ih_l1".into(), t(b_ih, &[3 * hid]));
    state.insert("bias_hh_l1".into(), t(vec![0.0; 3 * hid], &[3 * hid]));
    gru.load_state_dict(&state, true).unwrap();
    gru
}

#[test]
fn dropout_acts_between_layers_in_training_only() {
    let p = 0.5;
    let mut gru = see_through_gru(p);
    let x = randn(&[20, 8, 4], &mut Generator::new(11));
    // Training: the first layer's output through a mask of 0 or 1 / (1 - p).
    let (y1, h1) = gru.forward_with_state(&x, None).unwrap();
    let (y2, _) = gru.forward_with_state(&x, None).unwrap();
    gru.eval();
    let (ye, he) = gru.forward_with_state(&x, None).unwrap();
    let (kept, mut zeros, mut counted) = (1.0 / (1.0 - p), 0usize, 0usize);
    for (t, e) in values(&y1).iter().zip(values(&ye)) {
        if e.abs() < 1e-4 {
            continue;
        }
        let ratio = t.atanh() / e.atanh();
        assert!(
            ratio.abs() < 1e-3 || (ratio - kept).abs() < 1e-3,
            "mask factor {ratio}, not 0 or {kept}"
        );
        zeros += (ratio.abs() < 1e-3) as usize;
        counted += 1;
    }
    assert!(counted > 2000, "{counted} elements compared");
    // 2560 draws: the rate of zeros is p within five standard deviations (0.05).
    let rate = zeros as f64 / counted as f64;
    assert!((rate - p).abs() < 0.05, "dropped {rate}, want {p}");
    // A new mask each call.
    assert_ne!(values(&y1), values(&y2));
    // The first layer's final state is its own, undropped; the last layer's is its output.
    let layer = |h: &Tensor, l: usize| values(&h.select(0, l as i64).unwrap());
    assert_eq!(layer(&h1, 0), layer(&he, 0));
    assert_eq!(layer(&h1, 1), values(&y1.select(0, 19).unwrap()));

    // Eval mode is the dropout-free module; so is a dropout of 0 in training.
    let plain = see_through_gru(0.0);
    let (y0, h0) = plain.forward_with_state(&x, None).unwrap();
    assert_eq!((values(&ye), values(&he)), (values(&y0), values(&h0)));
    // The mask generator is a module tensor, outside the state_dict; none without dropout.
    assert_eq!(gru.named_generators()[0].0, "generator");
    assert!(!gru.state_dict().contains_key("generator"));
    assert!(plain.named_generators().is_empty());
    // Back in training mode, masks again.
    gru.train();
    assert_ne!(values(&gru.forward(&x).unwrap()), values(&y0));
}

#[test]
fn lstm_dropout_in_training_only() {
    let x = randn(&[6, 3, 4], &mut Generator::new(5));
    for proj_size in [0, 3] {
        let opts = |dropout| RnnOptions {
            num_layers: 3,
            dropout,
            proj_size,
            bidirectional: true,
            ..Default::default()
        };
        let mut lstm = Lstm::with_options(4, 5, opts(0.4), &mut Generator::new(2)).unwrap();
        let plain = Lstm::with_options(4, 5, opts(0.0), &mut Generator::new(2)).unwrap();
        let (yt, (ht, ct)) = lstm.forward_with_state(&x, None).unwrap();
        lstm.eval();
        let (ye, (he, ce)) = lstm.forward_with_state(&x, None).unwrap();
        let (y0, (h0, c0)) = plain.forward_with_state(&x, None).unwrap();
        assert_eq!(values(&ye), values(&y0));
        assert_eq!((values(&he), values(&ce)), (values(&h0), values(&c0)));
        assert_ne!(values(&yt), values(&ye));
        // Layer 0's states (both directions) come before any dropout.
        let first = |t: &Tensor| values(&t.narrow(0, 0, 2).unwrap());
        assert_eq!((first(&ht), first(&ct)), (first(&he), first(&ce)));
    }
}

/// The parameters of `m` with `_reverse` removed from their names (keeping only those), or
/// without the reverse ones.
fn direction(m: &dyn Module, reverse: bool) -> BTreeMap<String, Tensor> {
    m.state_dict()
        .into_iter()
        .filter(|(k, _)| k.ends_with("_reverse") == reverse)
        .map(|(k, v)| (k.trim_end_matches("_reverse").to_string(), v))
        .collect()
}

/// `t` with its steps (dim 0) in reverse order.
fn flip(t: &Tensor) -> Tensor {
    let n = t.shape()[0];
    let idx: Vec<i64> = (0..n as i64).rev().collect();
    t.index_select(0, &Tensor::from_vec(idx, &[n], Device::Cpu).unwrap())
        .unwrap()
}

fn close(what: &str, got: &Tensor, want: &Tensor) {
    let e = rel_err(got, want).unwrap();
    assert!(e < 1e-6, "{what}: relative error {e:.2e}");
}

#[test]
fn reverse_direction_is_a_forward_layer_over_the_reversed_sequence() {
    let x = randn(&[7, 2, 3], &mut Generator::new(9));
    let bi = RnnOptions {
        bidirectional: true,
        ..Default::default()
    };
    let g = &mut Generator::new(4);
    let gru = Gru::with_options(3, 4, bi, g).unwrap();
    let (y, h) = gru.forward_with_state(&x, None).unwrap();
    for (d, reverse) in [(0, false), (1, true)] {
        let mut one = Gru::with_options(3, 4, RnnOptions::default(), g).unwrap();
        one.load_state_dict(&direction(&gru, reverse), true)
            .unwrap();
        let input = if reverse { flip(&x) } else { x.clone() };
        let (yd, hd) = one.forward_with_state(&input, None).unwrap();
        let yd = if reverse { flip(&yd) } else { yd };
        close("gru output", &y.narrow(2, 4 * d, 4).unwrap(), &yd);
        close("gru state", &h.narrow(0, d, 1).unwrap(), &hd);
    }
    // The LSTM: the fused op reversed, and the projected composition reading backwards.
    for proj_size in [0, 2] {
        let opts = |bidirectional| RnnOptions {
            bidirectional,
            proj_size,
            ..Default::default()
        };
        let lstm = Lstm::with_options(3, 4, opts(true), g).unwrap();
        let (y, (h, c)) = lstm.forward_with_state(&x, None).unwrap();
        let out = if proj_size > 0 { proj_size } else { 4 };
        for (d, reverse) in [(0, false), (1, true)] {
            let mut one = Lstm::with_options(3, 4, opts(false), g).unwrap();
            one.load_state_dict(&direction(&lstm, reverse), true)
                .unwrap();
            let input = if reverse { flip(&x) } else { x.clone() };
            let (yd, (hd, cd)) = one.forward_with_state(&input, None).unwrap();
            let yd = if reverse { flip(&yd) } else { yd };
            close("lstm output", &y.narrow(2, out * d, out).unwrap(), &yd);
            close("lstm h", &h.narrow(0, d, 1).unwrap(), &hd);
            close("lstm c", &c.narrow(0, d, 1).unwrap(), &cd);
        }
    }
}

#[test]
fn parameters_in_pytorchs_order() {
    let opts = RnnOptions {
        num_layers: 2,
        bidirectional: true,
        proj_size: 2,
        ..Default::default()
    };
    let lstm = Lstm::with_options(3, 4, opts, &mut Generator::new(0)).unwrap();
    let names: Vec<String> = lstm.named_parameters().into_iter().map(|p| p.0).collect();
    let mut want = vec![];
    for l in 0..2 {
        for suffix in ["", "_reverse"] {
            for w in ["weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"] {
                want.push(format!("{w}_l{l}{suffix}"));
            }
        }
    }
    assert_eq!(names, want);
    let shapes: Vec<Vec<usize>> = lstm
        .parameters()
        .iter()
        .map(|p| p.shape().to_vec())
        .collect();
    // Layer 1 reads both directions' projected outputs (2 * 2); w_hh reads the projection.
    assert_eq!(
        shapes[0..5],
        [vec![16, 3], vec![16, 2], vec![16], vec![16], vec![2, 4]]
    );
    assert_eq!(shapes[10], [16, 4]);
    assert_eq!(lstm.options(), opts);

    let no_bias = RnnOptions {
        bias: false,
        num_layers: 2,
        ..Default::default()
    };
    let gru = Gru::with_options(3, 4, no_bias, &mut Generator::new(0)).unwrap();
    let names: Vec<String> = gru.state_dict().into_keys().collect();
    assert_eq!(
        names,
        [
            "weight_hh_l0",
            "weight_hh_l1",
            "weight_ih_l0",
            "weight_ih_l1"
        ]
    );
    assert_eq!(gru.options(), no_bias);
    // `new` is `with_options` with the defaults: the same draws, the same weights.
    let a = Gru::new(3, 4, 2, true, &mut Generator::new(1)).unwrap();
    let opts = RnnOptions {
        num_layers: 2,
        batch_first: true,
        ..Default::default()
    };
    let b = Gru::with_options(3, 4, opts, &mut Generator::new(1)).unwrap();
    let vals = |m: &Gru| m.parameters().iter().map(values).collect::<Vec<_>>();
    assert_eq!(vals(&a), vals(&b));
}

/// The message of `r`'s error, which must name every one of `words`.
fn refused<T>(r: Result<T>, words: &[&str]) {
    let msg = match r {
        Ok(_) => panic!("accepted; want an error naming {words:?}"),
        Err(e) => e.to_string(),
    };
    for w in words {
        assert!(msg.contains(w), "{msg:?} does not name {w:?}");
    }
}

#[test]
fn invalid_options_and_inputs_are_refused() {
    let g = &mut Generator::new(0);
    let o = RnnOptions::default;
    for p in [-0.1, 1.5, f64::NAN] {
        let opts = RnnOptions {
            dropout: p,
            num_layers: 2,
            ..o()
        };
        refused(
            Gru::with_options(3, 4, opts, g),
            &["Gru::with_options", "dropout", &format!("{p}")],
        );
        refused(
            Lstm::with_options(3, 4, opts, g),
            &["Lstm::with_options", &format!("{p}")],
        );
    }
    // 0 and 1 are in range, as in PyTorch.
    for p in [0.0, 1.0] {
        let opts = RnnOptions { dropout: p, ..o() };
        assert!(Gru::with_options(3, 4, opts, g).is_ok());
    }
    let proj = |proj_size| RnnOptions { proj_size, ..o() };
    refused(
        Gru::with_options(3, 4, proj(2), g),
        &["Gru::with_options", "proj_size 2"],
    );
    for p in [4, 5] {
        refused(
            Lstm::with_options(3, 4, proj(p), g),
            &["Lstm::with_options", &format!("proj_size {p}"), "hidden 4"],
        );
    }
    let layers = RnnOptions {
        num_layers: 0,
        ..o()
    };
    refused(
        Lstm::with_options(3, 4, layers, g),
        &["Lstm::with_options", "layers 0"],
    );
    refused(Gru::new(3, 0, 1, false, g), &["Gru::new", "hidden 0"]);

    // Inputs: the rank, the features, and states shaped for the input's batching.
    let bi = RnnOptions {
        bidirectional: true,
        proj_size: 2,
        ..o()
    };
    let lstm = Lstm::with_options(3, 4, bi, g).unwrap();
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, Device::Cpu).unwrap();
    refused(
        lstm.forward_with_state(&z(&[2, 5, 2, 3]), None),
        &["lstm", "[2, 5, 2, 3]"],
    );
    refused(
        lstm.forward_with_state(&z(&[5, 2]), None),
        &["lstm", "[5, 2]"],
    );
    refused(
        lstm.forward_with_state(&z(&[0, 2, 3]), None),
        &["lstm", "length 0"],
    );
    let (h, c) = (z(&[2, 2]), z(&[2, 4]));
    assert!(lstm.forward_with_state(&z(&[5, 3]), Some((&h, &c))).is_ok());
    // A batched state with an unbatched input, and the other way round.
    let (h3, c3) = (z(&[2, 1, 2]), z(&[2, 1, 4]));
    refused(
        lstm.forward_with_state(&z(&[5, 3]), Some((&h3, &c3))),
        &["lstm", "[2, 2]"],
    );
    refused(
        lstm.forward_with_state(&z(&[5, 1, 3]), Some((&h, &c))),
        &["lstm", "[2, 1, 2]"],
    );
    // c keeps the hidden size, h has the projection's.
    refused(
        lstm.forward_with_state(&z(&[5, 3]), Some((&c, &c))),
        &["lstm", "[2, 2]"],
    );
    let gru = Gru::with_options(
        3,
        4,
        RnnOptions {
            bidirectional: true,
            ..o()
        },
        g,
    )
    .unwrap();
    refused(
        gru.forward_with_state(&z(&[5, 2, 3]), Some(&z(&[1, 2, 4]))),
        &["gru", "[2, 2, 4]"],
    );
}
