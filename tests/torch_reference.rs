//! The engine against PyTorch: every case of `tests/torch_ref/cases.safetensors` (written by
//! `tests/torch_ref/gen.py` with PyTorch) is one op call on small random f32 inputs, with
//! PyTorch's outputs and input gradients computed in float64 from the same f32 values. Each is
//! run here in f32 on the CPU: the output shapes must be PyTorch's, the values and the
//! gradients of `sum(out * g)` within a norm-wise relative error of 1e-5, index outputs and
//! masks equal, and where PyTorch raised, the engine must return an `Err`.
//!
//! All mismatches are listed before the test fails. `MANTISSA_TORCH_CASE=n` runs one case.

mod common;
use common::stored;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::nn::{
    Activation, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d, Embedding, Flatten, GroupNorm, Gru,
    LayerNorm, Linear, Lstm, MaxPool2d, Module, MultiheadAttention, Sequential,
};
use mantissa::optim::{
    clip_grad_norm, Adadelta, Adagrad, Adam, AdamConfig, CosineAnnealing, GroupOptions, LrSchedule,
    MultiStepLr, OneCycle, Optimizer, PlateauMode, ReduceLrOnPlateau, RmsProp, Sgd, SgdConfig,
    StepLr, ThresholdMode,
};
use mantissa::{
    AttentionOptions, AvgPool2dOptions, Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions,
    CrossEntropyOptions, DType, Device, Generator, MaxPool2dOptions, Operand, Reduction, Result,
    Tensor,
};
use safetensors::SafeTensors;
use std::collections::HashMap;

const CASES: &[u8] = include_bytes!("torch_ref/cases.safetensors");
/// Norm-wise relative error allowed for f32 results against PyTorch's float64 ones.
const TOL: f64 = 1e-5;
/// The same for f16 and bf16 cases: PyTorch computes in float64 from the same rounded
/// inputs, so this is the engine's own rounding (of the outputs, and of the intermediate
/// results a gradient passes through). About 20 and 15 times the dtypes' epsilons: sums
/// that cancel (a bias gradient) magnify the rounding of their terms; a wrong formula is
/// off by far more.
const TOL_F16: f64 = 1e-2;
const TOL_BF16: f64 = 6e-2;

/// One case: its `key=value` spec and its tensors by name (`in.x`, `out.0`, `grad.x`, ...).
struct Case<'a> {
    spec: HashMap<&'a str, &'a str>,
    tensors: HashMap<String, Tensor>,
}

impl<'a> Case<'a> {
    fn get(&self, key: &str) -> &str {
        self.spec
            .get(key)
            .unwrap_or_else(|| panic!("case spec lacks {key}"))
    }
    fn has(&self, key: &str) -> bool {
        self.spec.contains_key(key)
    }
    fn list(&self, key: &str) -> Vec<&'a str> {
        match self.spec.get(key) {
            None | Some(&"[]") => vec![],
            Some(v) => v.split(',').collect(),
        }
    }
    fn usizes(&self, key: &str) -> Vec<usize> {
        self.list(key).iter().map(|v| v.parse().unwrap()).collect()
    }
    fn pair(&self, key: &str) -> [usize; 2] {
        let v = self.usizes(key);
        [v[0], v[1]]
    }
    fn isizes(&self, key: &str) -> Vec<isize> {
        self.list(key).iter().map(|v| v.parse().unwrap()).collect()
    }
    fn int(&self, key: &str) -> i64 {
        self.get(key).parse().unwrap()
    }
    fn float(&self, key: &str) -> f64 {
        self.get(key).parse().unwrap()
    }
    fn flag(&self, key: &str) -> bool {
        self.get(key) == "1"
    }
    fn reduction(&self) -> Reduction {
        match self.get("reduction") {
            "mean" => Reduction::Mean,
            "sum" => Reduction::Sum,
            _ => Reduction::None,
        }
    }
    /// The op's input `name`: the stored leaf, or its transposed view when the case says so.
    fn t(&self, name: &str) -> &Tensor {
        self.opt(name)
            .unwrap_or_else(|| panic!("case lacks input {name}"))
    }
    fn opt(&self, name: &str) -> Option<&Tensor> {
        let view = format!("view.{name}");
        let leaf = format!("in.{name}");
        self.tensors.get(&view).or_else(|| self.tensors.get(&leaf))
    }
    /// The dtype the case runs in (its float inputs are cast to it), and its tolerance.
    fn dtype(&self) -> (DType, f64) {
        match self.spec.get("dtype") {
            Some(&"bf16") => (DType::BF16, TOL_BF16),
            Some(&"f16") => (DType::F16, TOL_F16),
            _ => (DType::F32, TOL),
        }
    }
    /// The dtype of the float outputs (the case's, or PyTorch's result type where the case
    /// is about type promotion), and its tolerance.
    fn out_dtype(&self) -> (DType, f64) {
        match self.spec.get("out_dtype") {
            Some(d) => match dtype_named(d) {
                DType::BF16 => (DType::BF16, TOL_BF16),
                DType::F16 => (DType::F16, TOL_F16),
                d => (d, TOL),
            },
            None => self.dtype(),
        }
    }
}

