//! CPU-vs-CUDA parity: every op, forward and backward, on the same inputs on both devices,
//! compared norm-wise within a band per dtype (transfers, casts and dropout masks bit for
//! bit). Without a GPU each test prints `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]
// `&[x.clone()]` reads better than `std::slice::from_ref(&x)` beside multi-input calls.
#![allow(clippy::cloned_ref_to_slice_refs)]

mod common;
use common::parity::*;
use common::*;
use mantissa::nn::Module;
use mantissa::optim::Optimizer;
use mantissa::*;

/// `full` writes on the device (a memset of the value's bits, or an upload for an I64 whose
/// halves differ): the same bytes as the CPU's, odd lengths and empty tensors included.
#[test]
fn fills_are_bit_identical() {
    let Some(d) = gpu() else { return };
    let all = [DType::F32, DType::F16, DType::BF16, DType::I64, DType::U8];
    for dt in all {
        for v in [0.0, 1.0, -2.5, 1.0 / 3.0, 65504.0, 7.0, -1.0, 1e-30] {
            for n in [0usize, 1, 3, 1001] {
                let want = Tensor::full(&[n], v, dt, Device::Cpu).unwrap();
                let got = Tensor::full(&[n], v, dt, d).unwrap();
                assert_eq!(
                    got.to_le_bytes().unwrap(),
                    want.to_le_bytes().unwrap(),
                    "full({v}) {dt:?} x {n}"
                );
            }
        }
    }
    let big = Tensor::full(&[3], 5e9, DType::I64, d).unwrap();
    assert_eq!(big.to_vec::<i64>().unwrap(), vec![5_000_000_000; 3]);
}

/// cat and stack along a later dim write into strided parts of their output on the device
/// (no read back, as every op of a training step should be), bit for bit as on the CPU.
#[test]
fn joins_write_on_the_device() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let (a, b) = (input(&[3, 2, 5], dt, 70), input(&[3, 4, 5], dt, 71));
        let (ga, gb) = (own(&a, d), own(&b, d));
        Tensor::cat(&[&ga, &gb], 1).unwrap(); // compiles the kernels
        let before = host_reads();
        let cat = Tensor::cat(&[&ga, &gb], 1).unwrap();
        let stack = Tensor::stack(&[&ga, &ga.mul(2.0).unwrap()], 3).unwrap();
        assert_eq!(host_reads(), before, "cat and stack on {d} ({dt:?})");
        let want = Tensor::cat(&[&a, &b], 1).unwrap();
        assert_eq!(cat.to_le_bytes().unwrap(), want.to_le_bytes().unwrap());
        let want = Tensor::stack(&[&a, &a.mul(2.0).unwrap()], 3).unwrap();
        assert_eq!(stack.to_le_bytes().unwrap(), want.to_le_bytes().unwrap());
    }
}

#[test]
fn transfers_and_casts_are_bit_identical() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let x = input(&[3, 5, 7], dt, 1);
        let back = x.to_device(d).unwrap().to_device(Device::Cpu).unwrap();
        assert_eq!(
            back.to_le_bytes().unwrap(),
            x.to_le_bytes().unwrap(),
            "{dt:?}"
        );
        // A strided view crosses as its selected elements.
        let v = x.permute(&[2, 0, 1]).unwrap().narrow(1, 1, 2).unwrap();
        let vb = v.to_device(d).unwrap().to_device(Device::Cpu).unwrap();
        assert_eq!(vals(&vb), vals(&v), "{dt:?} view");
        for to in FLOATS {
            let on_gpu = x.to_device(d).unwrap().to_dtype(to).unwrap();
            let host = on_gpu.to_device(Device::Cpu).unwrap();
            let want = x.to_dtype(to).unwrap();
            assert_eq!(
                host.to_le_bytes().unwrap(),
                want.to_le_bytes().unwrap(),
                "{dt:?}->{to:?}"
            );
        }
    }
    let idx = Tensor::from_vec(vec![3i64, -1, 7], &[3], Device::Cpu).unwrap();
    let back = idx.to_device(d).unwrap().to_device(Device::Cpu).unwrap();
    assert_eq!(back.to_vec::<i64>().unwrap(), vec![3, -1, 7]);
}

#[test]
fn unary_ops_match_forward_and_backward() {
    let Some(d) = gpu() else { return };
    type Op = fn(&Tensor) -> Result<Tensor>;
    let ops: [(&str, Op); 17] = [
        ("neg", |x| x.neg()),
        ("abs", |x| x.abs()),
        ("exp", |x| x.exp()),
        ("log", |x| x.abs()?.add(0.5)?.log()),
        ("sqrt", |x| x.abs()?.add(0.5)?.sqrt()),
        ("rsqrt", |x| x.abs()?.add(0.5)?.rsqrt()),
        ("recip", |x| x.abs()?.add(0.5)?.recip()),
        ("sin", |x| x.sin()),
        ("tanh", |x| x.tanh()),
        ("sigmoid", |x| x.sigmoid()),
        ("relu", |x| x.relu()),
        ("leaky_relu", |x| x.leaky_relu(0.1)),
        ("gelu", |x| x.gelu()),
        ("gelu_tanh", |x| x.gelu_tanh()),
        ("silu", |x| x.silu()),
        ("softplus", |x| x.mul(8.0)?.softplus()),
        ("clamp", |x| x.clamp(-0.5, 0.7)),
    ];
    for dt in FLOATS {
        let x = input(&[33, 65], dt, 2);
        for (name, op) in ops {
            parity(name, d, &[x.clone()], |xs| op(&xs[0]));
            // Through a transposed (strided) view too, and a contiguous one one element in
            // (not 16-byte aligned: the element-by-element path of the vectorised kernel).
            parity(name, d, &[x.clone()], |xs| op(&xs[0].t()?));
            parity(name, d, &[x.clone()], |xs| {
                op(&xs[0].flatten(0, -1)?.narrow(0, 1, 33 * 65 - 1)?)
            });
        }
    }
}

