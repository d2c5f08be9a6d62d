//! The public API on random, often wrong, input: every call returns `Ok` or `Err`, never
//! panics, and so does the backward pass of what it returned. Shapes include zero-size dims,
//! operands are views (transposed, narrowed, broadcast) as often as not, dtypes are all six,
//! and the integer arguments (dims, sizes, kernel shapes) range past the valid ones. On a
//! CUDA device the cases it shares with the CPU must give Ok and Err alike (f64 aside).

use mantissa::*;
use std::cell::Cell;
use std::panic::catch_unwind;

thread_local! {
    /// The device the cases make their tensors and layers on.
    static DEVICE: Cell<Device> = const { Cell::new(Device::Cpu) };
}

fn dev() -> Device {
    DEVICE.with(Cell::get)
}

/// A small deterministic generator (splitmix64), so a failure names the case to rerun.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    /// A dim argument, sometimes out of range or negative.
    fn dim(&mut self) -> isize {
        self.below(9) as isize - 4
    }
    /// A dim of a tensor of `rank`, mostly valid.
    fn dim_of(&mut self, rank: usize) -> isize {
        if rank > 0 && self.chance(80) {
            self.below(2 * rank) as isize - rank as isize
        } else {
            self.dim()
        }
    }
    /// A size argument: mostly small, sometimes zero.
    fn size(&mut self) -> usize {
        self.below(5)
    }
    /// A count that should be positive: 1 to 3, sometimes zero.
    fn pos(&mut self) -> usize {
        if self.chance(8) {
            0
        } else {
            1 + self.below(3)
        }
    }
    fn shape(&mut self) -> Vec<usize> {
        let rank = self.below(5);
        self.shape_of(rank)
    }
    fn shape_of(&mut self, rank: usize) -> Vec<usize> {
        // Now and then one long dim, past the sizes where the CPU kernels split work
        // across threads.
        let long = if self.chance(5) {
            self.below(rank.max(1))
        } else {
            usize::MAX
        };
        (0..rank)
            .map(|d| match d {
                _ if d == long => 1000 + self.below(3000),
                _ if self.chance(8) => 0,
                _ => 1 + self.below(4),
            })
            .collect()
    }
    fn dtype(&mut self) -> DType {
        match self.below(10) {
            0..=3 => DType::F32,
            4 => DType::F16,
            5 => DType::BF16,
            6 => DType::F64,
            7 | 8 => DType::I64,
            _ => DType::U8,
        }
    }
}

/// A tensor of `shape` and `dtype`, often a non-contiguous view; integer tensors hold small
/// values (valid indices for small dims, and some out of range or negative).
fn tensor(r: &mut Rng, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let view = r.below(4);
    let mut base: Vec<usize> = shape.to_vec();
    if view == 1 && base.len() >= 2 {
        let n = base.len();
        base.swap(n - 1, n - 2);
    }
    if view == 2 && !base.is_empty() {
        base[0] += 2;
    }
    let n: usize = base.iter().product();
    let t = if dtype.is_float() {
        Tensor::randn(&base, DType::F32, dev())?.to_dtype(dtype)?
    } else if dtype == DType::U8 {
        let v: Vec<u8> = (0..n).map(|_| r.below(2) as u8).collect();
        Tensor::from_vec(v, &base, dev())?
    } else {
        let v: Vec<i64> = (0..n).map(|_| r.below(6) as i64 - 1).collect();
        Tensor::from_vec(v, &base, dev())?
    };
    let t = match view {
        1 if shape.len() >= 2 => t.transpose(-1, -2)?,
        2 if !shape.is_empty() => t.narrow(0, 1, shape[0])?,
        3 if !shape.is_empty() && shape[0] > 1 => {
            let mut one = shape.to_vec();
            one[0] = 1;
            t.narrow(0, 0, 1)?.reshape(&one)?.expand(shape)?
        }
        _ => t,
    };
    if dtype.is_float() && r.chance(50) {
        // A view of a leaf that requires grad stays in the graph, so backward reaches it.
        return t.detach().requires_grad(true);
    }
    Ok(t)
}

fn any(r: &mut Rng) -> Result<Tensor> {
    let (s, d) = (r.shape(), r.dtype());
    tensor(r, &s, d)
}

/// Mostly a float tensor of `rank` (what image and sequence ops take), sometimes any.
fn ranked(r: &mut Rng, rank: usize) -> Result<Tensor> {
    if r.chance(20) {
        return any(r);
    }
    let s = r.shape_of(rank);
    let d = [DType::F32, DType::F32, DType::F16, DType::BF16, DType::F64][r.below(5)];
    tensor(r, &s, d)
}

