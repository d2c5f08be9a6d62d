//! Trains a GPT (nanoGPT's model and loop) on a text, samples from it, and loads or writes
//! GPT-2 weights.
//!
//! ```text
//! cargo run --release --example gpt -- --quick                  # a small char model, minutes on a CPU
//! cargo run --release --example gpt -- --model shakespeare-char # nanoGPT's shakespeare-char
//! cargo run --release --example gpt -- --model gpt2 --data synthetic --device cuda --precision bf16
//! cargo run --release --example gpt -- --init gpt2.safetensors --steps 0 --generate 100 --prompt "Hello"
//! ```
//! The default text is Shakespeare's complete works, fetched once and tokenised into
//! `data/shakespeare/` (`--text FILE` for another). The loop is nanoGPT's: random windows of
//! `--block-size` tokens, AdamW (betas 0.9/0.95, weight decay on 2-D weights only), linear
//! warm-up then cosine decay to `--min-lr`, gradients clipped to norm 1, `--accumulate`
//! micro-batches per step, fp32 / bf16 / fp16 (with the loss scaler). Every
//! `--eval-interval` steps both splits are evaluated on `--eval-batches` fixed batches and a
//! line of `metrics.csv` (step, losses, accuracies, lr, tokens/s) is written to `--out`, with
//! `curves.png`. `--save`/`--resume` keep the model, the optimizer, the scaler and the step:
//! a resumed run draws the batches the uninterrupted one would have.

use clap::Parser;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::nn::Module;
use mantissa::optim::*;
use mantissa::*;
use std::path::PathBuf;

#[path = "../common/mod.rs"]
#[allow(dead_code)] // The shared helpers this example has no use for (the batch-size search).
mod common;
mod data;
mod model;
mod sample;
mod step;
mod train;
mod weights;
use common::files::FileFlags;
use common::RunFlags;
use data::Tokenizer;
use model::{Gpt, GptConfig};
use sample::{generate, SampleOptions};