#[test]
fn binary_ops_broadcast_and_compare() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let (a, b) = (input(&[4, 1, 37], dt, 3), input(&[5, 37], dt, 4));
        parity("add", d, &[a.clone(), b.clone()], |x| x[0].add(&x[1]));
        parity("sub", d, &[a.clone(), b.clone()], |x| x[0].sub(&x[1]));
        parity("mul", d, &[a.clone(), b.clone()], |x| x[0].mul(&x[1]));
        parity("div", d, &[a.clone(), b.clone()], |x| {
            x[0].div(&x[1].abs()?.add(0.5)?)
        });
        parity("maximum", d, &[a.clone(), b.clone()], |x| {
            x[0].maximum(&x[1])
        });
        parity("where", d, &[a.clone(), b.clone()], |x| {
            Tensor::where_cond(&x[0].gt(&x[1])?, &x[0], &x[1])
        });
        parity("gt", d, &[a.clone(), b.clone()], |x| x[0].gt(&x[1]));
        if dt == DType::F32 {
            // I64 arithmetic (f64 inside, truncated toward zero), broadcast.
            let ia = Tensor::from_vec(vec![7i64, -7, 9, 100, -3, 0], &[2, 3], Device::Cpu);
            let ib = Tensor::from_vec(vec![2i64, 3, -4], &[3], Device::Cpu);
            let ints = [ia.unwrap(), ib.unwrap()];
            type IntOp = fn(&Tensor, &Tensor) -> Result<Tensor>;
            let int_ops: [(&str, IntOp); 6] = [
                ("i64 add", |a, b| a.add(b)),
                ("i64 sub", |a, b| a.sub(b)),
                ("i64 mul", |a, b| a.mul(b)),
                ("i64 div", |a, b| a.div(b)),
                ("i64 maximum", |a, b| a.maximum(b)),
                ("i64 minimum", |a, b| a.minimum(b)),
            ];
            for (name, op) in int_ops {
                parity(name, d, &ints, |x| op(&x[0], &x[1]));
            }
        }
        // Contiguous operands, aligned (vector loads) and one element in (not aligned).
        parity("mul contiguous", d, &[b.clone(), b.clone()], |x| {
            x[0].mul(&x[1])
        });
        parity("add offset", d, &[b.clone(), b.clone()], |x| {
            let n = 5 * 37 - 1;
            x[0].flatten(0, -1)?
                .narrow(0, 1, n)?
                .add(&x[1].flatten(0, -1)?.narrow(0, 0, n)?)
        });
        parity("add transposed", d, &[b.clone(), b.clone()], |x| {
            x[0].t()?.add(&x[1].t()?.mul(2.0)?)
        });
    }
}

#[test]
fn reductions_and_softmax_match() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let x = input(&[6, 50, 9], dt, 5);
        parity("sum last", d, &[x.clone()], |x| x[0].sum(&[-1], false));
        parity("sum middle", d, &[x.clone()], |x| x[0].sum(&[1], true));
        parity("mean two dims", d, &[x.clone()], |x| {
            x[0].mean(&[0, 2], false)
        });
        parity("sum all", d, &[x.clone()], |x| x[0].sum_all());
        // Leading dims with at least 64 values kept: the two-pass column reduction.
        let tall = input(&[300, 70], dt, 15);
        parity("sum leading", d, &[tall.clone()], |x| x[0].sum(&[0], false));
        let deep = input(&[5, 60, 66], dt, 16);
        parity("mean leading two", d, &[deep], |x| {
            x[0].mean(&[0, 1], false)
        });
        parity("max", d, &[x.clone()], |x| Ok(x[0].max(1, false)?.0));
        parity("argmax", d, &[x.clone()], |x| x[0].argmax(-1, false));
        parity("min", d, &[x.clone()], |x| Ok(x[0].min(1, true)?.0));
        parity("argmin", d, &[x.clone()], |x| x[0].argmin(1, false));
        // Ties: the first index wins on both devices.
        let ties = Tensor::from_vec(
            vec![1.0f32, 3.0, 3.0, 0.0, 0.0, 2.0, 5.0, 5.0],
            &[2, 4],
            Device::Cpu,
        )
        .unwrap()
        .to_dtype(dt)
        .unwrap();
        parity("argmax ties", d, &[ties.clone()], |x| {
            x[0].argmax(-1, false)
        });
        parity("argmin ties", d, &[ties], |x| x[0].argmin(-1, false));
        parity("softmax last", d, &[x.clone()], |x| x[0].softmax(-1));
        parity("softmax middle", d, &[x.clone()], |x| x[0].softmax(1));
        parity("log_softmax", d, &[x.clone()], |x| x[0].log_softmax(-1));
    }
}

#[test]
fn matrix_products_match_in_every_layout() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let (a, b) = (input(&[70, 130], dt, 6), input(&[130, 90], dt, 7));
        parity("matmul", d, &[a.clone(), b.clone()], |x| x[0].matmul(&x[1]));
        let w = input(&[90, 130], dt, 8);
        let bias = input(&[90], dt, 9);
        parity("x W^T", d, &[a.clone(), w.clone()], |x| {
            x[0].matmul(&x[1].t()?)
        });
        parity("linear", d, &[a.clone(), w.clone(), bias.clone()], |x| {
            x[0].linear(&x[1], Some(&x[2]))
        });
        // Operands and bias at odd element offsets (pointers aligned to one element only),
        // and a transposed input: the bias epilogue must not assume aligned operands.
        let wide = input(&[70, 133], dt, 14);
        parity("linear (offset views)", d, &[wide, w.clone(), bias], |x| {
            let b = x[2].reshape(&[1, 90])?.narrow(1, 1, 89)?.reshape(&[89])?;
            x[0].narrow(1, 3, 130)?
                .linear(&x[1].narrow(0, 1, 89)?, Some(&b))
        });
        // Linear + ReLU in one cuBLASLt call: the same values and gradients as the two ops
        // on the CPU (about half the outputs are clamped), and the fused op did run.
        let b2 = input(&[90], dt, 16);
        parity("linear_relu", d, &[a.clone(), w.clone(), b2.clone()], |x| {
            x[0].linear_relu(&x[1], &x[2])
        });
        let wg = own(&w, d).requires_grad(true).unwrap();
        let y = own(&a, d).linear_relu(&wg, &own(&b2, d)).unwrap();
        assert_eq!(
            y.op_name(),
            Some("linear_relu"),
            "cuBLASLt's ReLU epilogue ran"
        );
        parity(
            "linear (transposed input)",
            d,
            &[input(&[130, 70], dt, 15), w.clone()],
            |x| {
                x[0].t()?
                    .linear(&x[1], Some(&x[1].narrow(1, 5, 1)?.reshape(&[90])?))
            },
        );
        parity("a^T b", d, &[b.clone(), input(&[130, 40], dt, 10)], |x| {
            x[0].t()?.matmul(&x[1])
        });
        let (p, q) = (input(&[3, 17, 33], dt, 11), input(&[3, 33, 29], dt, 12));
        parity("batched", d, &[p.clone(), q], |x| x[0].matmul(&x[1]));
        parity("broadcast batch", d, &[p, input(&[33, 29], dt, 13)], |x| {
            x[0].matmul(&x[1])
        });
    }
}

#[test]
fn dropout_masks_are_identical() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let x = Tensor::ones(&[1001], dt, Device::Cpu).unwrap();
        let cpu = x.dropout_with(0.3, true, &mut Generator::new(7)).unwrap();
        let xg = x.to_device(d).unwrap();
        let gpu = xg.dropout_with(0.3, true, &mut Generator::new(7)).unwrap();
        let host = gpu.to_device(Device::Cpu).unwrap();
        assert_eq!(
            host.to_le_bytes().unwrap(),
            cpu.to_le_bytes().unwrap(),
            "{dt:?}"
        );
    }
}