/// A second operand: the first's shape, a broadcastable or a random one.
fn partner(r: &mut Rng, a: &Tensor) -> Result<Tensor> {
    let shape = match r.below(3) {
        0 => a.shape().to_vec(),
        1 => a
            .shape()
            .iter()
            .map(|&n| if r.chance(50) { 1 } else { n })
            .collect(),
        _ => r.shape(),
    };
    let dtype = if r.chance(70) { a.dtype() } else { r.dtype() };
    tensor(r, &shape, dtype)
}

fn index(r: &mut Rng, shape: &[usize]) -> Result<Tensor> {
    let dtype = if r.chance(85) { DType::I64 } else { r.dtype() };
    tensor(r, shape, dtype)
}

fn opt_pair(r: &mut Rng) -> [usize; 2] {
    [r.below(3), r.below(3)]
}

/// Runs op number `op` on random operands. The returned tensors are checked further.
fn call(r: &mut Rng, op: usize) -> Result<Vec<Tensor>> {
    let a = match op {
        15..=17 => ranked(r, 4)?,
        10 => ranked(r, 2)?,
        13 | 20 | 21 => {
            let rank = 2 + r.below(2);
            ranked(r, rank)?
        }
        _ => any(r)?,
    };
    let one = |t: Result<Tensor>| t.map(|t| vec![t]);
    match op {
        0 => {
            let b = partner(r, &a)?;
            one(match r.below(8) {
                0 => a.add(&b),
                1 => a.sub(&b),
                2 => a.mul(&b),
                3 => a.div(&b),
                4 => a.pow(&b),
                5 => a.maximum(&b),
                6 => a.minimum(&b),
                _ => a.lt(&b),
            })
        }
        1 => one(match r.below(12) {
            0 => a.exp(),
            1 => a.log(),
            2 => a.sqrt(),
            3 => a.relu(),
            4 => a.gelu(),
            5 => a.sigmoid(),
            6 => a.tanh(),
            7 => a.abs(),
            8 => a.clamp(-0.5, 0.5),
            9 => a.leaky_relu(0.1),
            10 => a.scalar_pow(3.0),
            _ => a.add(1.5),
        }),
        2 => {
            let dims: Vec<isize> = (0..r.below(3)).map(|_| r.dim()).collect();
            let keep = r.chance(50);
            one(match r.below(4) {
                0 => a.sum(&dims, keep),
                1 => a.mean(&dims, keep),
                2 => a.var(&dims, r.below(2), keep),
                _ => a.std(&dims, r.below(2), keep),
            })
        }
        3 => {
            let (d, keep) = (r.dim(), r.chance(50));
            match r.below(3) {
                0 => a.max(d, keep).map(|(v, i)| vec![v, i]),
                1 => a.min(d, keep).map(|(v, i)| vec![v, i]),
                _ => one(a.argmax(d, keep)),
            }
        }
        4 => one(match r.below(3) {
            0 => a.max_all(),
            1 => a.sum_all(),
            _ => a.mean_all(),
        }),
        5 => {
            let b = partner(r, &a)?;
            let rhs = if r.chance(50) && a.rank() >= 1 {
                let k = a.shape()[a.rank() - 1];
                let (dt, n) = (a.dtype(), r.size());
                tensor(r, &[k, n], dt)?
            } else {
                b
            };
            one(a.matmul(&rhs))
        }
        6 => {
            let (i, o) = (a.shape().last().copied().unwrap_or(1), r.size());
            let dt = if r.chance(80) { a.dtype() } else { r.dtype() };
            let w = tensor(r, &[o, i], dt)?;
            let b = if r.chance(50) {
                let n = if r.chance(80) { o } else { r.size() };
                Some(tensor(r, &[n], dt)?)
            } else {
                None
            };
            one(match &b {
                Some(b) if r.chance(50) => a.linear_relu(&w, b),
                _ => a.linear(&w, b.as_ref()),
            })
        }
        7 => {
            let b = partner(r, &a)?;
            let d = r.dim();
            one(if r.chance(50) {
                Tensor::cat(&[&a, &b], d)
            } else {
                Tensor::stack(&[&a, &b], d)
            })
        }
        8 => {
            let d = r.dim();
            let len = r.size();
            let idx = index(r, &[len])?;
            one(a.index_select(d, &idx))
        }
        9 => {
            let d = r.dim_of(a.rank());
            let shape = if r.chance(70) {
                a.shape().to_vec()
            } else {
                r.shape()
            };
            let idx = index(r, &shape)?;
            if r.chance(50) {
                one(a.gather(d, &idx))
            } else {
                let dt = if r.chance(80) { a.dtype() } else { r.dtype() };
                let src = tensor(r, &shape, dt)?;
                one(a.scatter_add(d, &idx, &src))
            }
        }
        10 => {
            let s = r.shape();
            let idx = index(r, &s)?;
            one(Tensor::embedding(&idx, &a))
        }
        11 => {
            let m = partner(r, &a)?;
            let m = if r.chance(70) {
                m.gt(0.0).unwrap_or(m)
            } else {
                m
            };
            if r.chance(50) {
                one(a.masked_fill(&m, 2.0))
            } else {
                let b = partner(r, &a)?;
                one(Tensor::where_cond(&m, &a, &b))
            }
        }
        12 => {
            let d = r.dim();
            one(if r.chance(50) {
                a.softmax(d)
            } else {
                a.log_softmax(d)
            })
        }
        13 => {
            let mut ts = a.shape().to_vec();
            if !ts.is_empty() {
                ts.remove(usize::from(ts.len() >= 2));
            }
            let ts = if r.chance(80) { ts } else { r.shape() };
            let t = index(r, &ts)?;
            let reduction = [Reduction::Mean, Reduction::Sum, Reduction::None][r.below(3)];
            one(if r.chance(60) {
                let opts = CrossEntropyOptions {
                    reduction,
                    ignore_index: if r.chance(30) { 1 } else { -100 },
                    label_smoothing: [0.0, 0.0, 0.1, 1.5, -0.1][r.below(5)],
                };
                a.cross_entropy(&t, opts)
            } else {
                a.nll_loss(&t, reduction, -100)
            })
        }
        14 => {
            let b = partner(r, &a)?;
            let reduction = [Reduction::Mean, Reduction::Sum, Reduction::None][r.below(3)];
            one(if r.chance(50) {
                a.mse_loss(&b, reduction)
            } else {
                a.bce_with_logits(&b, reduction)
            })
        }
        15 => {
            let x_c = a.shape().get(1).copied().unwrap_or(1);
            let x_c = if r.chance(85) { x_c } else { r.size() };
            let groups = [1, 1, 1, 2, 0][r.below(5)];
            let (cout, k) = (r.pos(), r.pos());
            let wd = if r.chance(85) { a.dtype() } else { r.dtype() };
            let transposed = r.chance(40);
            let w = if transposed {
                tensor(r, &[x_c, cout, k, k], wd)?
            } else {
                tensor(r, &[cout * groups.max(1), x_c / groups.max(1), k, k], wd)?
            };
            let outs = if transposed {
                cout * groups.max(1)
            } else {
                w.shape()[0]
            };
            let bias = if r.chance(50) {
                let n = if r.chance(85) { outs } else { r.size() };
                Some(tensor(r, &[n], wd)?)
            } else {
                None
            };
            let (stride, padding, dilation) = ([r.pos(), r.pos()], opt_pair(r), [r.pos(), r.pos()]);
            if transposed {
                let o = ConvTranspose2dOptions {
                    stride,
                    padding,
                    output_padding: [r.below(2), r.below(2)],
                    dilation,
                    groups,
                };
                one(a.conv_transpose2d(&w, bias.as_ref(), o))
            } else {
                let o = Conv2dOptions {
                    stride,
                    padding,
                    dilation,
                    groups,
                };
                one(a.conv2d(&w, bias.as_ref(), o))
            }
        }
        16 => {
            let a = if r.chance(50) {
                a.to_memory_format(MemoryFormat::ChannelsLast).unwrap_or(a)
            } else {
                a
            };
            let stride = if r.chance(50) {
                Some([r.pos(), r.pos()])
            } else {
                None
            };
            one(match r.below(3) {
                0 => a.max_pool2d(MaxPool2dOptions {
                    kernel: [r.pos(), r.pos()],
                    stride,
                    padding: opt_pair(r),
                    dilation: [r.pos(), r.pos()],
                    ceil_mode: r.chance(50),
                }),
                1 => a.avg_pool2d(AvgPool2dOptions {
                    kernel: [r.pos(), r.pos()],
                    stride,
                    padding: opt_pair(r),
                    ceil_mode: r.chance(50),
                    count_include_pad: r.chance(50),
                }),
                _ => a.adaptive_avg_pool2d([r.pos(), r.pos()]),
            })
        }
        17 => {
            let c = a.shape().get(1).copied().unwrap_or(1);
            let c = if r.chance(80) { c } else { r.size() };
            let dt = if r.chance(80) { a.dtype() } else { r.dtype() };
            let stat = |r: &mut Rng| -> Result<Option<Tensor>> {
                Ok(if r.chance(60) {
                    Some(tensor(r, &[c], dt)?.detach())
                } else {
                    None
                })
            };
            let (rm, rv, w, b) = (stat(r)?, stat(r)?, stat(r)?, stat(r)?);
            let rv = rv.map(|v| v.abs().unwrap_or(v));
            one(a.batch_norm(
                rm.as_ref(),
                rv.as_ref(),
                w.as_ref(),
                b.as_ref(),
                r.chance(60),
                0.1,
                1e-5,
            ))
        }
        18 => {
            let k = r.below(3);
            let ns: Vec<usize> = if r.chance(70) && a.rank() >= k {
                a.shape()[a.rank() - k..].to_vec()
            } else {
                (0..k).map(|_| r.size()).collect()
            };
            let dt = if r.chance(80) { a.dtype() } else { r.dtype() };
            let w = if r.chance(50) {
                Some(tensor(r, &ns, dt)?)
            } else {
                None
            };
            let b = if r.chance(50) {
                Some(tensor(r, &ns, dt)?)
            } else {
                None
            };
            one(a.layer_norm(&ns, w.as_ref(), b.as_ref(), 1e-5))
        }
        19 => one(a.dropout([0.0, 0.3, 1.0, 1.5, -0.2][r.below(5)], r.chance(80))),
        20 => {
            let (b, h) = (r.size(), r.size());
            let dt = if r.chance(80) { a.dtype() } else { r.dtype() };
            let gshape = if r.chance(70) {
                vec![b, 4 * h]
            } else {
                r.shape()
            };
            let g = tensor(r, &gshape, dt)?;
            let cshape = if r.chance(70) { vec![b, h] } else { r.shape() };
            let c = tensor(r, &cshape, dt)?;
            Tensor::lstm_cell(&g, &c).map(|(h, c)| vec![h, c])
        }
        21 => {
            let (t, b, i, h) = (1 + r.size(), r.size(), r.size(), r.size());
            let dt = if r.chance(85) { a.dtype() } else { r.dtype() };
            let mk = |r: &mut Rng, s: Vec<usize>| -> Result<Tensor> {
                let s = if r.chance(90) { s } else { r.shape() };
                tensor(r, &s, dt)
            };
            let x = mk(r, vec![t, b, i])?;
            let h0 = mk(r, vec![b, h])?;
            let c0 = mk(r, vec![b, h])?;
            let wih = mk(r, vec![4 * h, i])?;
            let whh = mk(r, vec![4 * h, h])?;
            let bias = mk(r, vec![4 * h])?;
            Tensor::lstm_layer(&x, &h0, &c0, &wih, &whh, &bias).map(|(y, h, c)| vec![y, h, c])
        }
        22 => {
            let shape = r.shape();
            one(match r.below(9) {
                0 => a.reshape(&shape),
                1 => a.permute(&(0..a.rank()).rev().collect::<Vec<_>>()),
                2 => a.transpose(r.dim(), r.dim()),
                3 => a.narrow(r.dim(), r.size(), r.size()),
                4 => a.expand(&shape),
                5 => a.unsqueeze(r.dim()),
                6 => a.squeeze(r.dim()),
                7 => a.flatten(r.dim(), r.dim()),
                _ => a.sum_to(&shape),
            })
        }
        23 => a.split(r.size(), r.dim()),
        24 => {
            let b = partner(r, &a)?;
            if r.chance(50) {
                let dst = b.detach();
                dst.copy_(&a).map(|_| vec![dst])
            } else {
                one(a.to_dtype(b.dtype())?.add(&b))
            }
        }
        25 => optimize(r).map(|_| vec![]),
        26 => modules(r),
        28 => huge(r, &a),
        _ => {
            let shape = r.shape();
            let dt = r.dtype();
            one(match r.below(4) {
                0 => Tensor::zeros(&shape, dt, dev()),
                1 => Tensor::full(&shape, 3.0, dt, dev()),
                2 => Tensor::arange(
                    r.size() as f64,
                    r.size() as f64,
                    [1.0, -1.0, 0.0, 0.5][r.below(4)],
                    dt,
                    dev(),
                ),
                _ => Tensor::randn(&shape, dt, dev()),
            })
        }
    }
}