/// The op of `c` through the engine: its outputs, in PyTorch's order.
fn run(c: &Case, device: Device) -> Result<Vec<Tensor>> {
    let x = || c.t("x");
    let (a, b) = (|| c.t("a"), || c.t("b"));
    let one = |t: Result<Tensor>| t.map(|t| vec![t]);
    let pair = |t: Result<(Tensor, Tensor)>| t.map(|(a, b)| vec![a, b]);
    let names = c.list("in");
    match c.get("op") {
        "neg" => one(x().neg()),
        "abs" => one(x().abs()),
        "exp" => one(x().exp()),
        "log" => one(x().log()),
        "log1p" => one(x().log1p()),
        "sqrt" => one(x().sqrt()),
        "rsqrt" => one(x().rsqrt()),
        "recip" => one(x().recip()),
        "sqr" => one(x().sqr()),
        "sin" => one(x().sin()),
        "cos" => one(x().cos()),
        "tanh" => one(x().tanh()),
        "sigmoid" => one(x().sigmoid()),
        "relu" => one(x().relu()),
        "gelu" => one(x().gelu()),
        "gelu_tanh" => one(x().gelu_tanh()),
        "silu" => one(x().silu()),
        "leaky_relu" => one(x().leaky_relu(c.float("slope"))),
        "clamp" => one(x().clamp(c.float("lo"), c.float("hi"))),
        "pow_scalar" => one(x().pow(c.float("p"))),
        "scalar_pow" => one(x().scalar_pow(c.float("p"))),
        "rsub" => one(x().rsub(c.float("s"))),
        "add" => one(a().add(b())),
        "sub" => one(a().sub(b())),
        "mul" => one(a().mul(b())),
        "div" => one(a().div(b())),
        "pow" => one(a().pow(b())),
        "maximum" => one(a().maximum(b())),
        "minimum" => one(a().minimum(b())),
        "eq" => one(a().eq(b())),
        "ne" => one(a().ne(b())),
        "lt" => one(a().lt(b())),
        "le" => one(a().le(b())),
        "gt" => one(a().gt(b())),
        "ge" => one(a().ge(b())),
        "where" => one(Tensor::where_cond(c.t("cond"), a(), b())),
        "masked_fill" => one(x().masked_fill(c.t("mask"), c.float("value"))),
        "sum" => one(x().sum(&c.isizes("dims"), c.flag("keepdim"))),
        "mean" => one(x().mean(&c.isizes("dims"), c.flag("keepdim"))),
        "var" | "std" => {
            let (dims, k) = (c.isizes("dims"), c.flag("keepdim"));
            let corr = c.int("correction") as usize;
            match c.get("op") {
                "var" => one(x().var(&dims, corr, k)),
                _ => one(x().std(&dims, corr, k)),
            }
        }
        "sum_all" => one(x().sum_all()),
        "mean_all" => one(x().mean_all()),
        "max_all" => one(x().max_all()),
        "min_all" => one(x().min_all()),
        "max" => pair(x().max(c.int("dim") as isize, c.flag("keepdim"))),
        "min" => pair(x().min(c.int("dim") as isize, c.flag("keepdim"))),
        "argmax" => one(x().argmax(c.int("dim") as isize, c.flag("keepdim"))),
        "argmin" => one(x().argmin(c.int("dim") as isize, c.flag("keepdim"))),
        "softmax" => one(x().softmax(c.int("dim") as isize)),
        "log_softmax" => one(x().log_softmax(c.int("dim") as isize)),
        "cat" | "stack" => {
            let parts: Vec<&Tensor> = names.iter().map(|n| c.t(n)).collect();
            let dim = c.int("dim") as isize;
            match c.get("op") {
                "cat" => one(Tensor::cat(&parts, dim)),
                _ => one(Tensor::stack(&parts, dim)),
            }
        }
        "index_select" => one(x().index_select(c.int("dim") as isize, c.t("idx"))),
        "gather" => one(x().gather(c.int("dim") as isize, c.t("idx"))),
        "scatter_add" => one(x().scatter_add(c.int("dim") as isize, c.t("idx"), c.t("src"))),
        "embedding" => one(Tensor::embedding(c.t("idx"), c.t("w"))),
        "matmul" => one(a().matmul(b())),
        "linear" => one(x().linear(c.t("w"), c.opt("b"))),
        "linear_relu" => one(x().linear_relu(c.t("w"), c.t("b"))),
        "conv2d" => {
            let o = Conv2dOptions {
                stride: c.pair("stride"),
                padding: c.pair("padding"),
                dilation: c.pair("dilation"),
                groups: c.int("groups") as usize,
            };
            one(x().conv2d(c.t("w"), c.opt("b"), o))
        }
        "conv_transpose2d" => {
            let o = ConvTranspose2dOptions {
                stride: c.pair("stride"),
                padding: c.pair("padding"),
                output_padding: c.pair("output_padding"),
                dilation: c.pair("dilation"),
                groups: c.int("groups") as usize,
            };
            one(x().conv_transpose2d(c.t("w"), c.opt("b"), o))
        }
        "max_pool2d" => {
            let o = MaxPool2dOptions {
                kernel: c.pair("kernel"),
                stride: Some(c.pair("stride")),
                padding: c.pair("padding"),
                dilation: c.pair("dilation"),
                ceil_mode: c.flag("ceil_mode"),
            };
            one(x().max_pool2d(o))
        }
        "avg_pool2d" => {
            let o = AvgPool2dOptions {
                kernel: c.pair("kernel"),
                stride: Some(c.pair("stride")),
                padding: c.pair("padding"),
                ceil_mode: c.flag("ceil_mode"),
                count_include_pad: c.flag("count_include_pad"),
            };
            one(x().avg_pool2d(o))
        }
        "adaptive_avg_pool2d" => one(x().adaptive_avg_pool2d(c.pair("out"))),
        "batch_norm" => {
            // The running statistics are updated in place; they are outputs 1 and 2.
            let (rm, rv) = (c.t("rm").copy()?, c.t("rv").copy()?);
            let y = x().batch_norm(
                Some(&rm),
                Some(&rv),
                c.opt("w"),
                c.opt("b"),
                c.flag("training"),
                c.float("momentum"),
                c.float("eps"),
            )?;
            Ok(vec![y, rm, rv])
        }
        "layer_norm" => one(x().layer_norm(
            &c.usizes("normalized_shape"),
            c.opt("w"),
            c.opt("b"),
            c.float("eps"),
        )),
        "cross_entropy" => {
            let o = CrossEntropyOptions {
                reduction: c.reduction(),
                ignore_index: c.int("ignore_index"),
                label_smoothing: c.float("label_smoothing"),
            };
            one(x().cross_entropy(c.t("target"), o))
        }
        "nll_loss" => one(x().nll_loss(c.t("target"), c.reduction(), c.int("ignore_index"))),
        "mse_loss" => one(x().mse_loss(c.t("target"), c.reduction())),
        "bce_with_logits" => one(x().bce_with_logits(c.t("target"), c.reduction())),
        "lstm_cell" => pair(Tensor::lstm_cell(c.t("gates"), c.t("c"))),
        "lstm_layer" => {
            let (out, h, cell) = Tensor::lstm_layer(
                x(),
                c.t("h0"),
                c.t("c0"),
                c.t("w_ih"),
                c.t("w_hh"),
                c.t("bias"),
            )?;
            Ok(vec![out, h, cell])
        }
        "optim" => optimize(c).map(|p| vec![p]),
        "optim_groups" => optimize_groups(c),
        "plateau" => {
            let mut s = ReduceLrOnPlateau::new(0.1);
            let or = |k: &str, d: f64| if c.has(k) { c.float(k) } else { d };
            s.factor = or("factor", s.factor);
            s.patience = or("patience", s.patience as f64) as usize;
            s.threshold = or("threshold", s.threshold);
            s.cooldown = or("cooldown", 0.0) as usize;
            s.min_lr = or("min_lr", 0.0);
            if c.has("mode") && c.get("mode") == "max" {
                s.mode = PlateauMode::Max;
            }
            if c.has("threshold_mode") && c.get("threshold_mode") == "abs" {
                s.threshold_mode = ThresholdMode::Abs;
            }
            let lrs = c
                .t("m")
                .to_vec_f64()?
                .into_iter()
                .map(|m| s.step(m).map(|lr| lr as f32))
                .collect::<Result<Vec<_>>>()?;
            let n = lrs.len();
            one(Tensor::from_vec(lrs, &[n], Device::Cpu))
        }
        "lr_schedule" => {
            let steps = c.int("steps") as usize;
            let lrs: Vec<f32> = match c.get("kind") {
                "step" => {
                    let s = StepLr {
                        base: c.float("base"),
                        step_size: c.int("step_size") as usize,
                        gamma: c.float("gamma"),
                    };
                    (0..steps).map(|k| s.lr(k) as f32).collect()
                }
                "multi_step" => {
                    let s = MultiStepLr {
                        base: c.float("base"),
                        milestones: c.usizes("milestones"),
                        gamma: c.float("gamma"),
                    };
                    (0..steps).map(|k| s.lr(k) as f32).collect()
                }
                "cosine" => {
                    let s = CosineAnnealing {
                        base: c.float("base"),
                        t_max: c.int("t_max") as usize,
                        eta_min: c.float("eta_min"),
                    };
                    (0..steps).map(|k| s.lr(k) as f32).collect()
                }
                _ => {
                    let s = OneCycle::new(c.float("max_lr"), steps);
                    (0..steps).map(|k| s.lr(k) as f32).collect()
                }
            };
            one(Tensor::from_vec(lrs, &[steps], Device::Cpu))
        }
        "clip_grad_norm" => {
            // Each parameter's gradient is twice its value.
            let ps = [c.t("p0").copy()?, c.t("p1").copy()?];
            let ps = ps.map(|p| p.requires_grad(true).unwrap());
            for p in &ps {
                p.set_grad(Some(p.detach().mul(2.0)?))?;
            }
            let norm = clip_grad_norm(&ps, c.float("max_norm"))?;
            Ok(vec![norm, ps[0].grad().unwrap(), ps[1].grad().unwrap()])
        }
        "grad_scaler" => scaled_steps(c),
        "scalar_op" => {
            let a = a().to_dtype(dtype_named(c.list("dtypes")[0]))?;
            let v = c.float("scalar");
            let s = match c.get("scalar_kind") {
                "int" => Operand::Int(v as i64),
                _ => Operand::Scalar(v),
            };
            one(match c.get("func") {
                "add" => a.add(s),
                "sub" => a.sub(s),
                "mul" => a.mul(s),
                "div" => a.div(s),
                "pow" => a.pow(s),
                "maximum" => a.maximum(s),
                "eq" => a.eq(s),
                _ => a.lt(s),
            })
        }
        "squeeze" => one(x().squeeze(c.int("dim") as isize)),
        "squeeze_all" => one(x().squeeze_all()),
        "unsqueeze" => one(x().unsqueeze(c.int("dim") as isize)),
        "flatten" => one(x().flatten(c.int("start") as isize, c.int("end") as isize)),
        "reshape_infer" => one(x().reshape_infer(&c.isizes("shape"))),
        "split" => x().split(c.int("size") as usize, c.int("dim") as isize),
        "transpose" => one(x().transpose(c.int("d0") as isize, c.int("d1") as isize)),
        "permute" => one(x().permute(&c.usizes("perm"))),
        "narrow" => one(x().narrow(
            c.int("dim") as isize,
            c.int("start") as usize,
            c.int("len") as usize,
        )),
        "expand" => one(x().expand(&c.usizes("shape"))),
        "t" => one(x().t()),
        "select" => one(x().select(c.int("dim") as isize, c.int("index"))),
        "slice" => one(x().slice(
            c.int("dim") as isize,
            c.int("start"),
            c.has("end").then(|| c.int("end")),
            c.int("step") as usize,
        )),
        "chunk" => x().chunk(c.int("chunks") as usize, c.int("dim") as isize),
        "view" => one(x().view(&c.isizes("shape"))),
        "view_t" => one(x().t()?.view(&c.isizes("shape"))),
        "repeat" => one(x().repeat(&c.usizes("repeats"))),
        "argsort" => one(x().argsort(c.int("dim") as isize, c.flag("descending"))),
        "sort" => {
            let (v, i) = x().sort(c.int("dim") as isize, c.flag("descending"))?;
            Ok(vec![v, i])
        }
        "topk" => {
            let k = c.int("k") as usize;
            let (v, i) = x().topk(k, c.int("dim") as isize, c.flag("largest"))?;
            Ok(vec![v, i])
        }
        "cumsum" => one(x().cumsum(c.int("dim") as isize)),
        "prod" => one(x().prod(c.int("dim") as isize, c.flag("keepdim"))),
        "prod_all" => one(x().prod_all()),
        "logsumexp" => one(x().logsumexp(&c.isizes("dims"), c.flag("keepdim"))),
        "all" => one(x().all(&c.isizes("dims"), c.flag("keepdim"))),
        "any" => one(x().any(&c.isizes("dims"), c.flag("keepdim"))),
        "eye" => one(Tensor::eye(
            c.int("n") as usize,
            c.int("m") as usize,
            DType::F32,
            device,
        )),
        "linspace" => one(Tensor::linspace(
            c.float("start"),
            c.float("end"),
            c.int("steps") as usize,
            DType::F32,
            device,
        )),
        "module" => run_module(c),
        "sdpa" => {
            let o = AttentionOptions {
                attn_mask: c.opt("mask"),
                is_causal: c.has("is_causal") && c.flag("is_causal"),
                scale: c.has("scale").then(|| c.float("scale")),
                ..Default::default()
            };
            one(c.t("q").scaled_dot_product_attention(c.t("k"), c.t("v"), o))
        }
        "mha" => {
            let mut m =
                MultiheadAttention::new(8, 2, c.flag("batch_first"), &mut Generator::new(0))?;
            load_module(c, &mut m)?;
            let x = c.t("x0");
            let causal = match c.flag("causal") {
                true => {
                    let ones = Tensor::ones(&[5, 5], DType::F32, device)?;
                    let later = ones.cumsum(1)?.gt(&ones.cumsum(0)?)?;
                    Some(later)
                }
                false => None,
            };
            one(m.attend(x, x, x, c.opt("kpm"), causal.as_ref()))
        }
        "conv1d" => {
            let o = Conv1dOptions {
                stride: c.int("stride") as usize,
                padding: c.int("padding") as usize,
                dilation: c.int("dilation") as usize,
                groups: c.int("groups") as usize,
            };
            one(x().conv1d(c.t("w"), c.opt("b"), o))
        }
        "group_norm" => one(x().group_norm(c.int("groups") as usize, c.opt("w"), c.opt("b"), 1e-5)),
        "promote" => {
            let d = c.list("dtypes");
            let a = a().to_dtype(dtype_named(d[0]))?;
            let b = b().to_dtype(dtype_named(d[1]))?;
            one(match c.get("func") {
                "add" => a.add(&b),
                "sub" => a.sub(&b),
                "mul" => a.mul(&b),
                "div" => a.div(&b),
                "maximum" => a.maximum(&b),
                _ => a.pow(&b),
            })
        }
        op => panic!("the test does not know op {op}"),
    }
}