#[test]
fn convolutions_match_in_every_mode() {
    use mantissa::backend::cuda::conv::{set_cudnn_benchmark, set_cudnn_deterministic};
    let Some(d) = gpu() else { return };
    let opts = Conv2dOptions {
        stride: [2, 1],
        padding: [1, 2],
        dilation: [1, 2],
        groups: 2,
    };
    // (heuristic, timed, deterministic) choices of algorithm give the same results.
    for (bench, det) in [(false, false), (true, false), (false, true)] {
        set_cudnn_benchmark(bench);
        set_cudnn_deterministic(det);
        for dt in FLOATS {
            let x = input(&[3, 4, 9, 11], dt, 20);
            let w = input(&[6, 2, 3, 3], dt, 21);
            let b = input(&[6], dt, 22);
            let what = format!("conv2d strided grouped (benchmark {bench}, deterministic {det})");
            parity(&what, d, &[x.clone(), w.clone(), b], |x| {
                x[0].conv2d(&x[1], Some(&x[2]), opts)
            });
            // A transposed view as the input: made contiguous before cuDNN sees it.
            let xt = input(&[3, 4, 11, 9], dt, 23);
            parity("conv2d of a transposed view", d, &[xt, w], |x| {
                x[0].transpose(2, 3)?.conv2d(&x[1], None, opts)
            });
        }
    }
    set_cudnn_benchmark(false);
    set_cudnn_deterministic(false);
}

#[test]
fn host_fallback_ops_match() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let x = input(&[2, 3, 10, 10], dt, 14);
        let w = input(&[4, 3, 3, 3], dt, 15);
        parity("conv2d", d, &[x.clone(), w], |x| {
            x[0].conv2d(&x[1], None, Conv2dOptions::default())
        });
        parity("max_pool2d", d, &[x.clone()], |x| {
            x[0].max_pool2d(MaxPool2dOptions::new(2))
        });
        let logits = input(&[8, 10], dt, 16);
        let target = Tensor::from_vec(vec![1i64, 0, 9, 3, 3, 7, 2, 5], &[8], Device::Cpu).unwrap();
        parity("cross_entropy", d, &[logits.clone(), target.clone()], |x| {
            x[0].cross_entropy(&x[1], Default::default())
        });
        parity("index_select", d, &[logits, target], |x| {
            x[0].index_select(1, &x[1])
        });
    }
}

/// One SGD step of a small MLP on both devices gives the same parameters.
#[test]
fn an_sgd_step_matches() {
    let Some(d) = gpu() else { return };
    let x = input(&[16, 20], DType::F32, 17);
    let (w1, w2) = (
        input(&[32, 20], DType::F32, 18),
        input(&[5, 32], DType::F32, 19),
    );
    let target = Tensor::from_vec(
        vec![0i64, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0],
        &[16],
        Device::Cpu,
    )
    .unwrap();
    let step = |dev: Device| -> Vec<Vec<f64>> {
        let ps: Vec<Tensor> = [&w1, &w2]
            .iter()
            .map(|p| own(p, dev).requires_grad(true).unwrap())
            .collect();
        let config = optim::SgdConfig {
            momentum: 0.9,
            ..optim::SgdConfig::new(0.1)
        };
        let mut opt = optim::Sgd::new(ps.clone(), config).unwrap();
        let h = x
            .to_device(dev)
            .unwrap()
            .linear(&ps[0], None)
            .unwrap()
            .relu()
            .unwrap();
        let loss = h
            .linear(&ps[1], None)
            .unwrap()
            .cross_entropy(&target.to_device(dev).unwrap(), Default::default())
            .unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        ps.iter().map(vals).collect()
    };
    let (want, got) = (step(Device::Cpu), step(d));
    for (g, w) in got.iter().zip(&want) {
        assert_close(g, w, 1e-5, "parameters after one SGD step");
    }
}

/// Three steps of each optimizer on both devices from the same parameters and gradients:
/// SGD (momentum, nesterov, weight decay, and without momentum), Adam, AdamW, Adadelta, in
/// f32, f16 and bf16, and with f32 master weights behind f16 and bf16 (stochastic rounding)
/// working copies; a step whose found_inf flag is set changes nothing on either device.
#[test]
fn optimizer_updates_match() {
    use optim::{Adadelta, Adam, AdamConfig, Rounding, Sgd, SgdConfig};
    let Some(d) = gpu() else { return };
    type Make = fn(Vec<Tensor>) -> Box<dyn Optimizer>;
    let makers: [(&str, Make); 5] = [
        ("sgd", |p| {
            Box::new(
                Sgd::new(
                    p,
                    SgdConfig {
                        momentum: 0.9,
                        nesterov: true,
                        weight_decay: 0.01,
                        ..SgdConfig::new(0.05)
                    },
                )
                .unwrap(),
            )
        }),
        ("sgd plain", |p| {
            Box::new(Sgd::new(p, SgdConfig::new(0.05)).unwrap())
        }),
        ("adam", |p| {
            Box::new(
                Adam::new(
                    p,
                    AdamConfig {
                        weight_decay: 0.01,
                        ..AdamConfig::adam(1e-2)
                    },
                )
                .unwrap(),
            )
        }),
        ("adamw", |p| {
            Box::new(Adam::new(p, AdamConfig::adamw(1e-2)).unwrap())
        }),
        ("adadelta", |p| Box::new(Adadelta::new(p, 1.0).unwrap())),
    ];
    let grads: Vec<Tensor> = (0..3).map(|s| f32s(&[40, 33], 40 + s)).collect();
    let cases = [
        (DType::F32, None),
        (DType::F16, None),
        (DType::BF16, None),
        (DType::F16, Some(Rounding::Nearest)),
        (DType::BF16, Some(Rounding::Stochastic { seed: 5 })),
    ];
    for (name, make) in makers {
        for (dt, master) in cases {
            let run = |dev: Device| -> Vec<f64> {
                let p = own(&input(&[40, 33], dt, 30), dev)
                    .requires_grad(true)
                    .unwrap();
                let mut opt = make(vec![p.clone()]);
                if let Some(r) = master {
                    opt.use_master_weights(r).unwrap();
                }
                for g in &grads {
                    p.set_grad(Some(g.to_dtype(dt).unwrap().to_device(dev).unwrap()))
                        .unwrap();
                    opt.step().unwrap();
                }
                vals(&p)
            };
            let what = format!("{name} {dt:?} master {master:?}: parameters after 3 steps");
            assert_close(&run(d), &run(Device::Cpu), band(dt), &what);
        }
    }
    // found_inf set: the step is skipped on the device, parameters and count unchanged.
    let p = own(&input(&[40, 33], DType::F32, 31), d)
        .requires_grad(true)
        .unwrap();
    let before = vals(&p);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::adam(1e-2)).unwrap();
    let mut scaler = amp::GradScaler::new(Default::default()).unwrap();
    let loss = p.mul(f64::INFINITY).unwrap().sum_all().unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
    scaler.step(&mut opt).unwrap();
    assert_eq!(vals(&p), before, "an overflowing step must change nothing");
}