#[derive(Parser, Debug)]
#[command(about = "Train a GPT with mantissa, sample from it, load GPT-2 weights")]
struct Args {
    /// baby (4 layers x 4 heads x 128, context 64), shakespeare-char (6 x 6 x 384, context
    /// 256, dropout 0.2), gpt2 (124M) or gpt2-medium (350M).
    #[arg(long, default_value = "baby")]
    model: String,
    #[arg(long)]
    n_layer: Option<usize>,
    #[arg(long)]
    n_head: Option<usize>,
    #[arg(long)]
    n_embd: Option<usize>,
    #[arg(long)]
    block_size: Option<usize>,
    #[arg(long)]
    dropout: Option<f64>,
    /// Weights to start from (nanoGPT's or Hugging Face's GPT-2 names, safetensors): the
    /// model takes their shape (heads from --n-head, the file's metadata, or 64 wide).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Write the weights at the end as Hugging Face's GPT-2 names them.
    #[arg(long)]
    export: Option<PathBuf>,
    /// char (one token per character of the text) or gpt2 (GPT-2's byte-pair encoding);
    /// default: gpt2 for the gpt2 models, char otherwise.
    #[arg(long)]
    tokenizer: Option<String>,
    /// A UTF-8 text to learn (default: Shakespeare's complete works).
    #[arg(long)]
    text: Option<PathBuf>,
    /// text, or synthetic: random tokens, steps timed (tokens/s).
    #[arg(long, default_value = "text")]
    data: String,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Optimizer steps (default 5000, nanoGPT's for shakespeare-char; 2000 with --quick).
    #[arg(long)]
    steps: Option<usize>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// The rate the cosine decays to (default: --lr / 10).
    #[arg(long)]
    min_lr: Option<f64>,
    #[arg(long, default_value_t = 100)]
    warmup_steps: usize,
    /// The step the cosine decay ends at, --min-lr after it (default: --steps; a run meant to
    /// stop early and be resumed gives the whole run's count).
    #[arg(long)]
    decay_steps: Option<usize>,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    #[arg(long, default_value_t = 0.95)]
    beta2: f64,
    /// Gradients clipped to this norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// Steps between evaluations (and checkpoints with --save).
    #[arg(long, default_value_t = 250)]
    eval_interval: usize,
    /// Batches of each split per evaluation.
    #[arg(long, default_value_t = 20)]
    eval_batches: usize,
    /// bf16/fp16 parameters with f32 master weights in the optimizer.
    #[arg(long)]
    master_weights: bool,
    /// A fast run: the baby model on characters for 2000 steps (about two minutes on two
    /// CPU cores).
    #[arg(long)]
    quick: bool,
    /// Tokens to generate after training (0: none).
    #[arg(long, default_value_t = 200)]
    generate: usize,
    /// The text generation starts from (default: a newline).
    #[arg(long, default_value = "\n")]
    prompt: String,
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    #[arg(long)]
    top_p: Option<f64>,
    /// The most likely token every time instead of sampling.
    #[arg(long)]
    greedy: bool,
    /// Attention's implementation: auto (on CUDA in f16/bf16 the fused op, through cuDNN's
    /// fused attention where it takes the problem, else on the engine's tensor-core kernels
    /// at head size 64 or 128; elsewhere the composition of two products and a softmax
    /// while its [L, S] weights take less than 2^26 elements, the fused op from there),
    /// composed, fused (the scores never stored; PyTorch's `sdpa_kernel` choice), or own
    /// (auto without cuDNN's attention: the engine's own kernels).
    #[arg(long, default_value = "auto")]
    attention: String,
    /// On CUDA, the MLP's bias and GELU, GELU's backward and the Linear layers' bias
    /// gradients in cuBLASLt's epilogues (off by default: whether they pay depends on the GPU
    /// and the shape).
    #[arg(long)]
    gemm_epilogues: bool,
    #[command(flatten)]
    run: RunFlags,
    #[command(flatten)]
    files: FileFlags,
}

/// The model the flags ask for, before any --init.
fn config(args: &Args, vocab: usize) -> Result<GptConfig> {
    let base = match args.model.as_str() {
        "baby" => GptConfig {
            vocab_size: vocab,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            dropout: 0.0,
        },
        "shakespeare-char" => GptConfig {
            vocab_size: vocab,
            block_size: 256,
            n_layer: 6,
            n_head: 6,
            n_embd: 384,
            dropout: 0.2,
        },
        "gpt2" => GptConfig::gpt2(),
        "gpt2-medium" => GptConfig::gpt2_medium(),
        m => {
            return Err(Error::Invalid {
                op: "--model",
                msg: format!("{m:?}: baby, shakespeare-char, gpt2 or gpt2-medium"),
            })
        }
    };
    let c = GptConfig {
        vocab_size: if args.model.starts_with("gpt2") {
            base.vocab_size.max(vocab)
        } else {
            vocab
        },
        block_size: args.block_size.unwrap_or(base.block_size),
        n_layer: args.n_layer.unwrap_or(base.n_layer),
        n_head: args.n_head.unwrap_or(base.n_head),
        n_embd: args.n_embd.unwrap_or(base.n_embd),
        dropout: args.dropout.unwrap_or(base.dropout),
    };
    c.check()?;
    Ok(c)
}

/// How --generate samples, the top-k cut at most the vocabulary.
fn sample_options(args: &Args, vocab: usize) -> SampleOptions {
    SampleOptions {
        new_tokens: args.generate,
        greedy: args.greedy,
        temperature: args.temperature,
        top_k: Some(args.top_k.min(vocab)),
        top_p: args.top_p,
    }
}

fn invalid(msg: String) -> Error {
    Error::Invalid { op: "gpt", msg }
}

fn run(mut args: Args) -> Result<()> {
    args.run.refuse_convolution_flags("gpt")?;
    if args.quick {
        if args.model != "baby" || args.init.is_some() {
            return Err(invalid(
                "--quick trains the baby model from scratch: leave out --model and --init".into(),
            ));
        }
        args.steps.get_or_insert(2000);
        args.tokenizer.get_or_insert("char".into());
    }
    let steps = args.steps.unwrap_or(5000);
    let synthetic = match args.data.as_str() {
        "text" => false,
        "synthetic" => true,
        d => return Err(invalid(format!("--data {d:?}: text or synthetic"))),
    };
    if args.eval_interval == 0 || args.eval_batches == 0 || args.batch_size == 0 {
        return Err(invalid(
            "--eval-interval, --eval-batches and --batch-size must be at least 1".into(),
        ));
    }
    // Mistakes in the flags are said before any text is read or fetched.
    config(&args, 1)?;
    set_attention_kernel(match args.attention.as_str() {
        "auto" | "own" => AttentionKernel::Auto,
        "composed" => AttentionKernel::Composed,
        "fused" => AttentionKernel::Fused,
        a => {
            return Err(invalid(format!(
                "--attention {a:?}: auto, composed, fused or own"
            )))
        }
    });
    set_cudnn_attention(args.attention != "own");
    sample_options(&args, usize::MAX).check(usize::MAX)?;
    let (device, low, _) = args.run.open()?;
    if args.gemm_epilogues && device == Device::Cpu {
        return Err(invalid(
            "--gemm-epilogues applies to a CUDA device (cuBLASLt): leave it out on the CPU".into(),
        ));
    }
    set_gemm_epilogues(args.gemm_epilogues);
    let dist = common::dist::Dist::join(device, "gpt")?;
    dist.check_flags(args.run.cuda_graph, "gpt")?;
    let out = args
        .files
        .prepare("runs/gpt", synthetic.then_some("--data synthetic"))?;
    let gpt2_model = args.model.starts_with("gpt2") || args.init.is_some();
    let gpt2_tokens = match args.tokenizer.as_deref() {
        None => gpt2_model,
        Some("gpt2") => true,
        Some("char") => false,
        Some(t) => return Err(invalid(format!("--tokenizer {t:?}: char or gpt2"))),
    };
    // Tokens: the text's (tokenised once for the default corpus), or random ones.
    let (tok, splits) = match (&args.text, synthetic) {
        (_, true) => {
            // 65 symbols, as Shakespeare's characters in nanoGPT's excerpt.
            let symbols: String = (0..65u8).map(|b| (b' ' + b) as char).collect();
            let tok = if gpt2_tokens {
                Tokenizer::gpt2()?
            } else {
                Tokenizer::chars_of(&symbols)
            };
            (tok, None)
        }
        (Some(p), false) => {
            let text = std::fs::read_to_string(p).map_err(|e| Error::Io {
                op: "--text",
                path: p.display().to_string(),
                source: e,
            })?;
            let tok = if gpt2_tokens {
                Tokenizer::gpt2()?
            } else {
                Tokenizer::chars_of(&text)
            };
            let s = data::split_tokens(&tok, &text)?;
            (tok, Some(s))
        }
        (None, false) => {
            let dir = PathBuf::from("data/shakespeare");
            let (tok, s) = data::cached_splits(&dir, gpt2_tokens, || data::shakespeare_text(&dir))?;
            (tok, Some(s))
        }
    };
    let mut g = Generator::new(args.run.seed);
    let mut net = match &args.init {
        Some(p) => weights::load_gpt(p, args.n_head, args.dropout.unwrap_or(0.0), args.run.seed)?,
        None => Gpt::new(config(&args, tok.vocab_size())?, &mut g, args.run.seed)?,
    };
    if net.config.vocab_size < tok.vocab_size() {
        return Err(invalid(format!(
            "the model has {} tokens, the tokenizer {}",
            net.config.vocab_size,
            tok.vocab_size()
        )));
    }
    net.to_device(device)?;
    if let (true, Some(d)) = (args.master_weights, low) {
        net.to_dtype(d)?;
    }
    // AdamW as nanoGPT configures it: decay on the matrices and embeddings only.
    let (decay, no_decay) = net.decay_groups();
    let mut opt = Adam::new(
        decay,
        AdamConfig {
            beta2: args.beta2,
            weight_decay: args.weight_decay,
            ..AdamConfig::adamw(args.lr)
        },
    )?;
    opt.add_param_group(
        no_decay,
        GroupOptions {
            weight_decay: Some(0.0),
            ..Default::default()
        },
    )?;
    match (args.master_weights, low) {
        (true, Some(DType::BF16)) => opt.use_master_weights(Rounding::Stochastic {
            seed: args.run.seed,
        })?,
        (true, Some(_)) => opt.use_master_weights(Rounding::Nearest)?,
        (true, None) => {
            return Err(invalid(
                "--master-weights needs --precision fp16 or bf16".into(),
            ))
        }
        _ => {}
    }
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: low == Some(DType::F16),
        ..Default::default()
    })?;
    let start = train::resume(&args.files, &mut net, &mut opt, &mut scaler)?;
    let ddp = dist.wrap(&net.parameters())?;
    let c = net.config;
    if dist.is_main() {
        println!(
            "GPT {} layers x {} heads x {} wide, context {}, vocabulary {} ({:.2}M parameters), batch {} x {} tokens x {} accumulated, device {device}, precision {}, {} threads",
            c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size,
            net.num_parameters_without_positions() as f64 / 1e6,
            args.batch_size, c.block_size, args.run.accumulate, args.run.precision,
            rayon::current_num_threads()
        );
    }
    let trainer = train::Trainer {
        batch: args.batch_size,
        accumulate: args.run.accumulate,
        steps,
        decay_steps: args.decay_steps.unwrap_or(steps),
        lr: args.lr,
        min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
        warmup: args.warmup_steps,
        grad_clip: args.grad_clip,
        eval_interval: args.eval_interval,
        eval_batches: args.eval_batches,
        seed: args.run.seed,
        low,
        device,
        profile_steps: match args.run.profile {
            0 => 0,
            n => n + args.run.profile_warmup,
        },
    };
    let mut graph = common::step_graph(&args.run, device, &net.parameters(), "gpt")?;
    let mut profile = common::StepProfile::new(&args.run, &out)?;
    let splits = match splits {
        Some(s) => s,
        None => {
            // Random tokens: the step timed, nothing evaluated or saved.
            return trainer.synthetic(
                &mut net,
                &mut opt,
                &mut scaler,
                &dist,
                ddp.as_ref(),
                graph.as_mut(),
                &mut profile,
            );
        }
    };
    trainer.train(
        step::Model {
            net: &mut net,
            opt: &mut opt,
            scaler: &mut scaler,
        },
        &splits,
        start,
        &dist,
        ddp.as_ref(),
        (&args.files, &out),
        graph.as_mut(),
        &mut profile,
    )?;
    profile.finish()?;
    common::print_peak_memory("mantissa training", device)?;
    if !dist.is_main() {
        return Ok(());
    }
    if let Some(p) = &args.export {
        weights::save_hf(&net, p)?;
        println!(
            "weights written as Hugging Face's GPT-2 names them to {}",
            p.display()
        );
    }
    if args.generate == 0 {
        return Ok(());
    }
    net.eval();
    let prompt = tok.encode(&args.prompt)?;
    let opts = sample_options(&args, tok.vocab_size());
    println!("--- sample ({} tokens) ---", args.generate);
    print!("{}", args.prompt);
    let mut shown = String::new();
    let mut all = prompt.clone();
    generate(&net, &prompt, &opts, low, &mut g, |t| {
        // Printed as it comes; a token that ends inside a character waits for the next.
        all.push(t);
        let text = tok.decode(&all[prompt.len()..]);
        if !text.ends_with('\u{fffd}') {
            print!("{}", &text[shown.len().min(text.len())..]);
            shown = text;
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    })?;
    println!("\n---");
    Ok(())
}

fn main() {
    common::main_with(run);
}