/// Replaces every parameter and buffer of `m` by the case's input `p.<name>`; an Err when
/// the names differ from PyTorch's. Returns the buffers by name.
fn load_module(c: &Case, m: &mut dyn Module) -> Result<HashMap<String, Tensor>> {
    let mut unknown = vec![];
    m.visit_mut("", &mut |name, t, _| {
        match c.opt(&format!("p.{name}")) {
            Some(v) => *t = v.clone(),
            None => unknown.push(name),
        }
        Ok(())
    })?;
    let ours: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    let buffers: HashMap<String, Tensor> = m.named_buffers().into_iter().collect();
    let theirs = c
        .list("in")
        .into_iter()
        .filter(|n| n.starts_with("p."))
        .count();
    if !unknown.is_empty() || ours.len() + buffers.len() != theirs {
        return Err(mantissa::Error::Checkpoint {
            path: "the case".into(),
            problems: vec![format!(
                "module names: parameters {ours:?}, buffers {:?}, PyTorch's {:?}",
                buffers.keys(),
                c.list("in")
            )],
        });
    }
    Ok(buffers)
}

/// The case's module (PyTorch's configuration, any initial values) with the case's
/// parameters and buffers, run in the case's modes: the outputs of each call, then the
/// buffers (in PyTorch's order).
fn run_module(c: &Case) -> Result<Vec<Tensor>> {
    let mut g = Generator::new(0);
    let u = |k: &str| c.int(k) as usize;
    if c.get("kind") == "lstm" {
        let bf = c.flag("batch_first");
        let mut lstm = Lstm::new(u("fan_in"), u("hidden"), u("layers"), bf, &mut g)?;
        load_module(c, &mut lstm)?;
        // nn.LSTM's (output, (h, c)).
        let (y, (h, cell)) = lstm.forward_with_state(c.t("x0"), None)?;
        return Ok(vec![y, h, cell]);
    }
    if c.get("kind") == "gru" {
        let bf = c.flag("batch_first");
        let mut gru = Gru::new(u("fan_in"), u("hidden"), u("layers"), bf, &mut g)?;
        load_module(c, &mut gru)?;
        // nn.GRU's (output, h).
        let (y, h) = gru.forward_with_state(c.t("x0"), None)?;
        return Ok(vec![y, h]);
    }
    let mut m: Box<dyn Module> = match c.get("kind") {
        "linear" => Box::new(Linear::new(u("fan_in"), u("fan_out"), true, &mut g)?),
        "conv2d" => {
            let o = Conv2dOptions {
                stride: [u("stride"); 2],
                padding: [u("padding"); 2],
                dilation: [1, 1],
                groups: u("groups"),
            };
            let k = u("kernel");
            Box::new(Conv2d::new(u("fan_in"), u("fan_out"), k, o, true, &mut g)?)
        }
        "embedding" => Box::new(Embedding::new(u("num"), u("dim"), &mut g)?),
        "layer_norm" => Box::new(LayerNorm::new(&c.usizes("shape"))?),
        "batch_norm2d" => Box::new(BatchNorm2d::new(u("channels"))?),
        "batch_norm1d" => Box::new(BatchNorm1d::new(u("channels"))?),
        "group_norm" => Box::new(GroupNorm::new(u("groups"), u("channels"), true)?),
        "conv1d" => {
            let o = Conv1dOptions {
                stride: u("stride"),
                padding: u("padding"),
                dilation: 1,
                groups: u("groups"),
            };
            let k = u("kernel");
            Box::new(Conv1d::new(u("fan_in"), u("fan_out"), k, o, true, &mut g)?)
        }
        _ => Box::new(
            Sequential::new()
                .push(Conv2d::new(1, 4, 3, Default::default(), true, &mut g)?)
                .push(BatchNorm2d::new(4)?)
                .push(Activation::Relu)
                .push(MaxPool2d(MaxPool2dOptions::new(2)))
                .push(Flatten)
                .push(Linear::new(64, 3, true, &mut g)?),
        ),
    };
    let buffers = load_module(c, m.as_mut())?;
    let mut outs = vec![];
    for (i, mode) in c.list("calls").into_iter().enumerate() {
        match mode {
            "train" => m.train(),
            _ => m.eval(),
        }
        outs.push(m.forward(c.t(&format!("x{i}")))?);
    }
    let grads = c.list("grad");
    for name in c.list("in") {
        if let Some(buffer) = name.strip_prefix("p.").filter(|_| !grads.contains(&name)) {
            outs.push(buffers[buffer].clone());
        }
    }
    Ok(outs)
}