/// Pooling windows of every kind: overlapping, padded, dilated, ceil mode, with and without
/// padded cells in the average's divisor, and adaptive to a coarser and a finer grid.
#[test]
fn pooling_matches() {
    let Some(d) = gpu() else { return };
    let max_opts = [
        MaxPool2dOptions::new(2),
        MaxPool2dOptions {
            kernel: [3, 2],
            stride: Some([2, 1]),
            padding: [1, 1],
            dilation: [1, 2],
            ceil_mode: true,
        },
    ];
    let avg_opts = [
        AvgPool2dOptions::new(2),
        AvgPool2dOptions {
            kernel: [3, 3],
            stride: Some([2, 2]),
            padding: [1, 1],
            ceil_mode: true,
            count_include_pad: false,
        },
        AvgPool2dOptions {
            kernel: [3, 2],
            stride: Some([1, 2]),
            padding: [1, 0],
            ceil_mode: false,
            count_include_pad: true,
        },
    ];
    // NCHW, then channels-last (pooled in NHWC order on the GPU, NCHW planes on the CPU); the
    // output keeps the input's format either way.
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        let keeps = move |y: Tensor| -> Result<Tensor> {
            assert_eq!(
                y.memory_format(),
                format,
                "pooled strides {:?}",
                y.strides()
            );
            Ok(y)
        };
        let input_in = |x: &Tensor| x.to_memory_format(format);
        // Three channels, rows of 10: the element kernels; sixteen channels, rows of 16: the
        // vector kernels (whole 16-byte vectors of channels channels-last, of cells along a
        // row in NCHW, in every dtype).
        for (dt, channels) in FLOATS.into_iter().flat_map(|dt| [(dt, 3), (dt, 16)]) {
            let x = input(&[2, channels, 9, channels.max(10)], dt, 50);
            for o in max_opts {
                let what = format!("max_pool2d {o:?} {format:?}");
                parity(&what, d, &[x.clone()], |x| {
                    keeps(input_in(&x[0])?.max_pool2d(o)?)
                });
            }
            for o in avg_opts {
                let what = format!("avg_pool2d {o:?} {format:?}");
                parity(&what, d, &[x.clone()], |x| {
                    keeps(input_in(&x[0])?.avg_pool2d(o)?)
                });
            }
            for out in [[3, 4], [1, 1], [13, 11]] {
                let what = format!("adaptive_avg_pool2d {out:?} {format:?}");
                parity(&what, d, &[x.clone()], |x| {
                    keeps(input_in(&x[0])?.adaptive_avg_pool2d(out)?)
                });
            }
            // Ties inside a window: the first index wins on both devices, so the gradient
            // lands on the same cell.
            let ties = input(&[1, channels, 6, channels.max(6)], dt, 51)
                .mul(0.0)
                .unwrap()
                .add(1.0)
                .unwrap();
            parity("max_pool2d ties", d, &[ties], |x| {
                keeps(input_in(&x[0])?.max_pool2d(max_opts[1])?)
            });
        }
    }
}

/// Held by the tests that turn the process-wide deterministic index_add on, so that the
/// other one's atomic (and read-free) cases run with it off.
fn index_add_switch() -> std::sync::MutexGuard<'static, ()> {
    static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SWITCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// Indexing on the device: index_select along each dim and of a transposed view (its
/// backward adds repeated rows in order), gather and scatter_add with repeated indices,
/// embedding (forward and the weight's gradient), and integer tensors taken by width.
#[test]
fn indexing_matches() {
    use mantissa::backend::cuda::index::set_deterministic_index_add;
    let Some(d) = gpu() else { return };
    let _switch = index_add_switch();
    // Atomic additions (the default), then the fixed-order ones.
    for deterministic in [false, true] {
        set_deterministic_index_add(deterministic);
        indexing_cases(d);
    }
    set_deterministic_index_add(false);
}

fn indexing_cases(d: Device) {
    let idx = |v: Vec<i64>| Tensor::from_vec(v.clone(), &[v.len()], Device::Cpu).unwrap();
    for dt in FLOATS {
        let x = input(&[6, 7], dt, 60);
        let rows = idx(vec![5, 0, 0, 3, 5, 5, 1]);
        parity("index_select dim 0", d, &[x.clone(), rows.clone()], |x| {
            x[0].index_select(0, &x[1])
        });
        parity(
            "index_select dim 1",
            d,
            &[x.clone(), idx(vec![6, 2, 2])],
            |x| x[0].index_select(1, &x[1]),
        );
        parity(
            "index_select of a transposed view",
            d,
            &[x.clone(), rows.clone()],
            |x| x[0].t()?.index_select(1, &x[1]),
        );
        let g = Tensor::from_vec(
            vec![0i64, 6, 6, 1, 2, 2, 3, 3, 3, 4, 5, 0],
            &[4, 3],
            Device::Cpu,
        )
        .unwrap();
        parity("gather dim 1", d, &[x.clone(), g.clone()], |x| {
            x[0].gather(1, &x[1])
        });
        let g0 = Tensor::from_vec(vec![5i64, 5, 0, 1, 1, 1, 2, 4], &[2, 4], Device::Cpu).unwrap();
        parity("gather dim 0", d, &[x.clone(), g0.clone()], |x| {
            x[0].gather(0, &x[1])
        });
        let src = input(&[2, 4], dt, 61);
        parity("scatter_add dim 0", d, &[x.clone(), g0, src], |x| {
            x[0].scatter_add(0, &x[1], &x[2])
        });
        let table = input(&[9, 5], dt, 62);
        let tokens = Tensor::from_vec(vec![8i64, 1, 1, 0, 8, 3], &[2, 3], Device::Cpu).unwrap();
        parity("embedding", d, &[tokens, table], |x| {
            Tensor::embedding(&x[0], &x[1])
        });
    }
    for (name, t) in [
        (
            "i64",
            Tensor::from_vec((0..42i64).collect(), &[6, 7], Device::Cpu).unwrap(),
        ),
        (
            "u8",
            Tensor::from_vec((0..42u8).collect(), &[6, 7], Device::Cpu).unwrap(),
        ),
    ] {
        let want = t.index_select(0, &idx(vec![4, 4, 1])).unwrap();
        let got = own(&t, d)
            .index_select(0, &idx(vec![4, 4, 1]).to_device(d).unwrap())
            .unwrap();
        assert_eq!(vals(&got), vals(&want), "index_select of {name}");
    }
}

/// Indices stay on the device: an embedding's forward and backward read nothing back, an
/// index out of range is reported at the next read naming the op (and the device goes on
/// working), and the fixed-order mode adds in the CPU's order, bit for bit.
#[test]
fn indexing_stays_on_the_device() {
    use mantissa::backend::cuda::index::set_deterministic_index_add;
    let Some(d) = gpu() else { return };
    let _switch = index_add_switch();
    let on = |t: Tensor| t.to_device(d).unwrap();
    let table = own(&input(&[50, 16], DType::F32, 63), d)
        .requires_grad(true)
        .unwrap();
    let ids: Vec<i64> = (0..64).map(|i| (i * 7) % 50).collect();
    let tokens = on(Tensor::from_vec(ids.clone(), &[8, 8], Device::Cpu).unwrap());
    let step = || {
        table.zero_grad();
        let y = Tensor::embedding(&tokens, &table).unwrap();
        y.sum_all().unwrap().backward().unwrap();
    };
    step();
    let before = host_reads();
    step();
    assert_eq!(
        host_reads(),
        before,
        "embedding forward and backward on {d}"
    );
    // Each row's gradient is the number of times it was picked (exact in f32).
    let mut counts = vec![0.0; 50 * 16];
    for &i in &ids {
        for c in 0..16 {
            counts[i as usize * 16 + c] += 1.0;
        }
    }
    assert_eq!(vals(&table.grad().unwrap()), counts, "embedding gradient");

    let bad = on(Tensor::from_vec(vec![3i64, 50], &[2], Device::Cpu).unwrap());
    let y = table
        .index_select(0, &bad)
        .expect("found by the kernel, not here");
    let e = y.to_vec_f64().unwrap_err().to_string();
    assert!(e.contains("index_select") && e.contains("size 50"), "{e}");
    assert!(
        table.sum_all().unwrap().item().is_ok(),
        "the device after a bad index"
    );

    set_deterministic_index_add(true);
    let x = input(&[4, 6], DType::F32, 64);
    let index = Tensor::from_vec(
        (0..60).map(|i| (i * i) % 4).collect::<Vec<i64>>(),
        &[10, 6],
        Device::Cpu,
    )
    .unwrap();
    let src = input(&[10, 6], DType::F32, 65);
    let want = x.scatter_add(0, &index, &src).unwrap();
    let got = on(x).scatter_add(0, &on(index), &on(src)).unwrap();
    set_deterministic_index_add(false);
    assert_eq!(vals(&got), vals(&want), "fixed-order scatter_add, f32");
}