const OPS: usize = 29;

/// A size argument at the edges of the integer types: near `usize::MAX`, near `isize::MAX`,
/// past 2^31 and 2^32, zero, or small.
fn huge_size(r: &mut Rng) -> usize {
    match r.below(10) {
        0 => usize::MAX - r.below(3),
        1 => (isize::MAX as usize) - r.below(2) + r.below(3),
        2 => (1usize << 31) + r.below(3) - 1,
        3 => (1usize << 32) + r.below(3) - 1,
        4 => (1usize << 62) + r.below(2),
        5 => (1usize << 40) + r.below(2),
        6 => 0,
        _ => r.size(),
    }
}

/// Whether a call that may allocate `dims`' product of elements is safe to make here: small
/// (at most 2^16), or so large that no allocation can succeed (past 2^47 elements, beyond any
/// 64-bit address space even as bytes) or overflowing. Sizes in between would be real, huge
/// allocations, so the case skips them.
fn allocates_safely(dims: &[usize]) -> bool {
    match dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) {
        None => true,
        Some(p) => p <= 1 << 16 || p >= 1 << 47,
    }
}

/// A view of at most two elements per dim at the far end of `t`: what a case reads back of a
/// big (expanded) result, so that the last offsets are touched without reading them all.
fn far_corner(t: Tensor) -> Result<Tensor> {
    let mut v = t;
    for d in 0..v.rank() {
        let size = v.shape()[d];
        let len = size.min(2);
        v = v.narrow(d as isize, size - len, len)?;
    }
    Ok(v)
}

