//! Conv1d, BatchNorm1d, GroupNorm and ModuleList train a model; `state_dict` and
//! `load_state_dict` move its weights through a safetensors file; MultiheadAttention and Gru
//! learn small tasks; gradients of the functional forms by finite differences.

mod common;
use common::*;
use mantissa::nn::{
    Activation, BatchNorm1d, Conv1d, GroupNorm, Linear, Module, ModuleList, Visitor, VisitorMut,
};
use mantissa::optim::{Adam, AdamConfig, Optimizer};
use mantissa::*;

/// A 1-D CNN: two conv blocks (Conv1d, a norm, ReLU) in a ModuleList, mean over time, a
/// linear head.
struct Net {
    blocks: ModuleList,
    norms: ModuleList,
    head: Linear,
}

impl Net {
    fn new(seed: u64) -> Net {
        let mut g = Generator::new(seed);
        let o = Conv1dOptions {
            padding: 1,
            ..Default::default()
        };
        let mut blocks = ModuleList::new();
        blocks.push(Conv1d::new(1, 8, 3, o, true, &mut g).unwrap());
        blocks.push(Conv1d::new(8, 8, 3, o, true, &mut g).unwrap());
        let mut norms = ModuleList::new();
        norms.push(BatchNorm1d::new(8).unwrap());
        norms.push(GroupNorm::new(4, 8, true).unwrap());
        Net {
            blocks,
            norms,
            head: Linear::new(8, 2, true, &mut g).unwrap(),
        }
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (conv, norm) in self.blocks.iter().zip(self.norms.iter()) {
            h = Activation::Relu.forward(&norm.forward(&conv.forward(&h)?)?)?;
        }
        self.head.forward(&h.mean(&[2], false)?)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.blocks.visit(&nn::join(p, "blocks"), f);
        self.norms.visit(&nn::join(p, "norms"), f);
        self.head.visit(&nn::join(p, "head"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.blocks.visit_mut(&nn::join(p, "blocks"), f)?;
        self.norms.visit_mut(&nn::join(p, "norms"), f)?;
        self.head.visit_mut(&nn::join(p, "head"), f)
    }
}

/// Sequences of 16 steps: class 1 holds a rising ramp, class 0 a falling one, under noise.
fn data() -> (Tensor, Tensor) {
    let noise = f32s(&[64, 1, 16], 9).mul(0.3).unwrap();
    let ramp: Vec<f32> = (0..64 * 16)
        .map(|i| {
            let (n, t) = (i / 16, (i % 16) as f32 / 15.0 - 0.5);
            if n % 2 == 1 {
                t
            } else {
                -t
            }
        })
        .collect();
    let x = Tensor::from_vec(ramp, &[64, 1, 16], Device::Cpu)
        .unwrap()
        .add(&noise)
        .unwrap();
    let y: Vec<i64> = (0..64).map(|n| (n % 2) as i64).collect();
    (x, Tensor::from_vec(y, &[64], Device::Cpu).unwrap())
}

#[test]
fn a_1d_cnn_with_the_new_layers_trains_and_moves_by_state_dict() {
    let mut net = Net::new(1);
    let (x, y) = data();
    let mut opt = Adam::new(net.parameters(), AdamConfig::adam(1e-2)).unwrap();
    let loss = |net: &Net| {
        net.forward(&x)
            .unwrap()
            .cross_entropy(&y, Default::default())
            .unwrap()
    };
    let first = loss(&net).item().unwrap();
    for _ in 0..60 {
        opt.zero_grad();
        loss(&net).backward().unwrap();
        opt.step().unwrap();
    }
    let last = loss(&net).item().unwrap();
    assert!(last < 0.25 * first, "loss {first} -> {last}");
    net.eval();
    let logits = net.forward(&x).unwrap();
    let right = logits.argmax(1, false).unwrap().eq(&y).unwrap();
    let acc = vals(&right.to_dtype(DType::F32).unwrap())
        .iter()
        .sum::<f64>()
        / 64.0;
    assert!(acc > 0.95, "accuracy {acc}");

    // PyTorch's names, buffers included, generators not.
    let state = net.state_dict();
    let names: Vec<&str> = state.keys().map(|k| k.as_str()).collect();
    assert!(names.contains(&"blocks.1.weight") && names.contains(&"norms.0.running_var"));
    assert!(names.contains(&"norms.0.num_batches_tracked") && names.contains(&"norms.1.bias"));
    assert_eq!(names.len(), 2 * 2 + 5 + 2 + 2);
    let path = temp_checkpoint("modules_more", "state");
    checkpoint::write_tensors(&path, &state, &[("format", "pt".into())]).unwrap();
    let (read, meta) = checkpoint::read(&path).unwrap();
    assert_eq!(meta["format"], "pt");
    let mut other = Net::new(2);
    other.eval();
    assert_eq!(
        other.load_state_dict(&read, true).unwrap(),
        Default::default()
    );
    assert_eq!(vals(&other.forward(&x).unwrap()), vals(&logits));
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// A float `num_batches_tracked` (as a state written by another tool, or through a float
/// format) converts into batch norm's i64 buffer, as PyTorch's `copy_` does; a value the
/// buffer cannot hold unchanged (2.5, NaN) is refused by name, and nothing is written.
#[test]
fn load_state_dict_converts_a_float_counter_into_the_integer_buffer() {
    let src = nn::BatchNorm2d::new(3).unwrap();
    let mut state = src.state_dict();
    state.insert(
        "num_batches_tracked".into(),
        Tensor::from_vec(vec![5.0f32], &[], Device::Cpu).unwrap(),
    );
    let mut bn = nn::BatchNorm2d::new(3).unwrap();
    bn.load_state_dict(&state, true).unwrap();
    let n = &bn.state_dict()["num_batches_tracked"];
    assert_eq!(
        (n.dtype(), n.to_vec::<i64>().unwrap()),
        (DType::I64, vec![5])
    );
    for bad in [2.5, f64::NAN] {
        state.insert(
            "num_batches_tracked".into(),
            Tensor::from_vec(vec![bad], &[], Device::Cpu).unwrap(),
        );
        let e = bn.load_state_dict(&state, true).unwrap_err().to_string();
        assert!(
            e.contains("num_batches_tracked") && e.contains("cannot hold"),
            "{e}"
        );
        let n = &bn.state_dict()["num_batches_tracked"];
        assert_eq!(n.to_vec::<i64>().unwrap(), vec![5], "unchanged");
    }
}

#[test]
fn load_state_dict_names_every_problem_and_changes_nothing() {
    let net = Net::new(1);
    let mut other = Net::new(2);
    let mut state = net.state_dict();
    state.remove("head.bias");
    state.insert("head.extra".into(), f32s(&[2], 1));
    let e = other.load_state_dict(&state, true).unwrap_err().to_string();
    assert!(
        e.contains("missing head.bias") && e.contains("unexpected head.extra"),
        "{e}"
    );
    let report = other.load_state_dict(&state, false).unwrap();
    assert_eq!(report.missing, ["head.bias"]);
    assert_eq!(report.unexpected, ["head.extra"]);
    assert_eq!(
        vals(&other.state_dict()["head.weight"]),
        vals(&state["head.weight"])
    );
    // A wrong shape is refused even without strict, before anything is written.
    let mut other = Net::new(3);
    // Values, not the state's tensors: those share the module's storage, as PyTorch's do.
    let before: Vec<(String, Vec<f64>)> = other
        .state_dict()
        .into_iter()
        .map(|(k, t)| (k, vals(&t)))
        .collect();
    let mut bad = net.state_dict();
    bad.insert("head.weight".into(), f32s(&[3, 8], 2));
    let e = other.load_state_dict(&bad, false).unwrap_err().to_string();
    assert!(e.contains("head.weight") && e.contains("[3, 8]"), "{e}");
    for ((k, t), (_, v)) in other.state_dict().into_iter().zip(&before) {
        assert_eq!(&vals(&t), v, "{k} unchanged");
    }
    // A state of another dtype is converted, as PyTorch's copy does.
    let wide: std::collections::BTreeMap<String, Tensor> = net
        .state_dict()
        .into_iter()
        .map(|(k, t)| {
            let t = if t.dtype().is_float() {
                t.to_dtype(DType::F64).unwrap()
            } else {
                t
            };
            (k, t)
        })
        .collect();
    let mut other = Net::new(4);
    other.load_state_dict(&wide, true).unwrap();
    assert_eq!(other.state_dict()["head.weight"].dtype(), DType::F32);
    assert_eq!(
        vals(&other.state_dict()["head.weight"]),
        vals(&net.state_dict()["head.weight"])
    );
}

#[test]
fn new_layers_refuse_bad_input_and_pass_gradcheck() {
    let x = leaf(&[2, 4, 7], 1);
    let w = leaf(&[6, 2, 3], 2);
    let b = leaf(&[6], 3);
    let o = Conv1dOptions {
        stride: 2,
        padding: 1,
        dilation: 2,
        groups: 2,
    };
    gradcheck(&[x.clone(), w, b], |t| t[0].conv1d(&t[1], Some(&t[2]), o));
    let (gw, gb) = (leaf(&[4], 4), leaf(&[4], 5));
    gradcheck(&[x.clone(), gw, gb], |t| {
        t[0].group_norm(2, Some(&t[1]), Some(&t[2]), 1e-5)
    });
    assert!(x.group_norm(3, None, None, 1e-5).is_err());
    assert!(x.conv1d(&f32s(&[2, 2], 1), None, o).is_err());
    assert!(GroupNorm::new(3, 8, true).is_err());
    let bn = BatchNorm1d::new(4).unwrap();
    let e = bn.forward(&f32s(&[2, 4, 3, 3], 1)).unwrap_err().to_string();
    assert!(e.contains("BatchNorm1d"), "{e}");
    assert_eq!(bn.running_mean.shape(), &[4]);
    assert!(ModuleList::new().forward(&x).is_err());
}

/// Multi-head self-attention learns to average a sequence: every position's target is the
/// mean of the sequence's vectors (uniform weights and identity projections solve it).
#[test]
fn multihead_attention_trains_and_attention_passes_gradcheck() {
    let mha = nn::MultiheadAttention::new(8, 2, true, &mut Generator::new(3)).unwrap();
    let x = f32s(&[32, 6, 8], 4);
    let target = x.mean(&[1], true).unwrap().expand(&[32, 6, 8]).unwrap();
    let mut opt = Adam::new(mha.parameters(), AdamConfig::adam(1e-2)).unwrap();
    let loss = |m: &nn::MultiheadAttention| {
        m.forward(&x)
            .unwrap()
            .mse_loss(&target, Reduction::Mean)
            .unwrap()
    };
    let first = loss(&mha).item().unwrap();
    for _ in 0..150 {
        opt.zero_grad();
        loss(&mha).backward().unwrap();
        opt.step().unwrap();
    }
    let last = loss(&mha).item().unwrap();
    assert!(last < 0.1 * first, "loss {first} -> {last}");

    let (q, k, v) = (
        leaf(&[2, 3, 4], 1),
        leaf(&[2, 5, 4], 2),
        leaf(&[2, 5, 3], 3),
    );
    let bias = leaf(&[3, 5], 4).detach();
    gradcheck(&[q.clone(), k.clone(), v.clone()], |t| {
        let o = AttentionOptions {
            attn_mask: Some(&bias),
            scale: Some(0.7),
            ..Default::default()
        };
        t[0].scaled_dot_product_attention(&t[1], &t[2], o)
    });
    let kk = leaf(&[2, 3, 4], 5);
    let vv = leaf(&[2, 3, 3], 6);
    gradcheck(&[q.clone(), kk, vv], |t| {
        let o = AttentionOptions {
            is_causal: true,
            ..Default::default()
        };
        t[0].scaled_dot_product_attention(&t[1], &t[2], o)
    });
    // Mistakes: inner sizes that differ, a dropout probability of 1, heads that do not
    // divide the embedding, a padding mask of the wrong shape.
    assert!(q
        .scaled_dot_product_attention(&v, &v, Default::default())
        .is_err());
    let o = AttentionOptions {
        dropout_p: 1.0,
        ..Default::default()
    };
    assert!(q.scaled_dot_product_attention(&k, &k, o).is_err());
    assert!(nn::MultiheadAttention::new(8, 3, true, &mut Generator::new(0)).is_err());
    let pad = Tensor::zeros(&[32, 5], DType::U8, Device::Cpu).unwrap();
    let e = mha
        .attend(&x, &x, &x, Some(&pad), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("key_padding_mask"), "{e}");
}

#[test]
fn gru_learns_a_running_mean_and_continues_from_its_state() {
    let mut g = Generator::new(5);
    let gru = nn::Gru::new(1, 12, 1, true, &mut g).unwrap();
    let head = Linear::new(12, 1, true, &mut g).unwrap();
    // Targets: the running mean of each sequence so far (needs the state, not only x_t).
    let x = f32s(&[32, 8, 1], 6);
    let steps = Tensor::arange(1.0, 9.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[1, 8, 1])
        .unwrap();
    let target = x.cumsum(1).unwrap().div(&steps).unwrap();
    let mut params = gru.parameters();
    params.extend(head.parameters());
    let mut opt = Adam::new(params, AdamConfig::adam(2e-2)).unwrap();
    let loss = || {
        head.forward(&gru.forward(&x).unwrap())
            .unwrap()
            .mse_loss(&target, Reduction::Mean)
            .unwrap()
    };
    let first = loss().item().unwrap();
    for _ in 0..200 {
        opt.zero_grad();
        loss().backward().unwrap();
        opt.step().unwrap();
    }
    let last = loss().item().unwrap();
    assert!(last < 0.05 * first, "loss {first} -> {last}");

    // Two layers: a sequence run in two halves, the second from the first's state, is the
    // whole sequence run at once.
    let gru2 = nn::Gru::new(3, 4, 2, false, &mut g).unwrap();
    let seq = f32s(&[6, 2, 3], 7);
    let (whole, h_whole) = gru2.forward_with_state(&seq, None).unwrap();
    let (a, h_a) = gru2
        .forward_with_state(&seq.narrow(0, 0, 2).unwrap(), None)
        .unwrap();
    let (b, h_b) = gru2
        .forward_with_state(&seq.narrow(0, 2, 4).unwrap(), Some(&h_a))
        .unwrap();
    let halves = Tensor::cat(&[&a, &b], 0).unwrap();
    assert!(rel_err(&vals(&halves), &vals(&whole)) < 1e-6);
    assert!(rel_err(&vals(&h_b), &vals(&h_whole)) < 1e-6);
    // Mistakes: a state of the wrong shape, the wrong feature count, an empty sequence.
    let bad = Tensor::zeros(&[1, 2, 4], DType::F32, Device::Cpu).unwrap();
    let e = gru2
        .forward_with_state(&seq, Some(&bad))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gru (initial state)"), "{e}");
    assert!(gru2.forward(&f32s(&[6, 2, 5], 1)).is_err());
    assert!(gru2.forward(&f32s(&[0, 2, 3], 1)).is_err());
    assert!(nn::Gru::new(3, 0, 1, false, &mut g).is_err());
    // The input's gradient by finite differences, in f64.
    let mut small = nn::Gru::new(2, 3, 2, true, &mut g).unwrap();
    small.to_dtype(DType::F64).unwrap();
    gradcheck(&[leaf(&[2, 3, 2], 8)], |t| small.forward(&t[0]));
}

#[test]
fn attention_fuses_when_asked_as_one_op_that_autocast_runs_in_half() {
    let (q, k, v) = (
        f32s(&[2, 3, 5, 8], 1),
        f32s(&[2, 3, 7, 8], 2),
        f32s(&[2, 3, 7, 4], 3),
    );
    let [q, k, v] = [q, k, v].map(|t| t.requires_grad(true).unwrap());
    let unmasked = || {
        q.scaled_dot_product_attention(&k, &v, Default::default())
            .unwrap()
    };
    // By default these few scores take the composition; asked for, the fused op.
    assert_eq!(attention_kernel(), AttentionKernel::Auto);
    assert_ne!(unmasked().op_name(), Some("scaled_dot_product_attention"));
    set_attention_kernel(AttentionKernel::Fused);
    let y = unmasked();
    // One node over q, k and v (the scores are never a tensor of the graph).
    assert_eq!(y.op_name(), Some("scaled_dot_product_attention"));
    // The same op with a mask is the composition, whose last op is the product with v.
    let m = Tensor::zeros(&[5, 7], DType::F32, Device::Cpu).unwrap();
    let o = AttentionOptions {
        attn_mask: Some(&m),
        ..Default::default()
    };
    let z = q.scaled_dot_product_attention(&k, &v, o).unwrap();
    assert_ne!(z.op_name(), Some("scaled_dot_product_attention"));
    // A zero mask changes nothing: the fused op and the composition agree.
    assert!(rel_err(&vals(&y), &vals(&z)) < 1e-6);
    y.sum_all().unwrap().backward().unwrap();
    let fused: Vec<Vec<f64>> = [&q, &k, &v]
        .iter()
        .map(|t| vals(&t.grad().unwrap()))
        .collect();
    [&q, &k, &v].iter().for_each(|t| t.zero_grad());
    z.sum_all().unwrap().backward().unwrap();
    for (t, f) in [&q, &k, &v].iter().zip(&fused) {
        assert!(rel_err(f, &vals(&t.grad().unwrap())) < 1e-5);
    }
    // Under autocast the fused op runs in the low dtype (PyTorch's lower-precision list).
    let h = {
        let _autocast = amp::autocast(DType::BF16);
        q.scaled_dot_product_attention(&k, &v, Default::default())
            .unwrap()
    };
    assert_eq!(h.dtype(), DType::BF16);
    assert_eq!(h.op_name(), Some("scaled_dot_product_attention"));
    assert!(rel_err(&vals(&h), &vals(&y)) < 2e-2);
    set_attention_kernel(AttentionKernel::Composed);
    assert_ne!(unmasked().op_name(), Some("scaled_dot_product_attention"));
    set_attention_kernel(AttentionKernel::Auto);
}

/// A model whose tensors `visit_fields!` finds: a module, a `Vec` of them, an `Option`
/// (present and absent), a tensor, a renamed field and a Dropout inside the `Vec`.
struct Fielded {
    embed: Linear,
    blocks: Vec<FieldBlock>,
    extra: Option<Linear>,
    missing: Option<Linear>,
    gain: Tensor,
    head: Linear,
}

/// A block of the `Vec`: a Linear and a Dropout, its tensors from its fields too.
struct FieldBlock {
    fc: Linear,
    drop: mantissa::nn::Dropout,
}

impl Module for FieldBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.drop.forward(&self.fc.forward(x)?)
    }
    mantissa::visit_fields!(fc, drop);
}

impl Module for Fielded {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.embed.forward(x)?;
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        if let Some(e) = &self.extra {
            h = e.forward(&h)?;
        }
        self.head.forward(&h.mul(&self.gain)?)
    }
    mantissa::visit_fields!(embed, blocks, extra, missing, gain, head as "out.head");
}

