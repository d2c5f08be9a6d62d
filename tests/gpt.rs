//! The GPT example's model and loop against PyTorch's (`tests/torch_ref/gpt.py`, made with
//! `bench/gpt_peer.py`'s model): from the same initial weights, 20 steps of AdamW with weight
//! decay groups, warm-up and cosine decay, clipping and the head tied to the token embedding
//! give PyTorch's losses to 1e-4 relative each step; greedy generation gives its tokens
//! (past the context, where the window slides); bf16 autocast stays within llm.c's band.
//! Also: the key/value cache against a full rerun, sampling's cuts, and GPT-2 weights in
//! Hugging Face's layout written and read back. On the CPU and, where there is one, the CUDA
//! device (the emulated one in CI).

mod common;
#[path = "../examples/gpt/model.rs"]
#[allow(dead_code)] // The presets and counts the example alone uses.
mod model;
#[path = "../examples/gpt/sample.rs"]
mod sample;
#[path = "../examples/gpt/step.rs"]
#[allow(dead_code)]
mod step;
#[path = "../examples/gpt/weights.rs"]
mod weights;

use common::stored;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::nn::Module;
use mantissa::optim::{Adam, AdamConfig, GroupOptions, Optimizer};
use mantissa::*;
use model::{Gpt, GptConfig};
use sample::{generate, SampleOptions};
use std::collections::BTreeMap;

/// Held by each test: a CUDA graph capture records everything queued on the device's
/// stream, whichever thread queues it, so one test at a time drives the device.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(g) => d.push(g),
        Err(e) => eprintln!("skipped on CUDA: no CUDA device ({e})"),
    }
    d
}

const CONFIG: GptConfig = GptConfig {
    vocab_size: 65,
    block_size: 32,
    n_layer: 2,
    n_head: 4,
    n_embd: 64,
    dropout: 0.0,
};
// The reference's hyperparameters (tests/torch_ref/gpt.py).
const STEPS: usize = 20;
const LR: f64 = 3e-3;
const MIN_LR: f64 = 3e-4;
const WARMUP: usize = 5;

struct Reference {
    init: BTreeMap<String, Tensor>,
    x: Tensor,
    y: Tensor,
    loss: Vec<f32>,
    loss_bf16: Vec<f32>,
    greedy: Vec<i64>,
    final_wte: Tensor,
}

fn reference() -> Reference {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/torch_ref/gpt.safetensors"
    );
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |n: &str| stored(&st.tensor(n).unwrap());
    let init = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_prefix("init.").map(|k| (k.to_string(), get(n))))
        .collect();
    Reference {
        init,
        x: get("x"),
        y: get("y"),
        loss: get("loss").to_vec::<f32>().unwrap(),
        loss_bf16: get("loss_bf16").to_vec::<f32>().unwrap(),
        greedy: get("greedy").to_vec::<i64>().unwrap(),
        final_wte: get("final.wte"),
    }
}

/// The reference's initial model on `device`.
fn initial(r: &Reference, device: Device) -> Gpt {
    let mut net = Gpt::new(CONFIG, &mut Generator::new(5), 5).unwrap();
    let report = net.load_state_dict(&r.init, true).unwrap();
    assert!(report.missing.is_empty() && report.unexpected.is_empty());
    net.to_device(device).unwrap();
    net
}

/// AdamW as the example and nanoGPT make it: decay 0.1 on 2-D weights, none on the rest.
fn adamw(net: &Gpt) -> Adam {
    let (decay, no_decay) = net.decay_groups();
    let cfg = AdamConfig {
        beta2: 0.95,
        weight_decay: 0.1,
        ..AdamConfig::adamw(LR)
    };
    let mut opt = Adam::new(decay, cfg).unwrap();
    let no = GroupOptions {
        weight_decay: Some(0.0),
        ..Default::default()
    };
    opt.add_param_group(no_decay, no).unwrap();
    opt
}

/// The reference's 20 steps on `net`, returning each step's loss.
fn train(net: &mut Gpt, r: &Reference, low: Option<DType>) -> Vec<f64> {
    train_steps(net, r, low, STEPS)
}

/// Step `s`'s batch of the reference on `device`.
fn batch(r: &Reference, s: usize, device: Device) -> (Tensor, Tensor) {
    let at = |t: &Tensor| {
        t.narrow(0, s, 1)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_device(device)
            .unwrap()
    };
    (at(&r.x), at(&r.y))
}

/// The reference trains in fp32 and bf16: no loss scaling.
fn no_scaler() -> GradScaler {
    GradScaler::new(GradScalerConfig {
        enabled: false,
        ..Default::default()
    })
    .unwrap()
}

/// The reference's first `steps` steps (its schedule over all 20).
fn train_steps(net: &mut Gpt, r: &Reference, low: Option<DType>, steps: usize) -> Vec<f64> {
    let device = net.wte.weight.device();
    let mut opt = adamw(net);
    let mut scaler = no_scaler();
    let mut losses = Vec::new();
    for s in 0..steps {
        opt.set_lr(step::lr_at(s, LR, MIN_LR, WARMUP, STEPS));
        let (x, y) = batch(r, s, device);
        let mut m = step::Model {
            net,
            opt: &mut opt,
            scaler: &mut scaler,
        };
        let (loss, _) = step::train_step(&mut m, &[(x, y)], low, 0.5, None).unwrap();
        losses.push(loss.item().unwrap());
    }
    losses
}