/// The dtype of a short name (`f32`, `bf16`, `i64`, ...).
fn dtype_named(name: &str) -> DType {
    match name {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "f64" => DType::F64,
        "i64" => DType::I64,
        "u8" => DType::U8,
        _ => panic!("unknown dtype {name}"),
    }
}

/// The case's optimizer over `params`, with the case's hyperparameters.
fn make_optimizer(c: &Case, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
    let lr = c.float("lr");
    let or0 = |k: &str| if c.has(k) { c.float(k) } else { 0.0 };
    let set = |pairs: Vec<(&str, &mut f64)>| {
        for (k, v) in pairs {
            if c.has(k) {
                *v = c.float(k);
            }
        }
    };
    Ok(match c.get("kind") {
        "sgd" => Box::new(Sgd::new(
            params,
            SgdConfig {
                momentum: or0("momentum"),
                dampening: or0("dampening"),
                weight_decay: or0("weight_decay"),
                nesterov: c.has("nesterov") && c.flag("nesterov"),
                ..SgdConfig::new(lr)
            },
        )?),
        kind @ ("adam" | "adamw") => {
            let mut cfg = match kind {
                "adam" => AdamConfig::adam(lr),
                _ => AdamConfig::adamw(lr),
            };
            set(vec![
                ("beta1", &mut cfg.beta1),
                ("beta2", &mut cfg.beta2),
                ("eps", &mut cfg.eps),
                ("weight_decay", &mut cfg.weight_decay),
            ]);
            Box::new(Adam::new(params, cfg)?)
        }
        "rmsprop" => {
            let mut opt = RmsProp::new(params, lr)?;
            set(vec![
                ("alpha", &mut opt.alpha),
                ("eps", &mut opt.eps),
                ("weight_decay", &mut opt.weight_decay),
                ("momentum", &mut opt.momentum),
            ]);
            opt.centered = c.has("centered") && c.flag("centered");
            Box::new(opt)
        }
        "adagrad" => {
            let mut opt = Adagrad::new(params, lr)?;
            set(vec![
                ("lr_decay", &mut opt.lr_decay),
                ("eps", &mut opt.eps),
                ("weight_decay", &mut opt.weight_decay),
                (
                    "initial_accumulator_value",
                    &mut opt.initial_accumulator_value,
                ),
            ]);
            Box::new(opt)
        }
        _ => {
            let mut opt = Adadelta::new(params, lr)?;
            set(vec![
                ("rho", &mut opt.rho),
                ("eps", &mut opt.eps),
                ("weight_decay", &mut opt.weight_decay),
            ]);
            Box::new(opt)
        }
    })
}