/// The ops not covered above, most of them built from the device primitives: joins and views
/// (cat, stack, split, narrow, expand, copy_ into a strided view), masked_fill, pow, var,
/// batch and layer norm, the losses, conv_transpose2d, the fused LSTM cell and layer, and a
/// two-layer LSTM.
/// A BatchNorm2d with weight `x[1]` and bias `x[2]`, its buffers on `x[0]`'s device, and the
/// input `x[0]`, channels-last with `cl`.
fn batch_norm_on_device(x: &[Tensor], cl: bool) -> Result<(nn::BatchNorm2d, Tensor)> {
    let mut bn = nn::BatchNorm2d::new(x[1].numel())?;
    let dev = x[0].device();
    (bn.weight, bn.bias) = (x[1].clone(), x[2].clone());
    bn.running_mean = bn.running_mean.to_device(dev)?;
    bn.running_var = bn.running_var.to_device(dev)?;
    bn.num_batches_tracked = bn.num_batches_tracked.to_device(dev)?;
    let x0 = match cl {
        true => x[0].to_memory_format(MemoryFormat::ChannelsLast)?,
        false => x[0].clone(),
    };
    Ok((bn, x0))
}

/// `bn` followed by ReLU in a `Sequential` on `x`, checked to run as the fused op.
fn bn_relu(bn: nn::BatchNorm2d, x: &Tensor) -> Result<Tensor> {
    use mantissa::nn::{Activation, Sequential};
    let y = Sequential::new()
        .push(bn)
        .push(Activation::Relu)
        .forward(x)?;
    assert_eq!(y.op_name(), Some("batch_norm_relu"));
    Ok(y)
}