/// Norm-wise relative error of `a` against `b`.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a
        .to_device(Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let b = b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn twenty_steps_and_greedy_text_match_pytorch() {
    let _serial = serial();
    let r = reference();
    for device in devices() {
        let mut net = initial(&r, device);
        // The head is the token embedding: one parameter, counted once.
        let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert!(!names.contains(&"lm_head.weight".to_string()), "{names:?}");
        let losses = train(&mut net, &r, None);
        for (s, (ours, theirs)) in losses.iter().zip(&r.loss).enumerate() {
            let e = (ours - *theirs as f64).abs() / *theirs as f64;
            assert!(
                e < 1e-4,
                "{device} step {s}: loss {ours} against PyTorch's {theirs}"
            );
        }
        let e = rel(&net.wte.weight, &r.final_wte);
        assert!(
            e < 1e-4,
            "{device}: token embedding after training off by {e:.2e}"
        );
        net.eval();
        let prompt: Vec<u32> = r.greedy[..5].iter().map(|&t| t as u32).collect();
        let opts = SampleOptions {
            new_tokens: r.greedy.len() - 5,
            greedy: true,
            temperature: 1.0,
            top_k: None,
            top_p: None,
        };
        let mut g = Generator::new(0);
        let text = generate(&net, &prompt, &opts, None, &mut g, |_| {}).unwrap();
        let want: Vec<u32> = r.greedy.iter().map(|&t| t as u32).collect();
        assert_eq!(text, want, "{device}: greedy tokens");
    }
}

#[test]
fn bf16_autocast_stays_within_the_amp_band() {
    let _serial = serial();
    let r = reference();
    for device in devices() {
        let mut net = initial(&r, device);
        let losses = train(&mut net, &r, Some(DType::BF16));
        // llm.c's bf16 test: losses within 0.05 of the fp32 reference's.
        for (s, (ours, theirs)) in losses.iter().zip(&r.loss_bf16).enumerate() {
            let e = (ours - *theirs as f64).abs();
            assert!(
                e < 0.05,
                "{device} step {s}: bf16 loss {ours}, PyTorch's bf16 {theirs}"
            );
            assert!(
                (ours - r.loss[s] as f64).abs() < 0.05,
                "{device} step {s}: against fp32"
            );
        }
    }
}

#[test]
fn the_cache_gives_the_logits_of_a_full_rerun() {
    let _serial = serial();
    let r = reference();
    for device in devices() {
        let net = initial(&r, device);
        let tokens =
            r.x.narrow(0, 0, 1)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .narrow(0, 0, 2)
                .unwrap();
        let tokens = tokens.narrow(1, 0, 12).unwrap().to_device(device).unwrap();
        let full = no_grad(|| net.forward(&tokens)).unwrap();
        let mut caches = net.new_caches();
        let mut parts =
            vec![
                no_grad(|| net.forward_cached(&tokens.narrow(1, 0, 7)?, Some(&mut caches)))
                    .unwrap(),
            ];
        for t in 7..12 {
            let one = tokens.narrow(1, t, 1).unwrap();
            parts.push(no_grad(|| net.forward_cached(&one, Some(&mut caches))).unwrap());
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        let stepped = Tensor::cat(&refs, 1).unwrap();
        let e = rel(&stepped, &full.to_device(Device::Cpu).unwrap());
        assert!(e < 1e-5, "{device}: cached logits off by {e:.2e}");
        // Past the context, and several new positions after a cache, are refused.
        let long = Tensor::zeros(&[1, 33], DType::I64, device).unwrap();
        assert!(net
            .forward(&long)
            .unwrap_err()
            .to_string()
            .contains("context is 32"));
        let two = tokens.narrow(1, 0, 2).unwrap();
        assert!(net.forward_cached(&two, Some(&mut caches)).is_err());
    }
}

#[test]
fn sampling_cuts_and_seeds() {
    let _serial = serial();
    let r = reference();
    let net = initial(&r, Device::Cpu);
    let prompt = [3u32, 14, 15];
    let opts = |top_k, top_p, greedy| SampleOptions {
        new_tokens: 12,
        greedy,
        temperature: 0.9,
        top_k,
        top_p,
    };
    let run = |o: SampleOptions, seed| {
        generate(&net, &prompt, &o, None, &mut Generator::new(seed), |_| {}).unwrap()
    };
    let greedy = run(opts(None, None, true), 0);
    // One candidate left, by either cut: the greedy text whatever the seed.
    assert_eq!(run(opts(Some(1), None, false), 1), greedy);
    assert_eq!(run(opts(None, Some(1e-6), false), 2), greedy);
    // The same seed, the same text; sampled text stays in the vocabulary.
    let a = run(opts(Some(20), Some(0.9), false), 7);
    assert_eq!(a, run(opts(Some(20), Some(0.9), false), 7));
    assert!(a.iter().all(|&t| (t as usize) < CONFIG.vocab_size));
    // Options out of range are refused by name.
    for (o, word) in [
        (
            SampleOptions {
                temperature: 0.0,
                ..opts(None, None, false)
            },
            "temperature",
        ),
        (opts(Some(0), None, false), "top-k"),
        (opts(Some(66), None, false), "top-k"),
        (opts(None, Some(1.5), false), "top-p"),
    ] {
        let e = generate(&net, &prompt, &o, None, &mut Generator::new(0), |_| {}).unwrap_err();
        assert!(e.to_string().contains(word), "{e}");
    }
    let e = generate(
        &net,
        &[],
        &opts(None, None, true),
        None,
        &mut Generator::new(0),
        |_| {},
    );
    assert!(e.unwrap_err().to_string().contains("empty prompt"));
}

#[test]
fn hugging_face_layout_round_trips() {
    let _serial = serial();
    let r = reference();
    let net = initial(&r, Device::Cpu);
    let dir = std::env::temp_dir().join(format!("mantissa-gpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("hf.safetensors");
    weights::save_hf(&net, &path).unwrap();
    // Written as Hugging Face's Conv1D stores them, [in, out], the head left out.
    let (raw, meta) = checkpoint::read(&path).unwrap();
    assert_eq!(
        raw["transformer.h.0.attn.c_attn.weight"].shape(),
        &[64, 192]
    );
    assert_eq!(raw["transformer.h.1.mlp.c_proj.weight"].shape(), &[256, 64]);
    assert!(!raw.contains_key("lm_head.weight"));
    assert_eq!(meta["n_head"], "4");
    // Read back: nanoGPT's layout again, and the same model.
    let back = weights::load_gpt(&path, None, 0.0, 0).unwrap();
    assert_eq!(back.config, CONFIG);
    let values = |t: &Tensor| t.to_vec::<f32>().unwrap();
    for (name, t) in net.state_dict() {
        assert_eq!(values(&back.state_dict()[&name]), values(&t), "{name}");
    }
    // Without the `transformer.` prefix, with an old file's mask buffers, heads from the
    // width (64 each): a GPT-2 file as the hub has it.
    let renamed: Vec<(String, Tensor)> = raw
        .iter()
        .map(|(k, t)| (k.trim_start_matches("transformer.").to_string(), t.clone()))
        .chain([(
            "h.0.attn.bias".to_string(),
            Tensor::ones(&[1, 1, 32, 32], DType::F32, Device::Cpu).unwrap(),
        )])
        .collect();
    let hub = dir.join("hub.safetensors");
    checkpoint::write_tensors(&hub, renamed.iter().map(|(k, t)| (k.as_str(), t)), &[]).unwrap();
    let from_hub = weights::load_gpt(&hub, None, 0.0, 0).unwrap();
    assert_eq!(from_hub.config.n_head, 1);
    let w = |n: &Gpt| values(&n.h[1].mlp.c_proj.weight);
    assert_eq!(w(&from_hub), w(&net));
    // Not a GPT: said so.
    let other = dir.join("other.safetensors");
    let w = Tensor::ones(&[2, 2], DType::F32, Device::Cpu).unwrap();
    checkpoint::write_tensors(&other, [("weight", &w)], &[]).unwrap();
    let e = match weights::load_gpt(&other, None, 0.0, 0) {
        Ok(_) => panic!("a file without a GPT's tensors loaded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("not a GPT"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The reference's first 8 steps with the step captured once as a CUDA graph (after two
/// eager ones) and replayed: the losses and weights of the eager run, bit for bit.
#[test]
fn captured_steps_replay_the_eager_losses() {
    let _serial = serial();
    let Ok(device) = Device::cuda(0) else {
        eprintln!("skipped: no CUDA device");
        return;
    };
    let r = reference();
    let mut eager = initial(&r, device);
    const CAPTURED: usize = 8;
    let want = train_steps(&mut eager, &r, None, CAPTURED);
    let mut net = initial(&r, device);
    let mut opt = adamw(&net);
    let mut scaler = no_scaler();
    let mut graph = mantissa::graph::StepGraph::new(device)
        .unwrap()
        .watch(&net.parameters());
    let mut got = Vec::new();
    for s in 0..CAPTURED {
        opt.set_lr(step::lr_at(s, LR, MIN_LR, WARMUP, STEPS));
        let (x, y) = batch(&r, s, device);
        let mut m = step::Model {
            net: &mut net,
            opt: &mut opt,
            scaler: &mut scaler,
        };
        let out = graph
            .run(&[x, y], &mut |b| {
                let batch = [(b[0].clone(), b[1].clone())];
                let (loss, right) = step::train_step(&mut m, &batch, None, 0.5, None)?;
                Ok(vec![loss, right])
            })
            .unwrap();
        got.push(out[0].item().unwrap());
    }
    assert!(graph.replays() > 0, "no step was replayed");
    assert_eq!(got, want, "captured against eager losses");
    let values = |t: &Tensor| t.to_vec::<f32>().unwrap();
    assert_eq!(values(&net.wte.weight), values(&eager.wte.weight));
}