/// The parameter after `steps` updates of the case's optimizer, the gradient of step k being
/// the input `g{k}`.
fn optimize(c: &Case) -> Result<Tensor> {
    let p = c.t("p").copy()?.requires_grad(true)?;
    let mut opt = make_optimizer(c, vec![p.clone()])?;
    for k in 0..c.int("steps") {
        p.set_grad(Some(c.t(&format!("g{k}")).clone()))?;
        opt.step()?;
    }
    Ok(p.detach())
}

/// A weight under the case's optimizer and a bias in a group of its own (`group_lr`,
/// `group_weight_decay`), under a StepLR halving every 3 steps: both after `steps` updates.
fn optimize_groups(c: &Case) -> Result<Vec<Tensor>> {
    let w = c.t("w").copy()?.requires_grad(true)?;
    let b = c.t("b").copy()?.requires_grad(true)?;
    let mut opt = make_optimizer(c, vec![w.clone()])?;
    let get = |k: &str| c.has(k).then(|| c.float(k));
    let options = GroupOptions {
        lr: get("group_lr"),
        weight_decay: get("group_weight_decay"),
    };
    opt.add_param_group(vec![b.clone()], options)?;
    let schedule = StepLr {
        base: c.float("lr"),
        step_size: 3,
        gamma: 0.5,
    };
    for k in 0..c.int("steps") {
        opt.set_lr(schedule.lr(k as usize));
        w.set_grad(Some(c.t(&format!("gw{k}")).clone()))?;
        b.set_grad(Some(c.t(&format!("gb{k}")).clone()))?;
        opt.step()?;
    }
    Ok(vec![w.detach(), b.detach()])
}