#[test]
fn composite_ops_match() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let (a, b) = (input(&[4, 6], dt, 70), input(&[4, 6], dt, 71));
        parity("cat", d, &[a.clone(), b.clone()], |x| {
            Tensor::cat(&[&x[0], &x[1].t()?.t()?], 1)
        });
        parity("stack", d, &[a.clone(), b.clone()], |x| {
            Tensor::stack(&[&x[0], &x[1]], 0)
        });
        parity("split and narrow", d, &[a.clone()], |x| {
            let parts = x[0].split(4, 1)?;
            parts[1].mul(&x[0].narrow(1, 0, 2)?)
        });
        parity("expand", d, &[input(&[4, 1], dt, 72)], |x| {
            x[0].expand(&[4, 5])?.mul(2.0)
        });
        parity("masked_fill", d, &[a.clone(), b.clone()], |x| {
            x[0].masked_fill(&x[1].gt(0.0)?, -3.0)
        });
        parity("pow", d, &[a.clone(), b.clone()], |x| {
            x[0].abs()?.add(0.5)?.pow(&x[1])
        });
        parity("scalar pow", d, &[a.clone()], |x| {
            x[0].abs()?.add(0.5)?.pow(1.7)
        });
        parity("var", d, &[a.clone()], |x| x[0].var(&[1], 1, false));
        parity("minimum, min", d, &[a.clone(), b.clone()], |x| {
            Ok(x[0].minimum(&x[1])?.min(0, false)?.0)
        });
        parity("cos", d, &[a.clone()], |x| x[0].cos());

        let img = input(&[3, 4, 5, 5], dt, 73);
        let (gamma, beta) = (input(&[4], dt, 74), input(&[4], dt, 75));
        parity(
            "batch_norm (batch statistics)",
            d,
            &[img.clone(), gamma.clone(), beta.clone()],
            |x| x[0].batch_norm(None, None, Some(&x[1]), Some(&x[2]), true, 0.1, 1e-5),
        );
        // BatchNorm2d followed by ReLU in a Sequential: batch norm with the ReLU fused, its
        // backward masked where the output (recomputed from the input) was positive;
        // row-major and channels-last.
        for cl in [false, true] {
            parity(
                "batch_norm + relu (Sequential)",
                d,
                &[img.clone(), gamma.clone(), beta.clone()],
                |x| {
                    let (bn, x0) = batch_norm_on_device(x, cl)?;
                    bn_relu(bn, &x0)
                },
            );
        }
        // A Residual whose main branch ends in a batch norm: relu(bn(x) + x) as one op, its
        // backward masking once for both branches; 16-byte vectors in both formats (inner 16,
        // 8 channels).
        let block_in = input(&[2, 8, 4, 4], dt, 85);
        let (g8, b8) = (input(&[8], dt, 86), input(&[8], dt, 87));
        for cl in [false, true] {
            parity(
                "batch_norm + add + relu (Residual)",
                d,
                &[block_in.clone(), g8.clone(), b8.clone()],
                |x| {
                    use mantissa::nn::{Residual, Sequential};
                    let (bn, x0) = batch_norm_on_device(x, cl)?;
                    let y = Residual::new(Sequential::new().push(bn), None).forward(&x0)?;
                    assert_eq!(y.op_name(), Some("batch_norm_add_relu"));
                    assert_eq!(y.is_channels_last(), cl, "the block keeps the format");
                    Ok(y)
                },
            );
        }
        // The fused kernels' other paths: channels-last (two 32-channel tiles, one partial),
        // several row chunks (1,024-element runs; 300 rows of a 2-D input), eval mode.
        let wide = input(&[3, 40, 5, 5], dt, 80);
        let (g40, b40) = (input(&[40], dt, 81), input(&[40], dt, 82));
        parity(
            "batch_norm channels-last",
            d,
            &[wide, g40.clone(), b40.clone()],
            |x| {
                let y = x[0]
                    .to_memory_format(MemoryFormat::ChannelsLast)?
                    .batch_norm(None, None, Some(&x[1]), Some(&x[2]), true, 0.1, 1e-5)?;
                assert!(y.is_channels_last(), "batch_norm keeps channels-last");
                Ok(y)
            },
        );
        let big = input(&[8, 4, 32, 32], dt, 83);
        parity(
            "batch_norm (several chunks)",
            d,
            &[big, gamma.clone(), beta.clone()],
            |x| x[0].batch_norm(None, None, Some(&x[1]), Some(&x[2]), true, 0.1, 1e-5),
        );
        // Channels-last in 16-byte vectors over several row chunks, the last one short (2,304
        // rows of 16 channels: chunks of 2,048 rows in f16/bf16, 1,024 in f32).
        let tall = input(&[4, 16, 24, 24], dt, 88);
        let (g16, b16) = (input(&[16], dt, 89), input(&[16], dt, 90));
        parity(
            "batch_norm channels-last (vector chunks)",
            d,
            &[tall.clone(), g16.clone(), b16.clone()],
            |x| {
                let x0 = x[0].to_memory_format(MemoryFormat::ChannelsLast)?;
                x0.batch_norm(None, None, Some(&x[1]), Some(&x[2]), true, 0.1, 1e-5)
            },
        );
        // The same with the ReLU fused: the backward's vector passes recompute its mask.
        parity(
            "batch_norm + relu channels-last (vector chunks)",
            d,
            &[tall, g16, b16],
            |x| {
                let (bn, x0) = batch_norm_on_device(x, true)?;
                bn_relu(bn, &x0)
            },
        );
        let rows = input(&[300, 40], dt, 84);
        parity("batch_norm 2-D", d, &[rows, g40, b40], |x| {
            x[0].batch_norm(None, None, Some(&x[1]), Some(&x[2]), true, 0.1, 1e-5)
        });
        parity(
            "batch_norm eval",
            d,
            &[img.clone(), gamma.clone(), beta.clone()],
            |x| {
                let on =
                    |v: Vec<f32>| Tensor::from_vec(v, &[4], Device::Cpu)?.to_device(x[0].device());
                let (rm, rv) = (
                    on(vec![0.1, -0.2, 0.3, 0.0])?,
                    on(vec![1.5, 0.5, 2.0, 1.0])?,
                );
                x[0].batch_norm(
                    Some(&rm),
                    Some(&rv),
                    Some(&x[1]),
                    Some(&x[2]),
                    false,
                    0.1,
                    1e-5,
                )
            },
        );
        // Eval with the ReLU fused: the backward recomputes the mask from the running
        // statistics, with the parameters' gradients (the sums' pass) and without (the affine
        // pass alone: the parameters are constants).
        for with_params in [true, false] {
            let ins = match with_params {
                true => vec![img.clone(), gamma.clone(), beta.clone()],
                false => vec![img.clone()],
            };
            let (g, b) = (gamma.clone(), beta.clone());
            parity("batch_norm + relu eval (Sequential)", d, &ins, |x| {
                use mantissa::nn::Module;
                let dev = x[0].device();
                let params = match with_params {
                    true => [x[1].clone(), x[2].clone()],
                    false => [g.to_device(dev)?, b.to_device(dev)?],
                };
                let (mut bn, x0) = batch_norm_on_device(
                    &[x[0].clone(), params[0].clone(), params[1].clone()],
                    false,
                )?;
                bn.running_mean =
                    Tensor::from_vec(vec![0.1f32, -0.2, 0.3, 0.0], &[4], Device::Cpu)?
                        .to_device(dev)?;
                bn.running_var = Tensor::from_vec(vec![1.5f32, 0.5, 2.0, 1.0], &[4], Device::Cpu)?
                    .to_device(dev)?;
                bn.eval();
                bn_relu(bn, &x0)
            });
        }
        parity("batch_norm eval, no affine", d, &[img.clone()], |x| {
            let on = |v: Vec<f32>| Tensor::from_vec(v, &[4], Device::Cpu)?.to_device(x[0].device());
            let (rm, rv) = (
                on(vec![0.1, -0.2, 0.3, 0.0])?,
                on(vec![1.5, 0.5, 2.0, 1.0])?,
            );
            x[0].batch_norm(Some(&rm), Some(&rv), None, None, false, 0.1, 1e-5)
        });
        let seq = input(&[3, 7, 8], dt, 76);
        let (lw, lb) = (input(&[7, 8], dt, 77), input(&[7, 8], dt, 78));
        parity("layer_norm", d, &[seq.clone(), lw, lb], |x| {
            x[0].layer_norm(&[7, 8], Some(&x[1]), Some(&x[2]), 1e-5)
        });
        // Rows longer than a block, without affine parameters.
        let long = input(&[4, 1000], dt, 85);
        parity("layer_norm (long rows, no affine)", d, &[long], |x| {
            x[0].layer_norm(&[1000], None, None, 1e-5)
        });
        // Attention's scaled (and causal) softmax in one op, more queries than keys and
        // fewer, in the product's dtype.
        for (l, s, causal) in [(5, 7, true), (7, 5, true), (6, 9, false)] {
            let (q, k, v) = (
                input(&[2, 3, l, 8], dt, 89),
                input(&[2, 3, s, 8], dt, 90),
                input(&[2, 3, s, 4], dt, 91),
            );
            let o = AttentionOptions {
                is_causal: causal,
                scale: Some(0.3),
                ..Default::default()
            };
            let what = format!("scaled_dot_product_attention ({l} x {s}, causal {causal})");
            parity(&what, d, &[q, k, v], |x| {
                x[0].scaled_dot_product_attention(&x[1], &x[2], o)
            });
        }
        // A GPT's width over more rows than the backward's blocks (each sums the weight's
        // and bias's gradients of several rows, three columns a thread), and rows wider than
        // those sums take (the parameters' gradients composed).
        for (rows, cols) in [(1030, 768), (3, 2100)] {
            let x = input(&[rows, cols], dt, 86);
            let (w, b) = (input(&[cols], dt, 87), input(&[cols], dt, 88));
            let what = format!("layer_norm ({rows} x {cols})");
            parity(&what, d, &[x, w, b], |x| {
                x[0].layer_norm(&[cols], Some(&x[1]), Some(&x[2]), 1e-5)
            });
        }

        let logits = input(&[6, 5], dt, 79);
        let target = Tensor::from_vec(vec![4i64, -100, 0, 2, 2, 1], &[6], Device::Cpu).unwrap();
        let opts = CrossEntropyOptions {
            label_smoothing: 0.1,
            ..Default::default()
        };
        parity(
            "cross_entropy (smoothing, ignore_index)",
            d,
            &[logits.clone(), target],
            |x| x[0].cross_entropy(&x[1], opts),
        );
        let y = input(&[6, 5], dt, 80);
        parity("mse_loss", d, &[logits.clone(), y.clone()], |x| {
            x[0].mse_loss(&x[1], Reduction::Mean)
        });
        parity("bce_with_logits", d, &[logits.clone(), y], |x| {
            x[0].bce_with_logits(&x[1].sigmoid()?, Reduction::Sum)
        });

        let (gates, cell) = (input(&[5, 24], dt, 85), input(&[5, 12], dt, 86));
        parity("lstm_cell (h and c', strided c)", d, &[gates, cell], |x| {
            let (h, c2) = Tensor::lstm_cell(&x[0], &x[1].narrow(1, 3, 6)?)?;
            Tensor::cat(&[&h, &c2], 1)
        });
        let layer: Vec<Tensor> = [&[5, 3, 4][..], &[3, 6], &[3, 6], &[24, 4], &[24, 6], &[24]]
            .iter()
            .enumerate()
            .map(|(k, s)| input(s, dt, 87 + k as u64))
            .collect();
        parity(
            "lstm_layer (y, h and c; all six gradients)",
            d,
            &layer,
            |x| {
                let (y, h, c) = Tensor::lstm_layer(&x[0], &x[1], &x[2], &x[3], &x[4], &x[5])?;
                Tensor::cat(&[&y.reshape(&[15, 6])?, &h, &c], 0)
            },
        );
        let w = input(&[4, 3, 3, 3], dt, 81);
        let topts = ConvTranspose2dOptions {
            stride: [2, 2],
            padding: [1, 1],
            output_padding: [1, 0],
            dilation: [1, 1],
            groups: 1,
        };
        parity("conv_transpose2d", d, &[img.clone(), w], |x| {
            x[0].conv_transpose2d(&x[1], None, topts)
        });
    }
    // A two-layer LSTM, batch first, from a given state: output, final state and parameter
    // gradients on both devices (f32).
    let mut gen = Generator::new(3);
    let mut lstm = nn::Lstm::new(6, 5, 2, true, &mut gen).unwrap();
    let x = input(&[3, 4, 6], DType::F32, 82);
    let (h0, c0) = (
        input(&[2, 3, 5], DType::F32, 83),
        input(&[2, 3, 5], DType::F32, 84),
    );
    let run = |lstm: &nn::Lstm, dev: Device| -> Vec<Vec<f64>> {
        let (y, (h, c)) = lstm
            .forward_with_state(
                &x.to_device(dev).unwrap(),
                Some((&h0.to_device(dev).unwrap(), &c0.to_device(dev).unwrap())),
            )
            .unwrap();
        y.sum_all().unwrap().backward().unwrap();
        let grads: Vec<f64> = lstm
            .parameters()
            .iter()
            .flat_map(|p| vals(&p.grad().unwrap()))
            .collect();
        vec![vals(&y), vals(&h), vals(&c), grads]
    };
    let want = run(&lstm, Device::Cpu);
    lstm.zero_grad();
    lstm.to_device(d).unwrap();
    let got = run(&lstm, d);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(
            g,
            w,
            1e-5,
            &format!("lstm output {i} (y, h, c, parameter grads)"),
        );
    }
}