/// Shapes, views and products whose sizes overflow or come close: every call must be an
/// `Err` or a tensor whose every element can be read. Big extents come from stride-0
/// (expanded) views, and calls that would really allocate a big tensor are skipped
/// ([`allocates_safely`]), so no case allocates more than 2^16 elements.
fn huge(r: &mut Rng, a: &Tensor) -> Result<Vec<Tensor>> {
    let shape: Vec<usize> = (0..1 + r.below(3)).map(|_| huge_size(r)).collect();
    let dt = r.dtype();
    let ones = |dims: &[usize]| -> Result<Tensor> {
        Tensor::ones(&vec![1; dims.len()], DType::F32, dev())?.expand(dims)
    };
    let out = match r.below(12) {
        0 if allocates_safely(&shape) => Tensor::zeros(&shape, dt, dev()),
        1 => a.reshape(&shape),
        2 => Tensor::from_vec(vec![1.5f32; a.numel()], &shape, dev()),
        3 => a.narrow(r.dim(), huge_size(r), huge_size(r)),
        4 => a.expand(&shape),
        5 => {
            // A narrow far into an expanded view: indices past 2^31 and 2^32.
            let w = ones(&[[1usize << 31, (1 << 32) + 1, 3][r.below(3)]])?;
            let (size, start) = (w.shape()[0], huge_size(r));
            w.narrow(0, start.min(size), 2.min(size - start.min(size)))
        }
        6 => {
            // Products of expanded operands whose output is too large to exist or to be
            // held (the others would be real work, and are skipped).
            let (m, k, n) = (huge_size(r), r.size(), huge_size(r));
            let out = m.checked_mul(n);
            let small = out
                .and_then(|o| o.checked_mul(k))
                .is_some_and(|w| w <= 1 << 16);
            if !small && out.is_some_and(|o| o < 1 << 47) {
                return Ok(vec![]);
            }
            ones(&[m, k])?.matmul(&ones(&[k, n])?)
        }
        7 => {
            // Binary ops whose broadcast shape overflows.
            let (m, n) = (huge_size(r), huge_size(r));
            if !allocates_safely(&[m, n]) {
                return Ok(vec![]);
            }
            ones(&[m, 1])?.add(&ones(&[1, n])?)
        }
        8 => a.reshape_infer(&shape.iter().map(|&d| d as isize).collect::<Vec<_>>()),
        9 => {
            // Two expanded halves whose concatenation passes isize::MAX elements.
            let half = [(isize::MAX as usize) / 2 + 1, 1 << 62, 1 << 61][r.below(3)];
            let w = ones(&[half])?;
            Tensor::cat(&[&w, &w], 0)
        }
        10 => {
            let n = huge_size(r);
            if !allocates_safely(&[n]) {
                return Ok(vec![]);
            }
            Tensor::arange(0.0, n as f64, 1.0, dt, dev())
        }
        11 if allocates_safely(&shape) => Tensor::full(&shape, 1.0, dt, dev()),
        _ => return Ok(vec![]),
    };
    // Detached: the backward of a corner of a huge view would be a gradient of the whole
    // view, a real allocation of that size (as in PyTorch).
    Ok(vec![far_corner(out?.detach())?])
}