#[test]
fn visit_fields_names_walks_and_switches_every_field() {
    let g = &mut Generator::new(3);
    let lin = |i, o, g: &mut Generator| Linear::new(i, o, true, g).unwrap();
    let mut net = Fielded {
        embed: lin(4, 6, g),
        blocks: (0..2)
            .map(|k| FieldBlock {
                fc: lin(6, 6, g),
                drop: mantissa::nn::Dropout::new(0.5, k),
            })
            .collect(),
        extra: Some(lin(6, 6, g)),
        missing: None,
        gain: Tensor::ones(&[6], DType::F32, Device::Cpu)
            .unwrap()
            .requires_grad(true)
            .unwrap(),
        head: lin(6, 3, g),
    };
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    let want = [
        "embed.weight",
        "embed.bias",
        "blocks.0.fc.weight",
        "blocks.0.fc.bias",
        "blocks.1.fc.weight",
        "blocks.1.fc.bias",
        "extra.weight",
        "extra.bias",
        "gain",
        "out.head.weight",
        "out.head.bias",
    ];
    assert_eq!(names, want);
    let gens: Vec<String> = net.named_generators().into_iter().map(|(n, _)| n).collect();
    assert_eq!(gens, ["blocks.0.drop.generator", "blocks.1.drop.generator"]);
    // Evaluation mode reaches the Dropouts inside the Vec: two passes agree.
    let x = Tensor::randn(&[5, 4], DType::F32, Device::Cpu).unwrap();
    net.eval();
    let a = net.forward(&x).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a, net.forward(&x).unwrap().to_vec::<f32>().unwrap());
    // Training mode too: the masks differ from one pass to the next.
    net.train();
    let b = net.forward(&x).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(b, net.forward(&x).unwrap().to_vec::<f32>().unwrap());
    // Every walk goes through the fields: a dtype conversion, a state dict round trip.
    net.to_dtype(DType::F64).unwrap();
    assert!(net
        .parameters()
        .iter()
        .all(|p| p.dtype() == DType::F64 && p.is_leaf()));
    assert_eq!(net.gain.dtype(), DType::F64);
    let state = net.state_dict();
    assert_eq!(state.len(), want.len());
    net.load_state_dict(&state, true).unwrap();
}