/// The fused cross-entropy reads nothing back to the host, forward or backward; a target out
/// of range is found on the device and reported by the next read, which names the op, and
/// the reads after it succeed.
#[test]
fn cross_entropy_reads_nothing_back() {
    let Some(d) = gpu() else { return };
    let logits = own(&input(&[64, 10], DType::F32, 40), d)
        .requires_grad(true)
        .unwrap();
    let target: Vec<i64> = (0..64).map(|i| (i * 7) % 10).collect();
    let target = Tensor::from_vec(target, &[64], Device::Cpu)
        .unwrap()
        .to_device(d)
        .unwrap();
    let before = host_reads();
    let loss = logits.cross_entropy(&target, Default::default()).unwrap();
    loss.backward().unwrap();
    assert_eq!(
        host_reads(),
        before,
        "host reads during the loss step on {d}"
    );
    assert!(loss.item().unwrap().is_finite());
    let bad = Tensor::from_vec(vec![3i64, 10], &[2], Device::Cpu)
        .unwrap()
        .to_device(d)
        .unwrap();
    let x = own(&input(&[2, 10], DType::F32, 41), d);
    // Queued without error; the read reports it.
    let l = x.cross_entropy(&bad, Default::default()).unwrap();
    let err = l.item().unwrap_err().to_string();
    assert!(
        err.contains("cross_entropy") && err.contains("10 classes"),
        "{err}"
    );
    // Reported once: the device data is readable again.
    assert!(x.sum_all().unwrap().item().unwrap().is_finite());
}

/// A fault is told to the thread whose launch found it: another thread's read in between
/// succeeds and leaves it, the queuing thread's next read reports it, and the one after that
/// succeeds; faults of two threads between reads are both reported, each to its thread.
#[test]
fn a_fault_is_reported_to_the_thread_that_queued_it() {
    use std::sync::mpsc::channel;
    let Some(d) = gpu() else { return };
    let targets = |v: Vec<i64>| {
        Tensor::from_vec(v.clone(), &[v.len()], Device::Cpu)
            .unwrap()
            .to_device(d)
            .unwrap()
    };
    let x = own(&input(&[2, 10], DType::F32, 42), d);
    let (queued, wait_queued) = channel();
    let (read, wait_read) = channel();
    std::thread::scope(|s| {
        let x = &x;
        let targets = &targets;
        let other = s.spawn(move || {
            let l = x.cross_entropy(&targets(vec![3, 12]), Default::default())?;
            queued.send(()).unwrap();
            // An Err when the test's thread failed (and dropped the sender): stop too.
            wait_read.recv().expect("the test's thread failed first");
            let first = l.item();
            let second = x.sum_all()?.item();
            Ok::<_, Error>((first, second))
        });
        let read = read;
        wait_queued.recv().unwrap();
        // This thread's own bad launch, queued after the other thread's one.
        let mine = x
            .index_select(0, &targets(vec![1, 2]))
            .expect("found by the kernel, not here");
        let e = mine.to_vec_f64().unwrap_err().to_string();
        assert!(e.contains("index_select") && e.contains("size 2"), "{e}");
        assert!(
            x.sum_all().unwrap().item().is_ok(),
            "a read after the fault"
        );
        read.send(()).unwrap();
        let (first, second) = other.join().unwrap().unwrap();
        let e = first.unwrap_err().to_string();
        assert!(
            e.contains("cross_entropy") && e.contains("10 classes"),
            "{e}"
        );
        assert!(second.unwrap().is_finite(), "the other thread's next read");
    });
}

/// A training step of the MNIST CNN with autocast (f16), the GradScaler and Adam on the GPU
/// reads nothing back to the host once warmed up (cuDNN convolutions, pooling, dropout,
/// linear layers, the fused cross-entropy, the scaler's checks and the optimizer all stay on
/// the device), and its loss is finite.
/// Three warmed-up steps of the MNIST CNN under f16 autocast with the loss scaler and Adam,
/// its input in `format`: asserts they read nothing back to the host and returns the losses.
fn cnn_amp_steps(d: Device, format: MemoryFormat) -> Vec<f64> {
    use mantissa::nn::*;
    let mut gen = Generator::new(5);
    let mut model = Sequential::new()
        .push(Conv2d::new(1, 32, 3, Conv2dOptions::default(), true, &mut gen).unwrap())
        .push(Activation::Relu)
        .push(Conv2d::new(32, 64, 3, Conv2dOptions::default(), true, &mut gen).unwrap())
        .push(Activation::Relu)
        .push(MaxPool2d(MaxPool2dOptions::new(2)))
        .push(Dropout::new(0.25, 1))
        .push(Flatten)
        .push(Linear::new(9216, 128, true, &mut gen).unwrap())
        .push(Activation::Relu)
        .push(Dropout::new(0.5, 2))
        .push(Linear::new(128, 10, true, &mut gen).unwrap());
    model.to_device(d).unwrap();
    // The weights in the input's format too (channels-last parameters for the optimizer).
    model.to_memory_format(format).unwrap();
    model.train();
    let mut opt = optim::Adam::new(model.parameters(), optim::AdamConfig::adam(1e-3)).unwrap();
    let mut scaler = amp::GradScaler::new(amp::GradScalerConfig::default()).unwrap();
    let x = input(&[32, 1, 28, 28], DType::F32, 50)
        .to_device(d)
        .unwrap()
        .to_memory_format(format)
        .unwrap();
    let y: Vec<i64> = (0..32).map(|i| (i * 3) % 10).collect();
    let y = Tensor::from_vec(y, &[32], Device::Cpu)
        .unwrap()
        .to_device(d)
        .unwrap();
    let mut step = || {
        opt.zero_grad();
        let loss = amp::with_autocast(DType::F16, || {
            model.forward(&x)?.cross_entropy(&y, Default::default())
        })
        .unwrap()
        .unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        loss
    };
    // The first steps compile kernels and choose algorithms.
    let mut steps = vec![step(), step()];
    let before = host_reads();
    steps.extend((0..3).map(|_| step()));
    assert_eq!(
        host_reads(),
        before,
        "host reads in three AMP steps on {d} ({format:?})"
    );
    let losses: Vec<f64> = steps.iter().map(|l| l.item().unwrap()).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    losses
}