/// Optimizers, clipping and the loss scaler on random parameters and gradients (shapes and
/// dtypes that may not match), random hyperparameters, with or without master weights.
fn optimize(r: &mut Rng) -> Result<()> {
    use mantissa::amp::{GradScaler, GradScalerConfig};
    use mantissa::optim::*;
    let mut params = vec![];
    for _ in 0..1 + r.below(3) {
        let p = any(r)?;
        let p = if r.chance(80) { p.detach() } else { p };
        let p = p.clone().requires_grad(r.chance(90)).unwrap_or(p);
        if r.chance(80) {
            let g = if r.chance(80) {
                let (s, d) = (p.shape().to_vec(), p.dtype());
                tensor(r, &s, d)?.detach()
            } else {
                any(r)?.detach()
            };
            let _ = p.set_grad(Some(g));
        }
        params.push(p);
    }
    let lr = [0.1, 0.1, 0.1, 0.0, -1.0, f64::NAN, 1e30][r.below(7)];
    let mut opt: Box<dyn Optimizer> = match r.below(4) {
        0 => {
            let mut c = SgdConfig::new(lr);
            c.momentum = [0.0, 0.9, 1.5][r.below(3)];
            c.nesterov = r.chance(30);
            Box::new(Sgd::new(params.clone(), c)?)
        }
        1 => {
            let mut c = if r.chance(50) {
                AdamConfig::adam(lr)
            } else {
                AdamConfig::adamw(lr)
            };
            c.beta2 = [0.999, 0.999, 1.0, -0.5][r.below(4)];
            Box::new(Adam::new(params.clone(), c)?)
        }
        2 => Box::new(Sgld::new(
            params.clone(),
            SgdConfig::new(lr),
            [1.0, 1.0, 0.0, -1.0][r.below(4)],
            7,
        )?),
        _ => Box::new(Adadelta::new(params.clone(), lr)?),
    };
    if r.chance(40) {
        let rounding = if r.chance(50) {
            Rounding::Nearest
        } else {
            Rounding::Stochastic { seed: 3 }
        };
        opt.use_master_weights(rounding)?;
    }
    if r.chance(30) {
        clip_grad_norm(&params, [1.0, 0.0, f64::INFINITY][r.below(3)])?;
    }
    if r.chance(50) {
        let cfg = GradScalerConfig {
            init_scale: [65536.0, 65536.0, 0.0, f64::INFINITY][r.below(4)],
            growth_interval: r.below(3),
            ..Default::default()
        };
        let mut scaler = GradScaler::new(cfg)?;
        if r.chance(50) {
            scaler.unscale_(opt.as_mut())?;
        }
        scaler.step(opt.as_mut())?;
        scaler.update()?;
    } else {
        opt.step()?;
    }
    let state = opt.state_tensors()?;
    if r.chance(50) && !state.is_empty() {
        // Reload a state with one entry swapped for a random tensor.
        let mut named: std::collections::BTreeMap<String, Tensor> = state.into_iter().collect();
        let key = named
            .keys()
            .nth(r.below(named.len()))
            .cloned()
            .unwrap_or_default();
        named.insert(key, any(r)?);
        opt.load_state_tensors(&named)?;
        opt.step()?;
    }
    for p in &params {
        let _ = p.to_vec_f64()?;
    }
    Ok(())
}