/// The parameter after the case's steps of Adam behind a loss scaler (loss `sum(w * x_k)` at
/// step k), and the scale after each step's update.
fn scaled_steps(c: &Case) -> Result<Vec<Tensor>> {
    let w = c.t("w").copy()?.requires_grad(true)?;
    let mut opt = Adam::new(vec![w.clone()], AdamConfig::adam(0.01))?;
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: c.float("init_scale"),
        growth_interval: c.int("growth_interval") as usize,
        ..Default::default()
    })?;
    let mut scales = vec![];
    for k in 0..c.int("steps") {
        w.zero_grad();
        let loss = w.mul(c.t(&format!("x{k}")))?.sum_all()?;
        scaler.scale(&loss)?.backward()?;
        scaler.step(&mut opt)?;
        scaler.update()?;
        scales.push(scaler.current_scale()?.unwrap_or(f64::NAN) as f32);
    }
    let n = scales.len();
    Ok(vec![
        w.detach(),
        Tensor::from_vec(scales, &[n], Device::Cpu)?,
    ])
}

/// Where `got` differs from `want` (shape, dtype class, values), or `None`.
fn compare(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Option<String> {
    if got.shape() != want.shape() {
        return Some(format!(
            "{what}: shape {:?}, PyTorch {:?}",
            got.shape(),
            want.shape()
        ));
    }
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    if want.dtype() != DType::F32 {
        if got.dtype().is_float() {
            return Some(format!(
                "{what}: dtype {:?}, PyTorch {:?}",
                got.dtype(),
                want.dtype()
            ));
        }
        return (g != w).then(|| format!("{what}: {g:?}, PyTorch {w:?}"));
    }
    // Non-finite values must sit where PyTorch's are; the rest compare norm-wise.
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in g.iter().zip(&w) {
        if !y.is_finite() || !x.is_finite() {
            let same = (x.is_nan() && y.is_nan()) || x == y;
            if !same {
                return Some(format!("{what}: {g:?}, PyTorch {w:?}"));
            }
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    let err = num.sqrt() / den.sqrt().max(1e-12);
    (err > tol).then(|| format!("{what}: relative error {err:.2e}\n  got  {g:?}\n  want {w:?}"))
}

/// The mismatches of case `c` run on `device` (empty when it agrees with PyTorch).
fn check(c: &Case, device: Device) -> Vec<String> {
    let expect_err = c.has("err");
    let outs = match run(c, device) {
        Err(e) if expect_err => {
            // The message must name the op.
            let msg = e.to_string();
            return if msg.is_empty() {
                vec!["empty error message".into()]
            } else {
                vec![]
            };
        }
        Err(e) => return vec![format!("Err where PyTorch succeeds: {e}")],
        Ok(_) if expect_err => return vec!["Ok where PyTorch raises".into()],
        Ok(outs) => outs,
    };
    let (dtype, tol) = c.out_dtype();
    let mut bad = vec![];
    let mut loss: Option<Tensor> = None;
    for (k, y) in outs.iter().enumerate() {
        let Some(want) = c.tensors.get(&format!("out.{k}")) else {
            bad.push(format!("output {k}: PyTorch has fewer outputs"));
            continue;
        };
        if want.dtype() == DType::F32 && y.dtype() != dtype {
            bad.push(format!(
                "output {k}: dtype {:?}, expected {dtype:?}",
                y.dtype()
            ));
        }
        bad.extend(compare(&format!("output {k}"), y, want, tol));
        if let Some(g) = c.tensors.get(&format!("gout.{k}")) {
            let term = y.mul(g).and_then(|p| p.sum_all());
            let term = match term {
                Ok(t) => t,
                Err(e) => {
                    bad.push(format!("output {k}: {e}"));
                    continue;
                }
            };
            loss = Some(match loss {
                None => term,
                Some(l) => l.add(&term).unwrap(),
            });
        }
    }
    if c.tensors.contains_key(&format!("out.{}", outs.len())) {
        bad.push(format!("{} outputs, PyTorch has more", outs.len()));
    }
    let Some(loss) = loss else { return bad };
    if let Err(e) = loss.backward() {
        bad.push(format!("backward: {e}"));
        return bad;
    }
    for name in c.list("grad") {
        let Some(want) = c.tensors.get(&format!("grad.{name}")) else {
            continue;
        };
        match c.tensors[&format!("in.{name}")].grad() {
            None => bad.push(format!("grad of {name}: none, PyTorch has one")),
            Some(g) => bad.extend(compare(&format!("grad of {name}"), &g, want, tol)),
        }
    }
    bad
}

/// Casts the float inputs to the case's dtype, moves them and the output gradients to
/// `device`, marks those named in `grad` as requiring grad, and makes the transposed views of
/// those named in `T`.
fn prepare_inputs(c: &mut Case, device: Device) {
    let (dtype, _) = c.dtype();
    let (grads, transposed) = (c.list("grad"), c.list("T"));
    for name in c.list("in") {
        let key = format!("in.{name}");
        let mut t = c.tensors[&key].to_device(device).unwrap();
        if t.dtype() == DType::F32 {
            t = t.to_dtype(dtype).unwrap();
        }
        if grads.contains(&name) {
            t = t.requires_grad(true).unwrap();
        }
        if transposed.contains(&name) {
            let view = t.transpose(-2, -1).unwrap();
            c.tensors.insert(format!("view.{name}"), view);
        }
        c.tensors.insert(key, t);
    }
    for (name, t) in c.tensors.iter_mut() {
        if name.starts_with("gout.") {
            *t = t.to_device(device).unwrap();
        }
    }
}

/// Runs the cases (all, or the one `MANTISSA_TORCH_CASE` names) on `device`: the mismatches,
/// and how many cases and ops ran (on a GPU, without the f64 and u8 arithmetic cases).
fn run_cases(device: Device) -> (Vec<String>, usize, usize) {
    let st = SafeTensors::deserialize(CASES).unwrap();
    let (_, meta) = SafeTensors::read_metadata(CASES).unwrap();
    let meta = meta
        .metadata()
        .as_ref()
        .expect("case specs in the metadata");
    let only: Option<usize> = std::env::var("MANTISSA_TORCH_CASE")
        .ok()
        .map(|v| v.parse().unwrap());
    let mut by_case: HashMap<usize, HashMap<String, Tensor>> = HashMap::new();
    for name in st.names() {
        let (n, rest) = name.split_once('.').unwrap();
        let n: usize = n.parse().unwrap();
        if only.is_some_and(|o| o != n) {
            continue;
        }
        let t = stored(&st.tensor(name).unwrap());
        by_case.entry(n).or_default().insert(rest.to_string(), t);
    }
    let mut ids: Vec<usize> = meta
        .keys()
        .map(|k| k.strip_prefix("case.").unwrap().parse().unwrap())
        .filter(|n| only.is_none_or(|o| o == *n))
        .collect();
    ids.sort();
    let mut failures = vec![];
    let mut ops: Vec<&str> = vec![];
    let mut skipped = 0;
    for &n in &ids {
        let text = &meta[&format!("case.{n}")];
        let spec: HashMap<&str, &str> = text
            .split(' ')
            .map(|kv| kv.split_once('=').unwrap())
            .collect();
        // The CUDA backend computes in f32, f16, bf16 and (for counters) i64: f64 and u8
        // arithmetic are CPU-only, by design (an Err on a GPU).
        let cpu_only = |d: &&str| *d == "f64" || *d == "u8";
        if device != Device::Cpu
            && spec
                .get("dtypes")
                .is_some_and(|d| d.split(',').any(|d| cpu_only(&d)))
        {
            skipped += 1;
            continue;
        }
        ops.push(spec["op"]);
        let mut case = Case {
            spec,
            tensors: by_case.remove(&n).unwrap_or_default(),
        };
        prepare_inputs(&mut case, device);
        let bad = check(&case, device);
        if !bad.is_empty() {
            failures.push(format!("case {n} ({text}):\n  {}", bad.join("\n  ")));
        }
    }
    ops.sort();
    ops.dedup();
    (failures, ids.len() - skipped, ops.len())
}

/// On the CPU, then on the first CUDA device when there is one.
#[test]
fn ops_match_pytorch() {
    // The unmasked attention cases check the fused op (the masked ones, the composition).
    mantissa::set_attention_kernel(mantissa::AttentionKernel::Fused);
    let mut devices = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(d) => devices.push(d),
        Err(e) => println!("skipped: no CUDA device ({e})"),
    }
    // PyTorch's references are exact f32: the device's convolutions and LSTM products run
    // without TF32 here (on by default for those, as in PyTorch; tests/cuda_semantics.rs
    // checks that default).
    #[cfg(feature = "cuda-backend")]
    mantissa::backend::cuda::conv::set_cudnn_allow_tf32(false);
    for device in devices {
        let (failures, cases, ops) = run_cases(device);
        println!(
            "{device:?}: {cases} cases of {ops} ops, {} differ",
            failures.len()
        );
        assert!(
            cases == 1 || (cases >= 500 && ops >= 70),
            "only {cases} cases of {ops} ops in the file"
        );
        assert!(
            failures.is_empty(),
            "{} cases differ from PyTorch on {device:?}:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}