/// A small LSTM language model (embedding, 2-layer LSTM, linear head, cross-entropy) under
/// bf16 autocast with AdamW: after warm-up a step reads nothing back to the host (the
/// embedding's indices, its backward's additions, the LSTM's joins all stay on the device).
#[test]
fn an_lstm_amp_step_reads_nothing_back() {
    use mantissa::nn::*;
    let Some(d) = gpu() else { return };
    let mut gen = Generator::new(8);
    let mut emb = Embedding::new(100, 32, &mut gen).unwrap();
    let mut lstm = Lstm::new(32, 64, 2, true, &mut gen).unwrap();
    let mut head = Linear::new(64, 100, true, &mut gen).unwrap();
    emb.to_device(d).unwrap();
    lstm.to_device(d).unwrap();
    head.to_device(d).unwrap();
    let params = [emb.parameters(), lstm.parameters(), head.parameters()].concat();
    let mut opt = optim::Adam::new(params, optim::AdamConfig::adamw(1e-3)).unwrap();
    let ids = |shift: i64, shape: &[usize]| {
        let v: Vec<i64> = (0..96).map(|i| (i * 13 + shift) % 100).collect();
        Tensor::from_vec(v, shape, Device::Cpu)
            .unwrap()
            .to_device(d)
            .unwrap()
    };
    let (tokens, targets) = (ids(0, &[8, 12]), ids(13, &[96]));
    let mut step = || {
        opt.zero_grad();
        let loss = amp::with_autocast(DType::BF16, || {
            let h = lstm.forward(&emb.forward(&tokens)?)?;
            head.forward(&h.reshape(&[96, 64])?)?
                .cross_entropy(&targets, Default::default())
        })
        .unwrap()
        .unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        loss
    };
    let mut losses = vec![step(), step()];
    let before = host_reads();
    losses.extend((0..3).map(|_| step()));
    assert_eq!(
        host_reads(),
        before,
        "host reads in three LSTM steps on {d}"
    );
    let losses: Vec<f64> = losses.iter().map(|l| l.item().unwrap()).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[4] < losses[0], "the loss goes down: {losses:?}");
}

#[test]
fn a_cnn_amp_step_reads_nothing_back() {
    let Some(d) = gpu() else { return };
    cnn_amp_steps(d, MemoryFormat::Contiguous);
}

/// The same network with channels-last input and weights runs cuDNN's NHWC kernels: it reads
/// nothing back either, and its losses follow the NCHW run's (same weights, data and dropout masks;
/// only the f16 convolution algorithms differ).
#[test]
fn a_channels_last_cnn_trains_like_the_nchw_one() {
    let Some(d) = gpu() else { return };
    let want = cnn_amp_steps(d, MemoryFormat::Contiguous);
    let got = cnn_amp_steps(d, MemoryFormat::ChannelsLast);
    assert_close(&got, &want, 1e-2, "losses of five AMP steps, NHWC vs NCHW");
}

/// Convolutions on channels-last input: NHWC output, values and gradients as on the CPU, for
/// grouped / strided / dilated shapes and tensor-core-friendly ones, and conv_transpose2d.
#[test]
fn channels_last_convolutions_match() {
    let Some(d) = gpu() else { return };
    const CL: MemoryFormat = MemoryFormat::ChannelsLast;
    let odd = Conv2dOptions {
        stride: [2, 1],
        padding: [1, 2],
        dilation: [1, 2],
        groups: 2,
    };
    let pad = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    for dt in FLOATS {
        let x = input(&[3, 8, 9, 11], dt, 24);
        let w = input(&[8, 4, 3, 3], dt, 25);
        let b = input(&[8], dt, 26);
        parity("conv2d channels-last grouped", d, &[x, w.clone(), b], |x| {
            let y = x[0].to_memory_format(CL)?.conv2d(&x[1], Some(&x[2]), odd)?;
            assert!(y.is_channels_last(), "conv2d strides {:?}", y.strides());
            Ok(y)
        });
        let x = input(&[4, 16, 12, 12], dt, 27);
        let w2 = input(&[32, 16, 3, 3], dt, 28);
        parity("conv2d channels-last 16 -> 32", d, &[x, w2], |x| {
            let y = x[0].to_memory_format(CL)?.conv2d(&x[1], None, pad)?;
            assert!(y.is_channels_last(), "conv2d strides {:?}", y.strides());
            y.relu()
        });
        let z = input(&[3, 8, 5, 7], dt, 29);
        let t = ConvTranspose2dOptions {
            stride: [2, 1],
            padding: [1, 2],
            dilation: [1, 2],
            groups: 2,
            output_padding: [1, 0],
        };
        parity("conv_transpose2d channels-last", d, &[z, w], |x| {
            let y = x[0]
                .to_memory_format(CL)?
                .conv_transpose2d(&x[1], None, t)?;
            assert!(
                y.is_channels_last(),
                "conv_transpose2d strides {:?}",
                y.strides()
            );
            Ok(y)
        });
    }
}

/// Batch norm in training counts its batches on the device: no read back per step, the
/// counter reads 3 after three steps, and the running statistics are the CPU's.
#[test]
fn batch_norm_counts_batches_on_the_device() {
    use mantissa::nn::*;
    let Some(d) = gpu() else { return };
    let mut bn = BatchNorm2d::new(3).unwrap();
    bn.to_device(d).unwrap();
    let x = input(&[4, 3, 5, 5], DType::F32, 60).to_device(d).unwrap();
    bn.forward(&x).unwrap();
    let before = host_reads();
    for _ in 0..2 {
        bn.forward(&x).unwrap();
    }
    assert_eq!(
        host_reads(),
        before,
        "host reads in batch norm steps on {d}"
    );
    let counter = bn.named_buffers()[2].1.clone();
    assert_eq!(counter.device(), d);
    assert_eq!(counter.to_vec::<i64>().unwrap(), vec![3]);
    let cpu = BatchNorm2d::new(3).unwrap();
    let xc = x.to_device(Device::Cpu).unwrap();
    for _ in 0..3 {
        cpu.forward(&xc).unwrap();
    }
    for (name, got, want) in [
        ("running_mean", &bn.running_mean, &cpu.running_mean),
        ("running_var", &bn.running_var, &cpu.running_var),
    ] {
        let (g, w) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        let err = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f32>()
            .sqrt();
        let norm = w.iter().map(|b| b * b).sum::<f32>().sqrt();
        assert!(
            err <= 1e-5 * norm,
            "{name} on {d}: {g:?} vs the CPU's {w:?}"
        );
    }
}