/// A random layer (sizes sometimes zero), made to train or evaluate, perhaps converted to
/// another dtype or memory format, run on a random input; then saved and loaded into a
/// second random layer (which must fail cleanly when the two do not match).
fn modules(r: &mut Rng) -> Result<Vec<Tensor>> {
    use mantissa::nn::*;
    /// The layer and an input shape that fits it (I64 indices for the embedding).
    fn layer(r: &mut Rng) -> Result<(Box<dyn Module>, Vec<usize>, DType)> {
        let mut g = Generator::new(r.next());
        let (a, b, n) = (r.pos(), r.pos(), r.pos());
        let f = DType::F32;
        Ok(match r.below(7) {
            0 => (
                Box::new(Linear::new(a, b, r.chance(50), &mut g)?),
                vec![n, a],
                f,
            ),
            1 => {
                let groups = [1, 1, 2, 0][r.below(4)];
                let o = Conv2dOptions {
                    stride: [r.pos(), r.pos()],
                    padding: [r.below(2), r.below(2)],
                    dilation: [1, 1],
                    groups,
                };
                let conv = Conv2d::new(a, b, r.pos(), o, r.chance(50), &mut g)?;
                (
                    Box::new(conv),
                    vec![n, a, 1 + r.below(5), 1 + r.below(5)],
                    f,
                )
            }
            2 => (Box::new(BatchNorm2d::new(a)?), vec![n, a, b, 2], f),
            3 => (Box::new(LayerNorm::new(&[a])?), vec![n, b, a], f),
            4 => (
                Box::new(Embedding::new(a, b, &mut g)?),
                vec![n, 2],
                DType::I64,
            ),
            5 => {
                let lstm = Lstm::new(a, b, r.pos(), r.chance(50), &mut g)?;
                (Box::new(lstm), vec![n, 2, a], f)
            }
            _ => {
                let seq = Sequential::new()
                    .push(Linear::new(a, b, true, &mut g)?)
                    .push(Activation::Relu)
                    .push(Dropout::new([0.5, 1.5][r.below(4) / 3], 1));
                (Box::new(seq), vec![n, a], f)
            }
        })
    }
    let same = r.clone();
    let (mut m, shape, dtype) = layer(r)?;
    m.to_device(dev())?;
    if r.chance(30) {
        m.eval();
    }
    let mut dtype = dtype;
    if r.chance(30) {
        let to = [DType::F16, DType::BF16, DType::F64, DType::I64][r.below(4)];
        m.to_dtype(to)?;
        if dtype.is_float() {
            dtype = to;
        }
    }
    if r.chance(20) {
        m.to_memory_format(MemoryFormat::ChannelsLast)?;
    }
    let x = if r.chance(80) {
        tensor(r, &shape, dtype)?
    } else {
        any(r)?
    };
    let y = m.forward(&x)?;
    let path = std::env::temp_dir().join(format!("mantissa-fuzz-{}.safetensors", r.next()));
    checkpoint::save(&path, m.as_ref(), None, &[])?;
    // Load into the same layer made afresh (it matches unless the dtype changed), or into
    // another random one.
    let mut other = if r.chance(60) {
        layer(&mut same.clone())?.0
    } else {
        layer(r)?.0
    };
    other.to_device(dev())?;
    let loaded = checkpoint::load(&path, other.as_mut(), None);
    let _ = std::fs::remove_file(&path);
    loaded?;
    Ok(vec![y])
}

/// Reads every output back and, where they are in a graph, runs backward from the sum of
/// their sums.
fn consume(outs: Vec<Tensor>) -> Result<()> {
    let mut total: Option<Tensor> = None;
    for t in &outs {
        let _ = t.to_vec_f64()?;
        if t.is_requires_grad() && t.dtype().is_float() {
            let s = t.sum_all()?.to_dtype(DType::F32)?;
            total = Some(match total {
                Some(acc) => acc.add(&s)?,
                None => s,
            });
        }
    }
    match total {
        Some(t) => t.backward(),
        None => Ok(()),
    }
}

/// What one case gave: `Ok`, an error (its text, and whether it depends on the device), or a
/// panic's message.
enum Outcome {
    Ok,
    /// `device_bound`: CUDA's missing f64, or out of memory (each device has its own memory,
    /// and the host refuses an op on a view it could not hold where a device op may not
    /// need it).
    Err {
        msg: String,
        device_bound: bool,
    },
    Panic(String),
}

/// Case number `case` on the current device: op `case % OPS` on operands drawn from the
/// case's seed; one case in five runs under autocast (the cast policy applied to every op).
fn run_case(case: u64) -> Result<()> {
    let mut r = Rng(case.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let low = [None, Some(DType::F16), Some(DType::BF16)]
        [usize::from(case.is_multiple_of(5)) * (1 + (case as usize / 5) % 2)];
    let _region = low.map(amp::autocast).transpose()?;
    call(&mut r, case as usize % OPS).and_then(consume)
}

/// A case that takes longer than this is printed with its number and op, to be replayed with
/// `MANTISSA_FUZZ_CASE`: no case should come near it, since each allocation is bounded (see
/// `HOST_LIMIT`).
const SLOW: std::time::Duration = std::time::Duration::from_secs(2);

/// The most bytes one host allocation may take in a case: random shapes that broadcast
/// against each other (two long dims, say) make outputs of gigabytes, which a host that
/// overcommits grants and the kernel then fills for minutes. Past this they are refused at
/// once with `OutOfMemory`, which counts as a device-bound error.
const HOST_LIMIT: usize = 256 << 20;

/// Runs `cases` cases on the current device, in order; the cases slower than [`SLOW`] are
/// listed in `slow` with their time.
fn run_cases(cases: u64, slow: &mut Vec<String>) -> Vec<Outcome> {
    (0..cases)
        .map(|case| {
            let start = std::time::Instant::now();
            let outcome = run_one(case);
            let took = start.elapsed();
            if took > SLOW {
                slow.push(format!(
                    "case {case} (op {}): {took:.2?}",
                    case as usize % OPS
                ));
            }
            outcome
        })
        .collect()
}

/// One case's outcome, a panic caught.
fn run_one(case: u64) -> Outcome {
    match catch_unwind(|| run_case(case)) {
        Ok(Ok(())) => Outcome::Ok,
        Ok(Err(e)) => Outcome::Err {
            device_bound: matches!(e, Error::OutOfMemory { .. })
                || matches!(
                    e,
                    Error::DType {
                        dtype: DType::F64,
                        ..
                    }
                ) && e.to_string().contains("no f64 on CUDA"),
            msg: e.to_string(),
        },
        Err(p) => Outcome::Panic(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
    }
}

/// Ok and Err per op.
fn tally(outcomes: &[Outcome]) -> [[usize; 2]; OPS] {
    let mut per_op = [[0usize; 2]; OPS];
    for (case, o) in outcomes.iter().enumerate() {
        match o {
            Outcome::Ok => per_op[case % OPS][0] += 1,
            Outcome::Err { .. } => per_op[case % OPS][1] += 1,
            Outcome::Panic(_) => {}
        }
    }
    per_op
}

/// The cases a device accepts that the CPU rejects, or the other way round (CUDA's missing
/// f64 and out-of-memory errors aside): the same call must mean the same on every device.
fn disagreements(cpu: &[Outcome], other: &[Outcome]) -> Vec<String> {
    let mut found = Vec::new();
    for (case, (c, o)) in cpu.iter().zip(other).enumerate() {
        let differ = match (c, o) {
            (Outcome::Ok, Outcome::Err { msg, device_bound }) => {
                (!device_bound).then(|| format!("Ok on the CPU, Err on the device: {msg}"))
            }
            (Outcome::Err { msg, device_bound }, Outcome::Ok) => {
                (!device_bound).then(|| format!("Ok on the device, Err on the CPU: {msg}"))
            }
            _ => None,
        };
        if let Some(d) = differ {
            found.push(format!("case {case} (op {}): {d}", case % OPS));
        }
    }
    found
}

/// On the CPU, then on the first CUDA device when there is one (fewer cases). Replay one
/// case with `MANTISSA_FUZZ_CASE=n` (and `MANTISSA_FUZZ_DEVICE=cuda` for the GPU's).
#[test]
fn random_calls_return_ok_or_err_and_never_panic() {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let gpu = Device::cuda(0);
    if let Some(case) = var("MANTISSA_FUZZ_CASE") {
        memory::set_host_memory_limit(Some(HOST_LIMIT));
        // Replays one case with the panic (and its backtrace) shown.
        if std::env::var("MANTISSA_FUZZ_DEVICE").as_deref() == Ok("cuda") {
            DEVICE.with(|d| d.set(gpu.expect("MANTISSA_FUZZ_DEVICE=cuda needs a GPU")));
        }
        println!("case {case}: {:?}", run_case(case));
        return;
    }
    let cases = var("MANTISSA_FUZZ_CASES").unwrap_or(27_000);
    let mut runs = vec![(Device::Cpu, cases)];
    match gpu {
        Ok(d) => runs.push((d, cases / 4)),
        Err(e) => println!("skipped: no CUDA device ({e})"),
    }
    memory::set_host_memory_limit(Some(HOST_LIMIT));
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut slow = Vec::new();
    let results: Vec<_> = runs
        .iter()
        .map(|&(device, n)| {
            DEVICE.with(|d| d.set(device));
            let mut slow_here = Vec::new();
            let outcomes = run_cases(n, &mut slow_here);
            slow.extend(slow_here.into_iter().map(|s| format!("{device:?}: {s}")));
            (device, n, outcomes)
        })
        .collect();
    std::panic::set_hook(quiet);
    memory::set_host_memory_limit(None);
    // A slow case names itself (replay it with MANTISSA_FUZZ_CASE=n). Reported, not failed:
    // how long a case takes depends on the machine (the sanitized emulated device is slow).
    for s in &slow {
        println!("slower than {SLOW:?}: {s}");
    }
    for (device, n, outcomes) in &results {
        let panics: Vec<String> = outcomes
            .iter()
            .enumerate()
            .filter_map(|(case, o)| match o {
                Outcome::Panic(what) => Some(format!("case {case} (op {}): {what}", case % OPS)),
                _ => None,
            })
            .collect();
        let per_op = tally(outcomes);
        println!(
            "{device:?}: {n} cases, {} panics; Ok and Err per op:",
            panics.len()
        );
        println!("{per_op:?}");
        assert!(
            panics.is_empty(),
            "panics on {device:?}:\n{}",
            panics.join("\n")
        );
        // Every op must be reached with valid and with invalid input, or the test checks
        // less than it claims (on the CPU: a device rejects f64 besides, and runs fewer).
        if *device == Device::Cpu && *n >= 100 * OPS as u64 {
            for (op, [ok, err]) in per_op.iter().enumerate() {
                assert!(
                    *ok >= 5 && *err >= 5,
                    "{device:?}, op {op}: {ok} Ok, {err} Err"
                );
            }
        }
    }
    if let [(_, _, cpu), (device, _, other)] = &results[..] {
        let differ = disagreements(cpu, other);
        assert!(
            differ.is_empty(),
            "{} cases differ between the CPU and {device:?}:\n{}",
            differ.len(),
            differ.join("\n")
        );
    }
}
