#!/usr/bin/env python3
"""Writes tests/torch_ref/cases.safetensors: random calls of the engine's ops with PyTorch's
results, for tests/torch_reference.rs, which runs the same calls through mantissa and compares.

Each case is one op call on small random f32 inputs. PyTorch computes it in float64 from those
f32 values: the outputs, and the gradient of sum(out * g) for each input that requires grad,
with g random. Where PyTorch raises, the case records that (`err=1`), and mantissa must return
an Err too. Cases are described in the file's metadata, one `key=value` list per case
(`case.N`); tensors are named `N.name`.

Regenerate (PyTorch on the CPU is enough):  python3 tests/torch_ref/gen.py
"""
import json
import math
import os
import random
import struct
import sys

import torch
import torch.nn.functional as F

SEED = 20261123
rng = random.Random(SEED)
torch.manual_seed(SEED)


def randn(*shape):
    return torch.randn(tuple(shape), dtype=torch.float32)


def positive(*shape):
    return randn(*shape).abs() + 0.5


def away_from_zero(*shape):
    x = randn(*shape)
    return torch.where(x < 0, x - 0.5, x + 0.5)


def index(high, *shape):
    return torch.randint(0, high, tuple(shape), dtype=torch.int64)


def shape(rank, lo=1, hi=5):
    return [rng.randint(lo, hi) for _ in range(rank)]


def csv(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (list, tuple)):
        return ",".join(csv(x) for x in v) if v else "[]"
    return str(v)


cases = []  # (spec dict, inputs [(name, tensor, grad)], fn(tensors dict) -> outputs)


def case(op, inputs, fn, **params):
    cases.append((op, params, inputs, fn))


# ---- elementwise -------------------------------------------------------------------------
UNARY = {
    "neg": (torch.neg, randn),
    "abs": (torch.abs, away_from_zero),
    "exp": (torch.exp, randn),
    "log": (torch.log, positive),
    "log1p": (torch.log1p, positive),
    "sqrt": (torch.sqrt, positive),
    "rsqrt": (torch.rsqrt, positive),
    "recip": (torch.reciprocal, away_from_zero),
    "sqr": (torch.square, randn),
    "sin": (torch.sin, randn),
    "cos": (torch.cos, randn),
    "tanh": (torch.tanh, randn),
    "sigmoid": (torch.sigmoid, randn),
    "relu": (torch.relu, away_from_zero),
    "gelu": (F.gelu, randn),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), randn),
    "silu": (F.silu, randn),
}
for name, (fn, make) in UNARY.items():
    for _ in range(2):
        s = shape(rng.randint(0, 3))
        case(name, [("x", make(*s), True)], lambda t, fn=fn: [fn(t["x"])])
for _ in range(3):
    slope = rng.choice([0.01, 0.2, 1.5])
    case("leaky_relu", [("x", away_from_zero(3, 4), True)],
         lambda t, s=slope: [F.leaky_relu(t["x"], s)], slope=slope)
for lo, hi in [(-0.5, 0.5), (0.0, 10.0), (0.3, -0.3), (-1.0, -1.0)]:
    case("clamp", [("x", randn(4, 5), True)],
         lambda t, lo=lo, hi=hi: [torch.clamp(t["x"], lo, hi)], lo=lo, hi=hi)
for p in [2.0, 0.5, -1.5, 3.0, 0.0, 1.0]:
    case("pow_scalar", [("x", positive(3, 4), True)],
         lambda t, p=p: [torch.pow(t["x"], p)], p=p)
for p in [2.0, 0.5, 1.0]:
    case("scalar_pow", [("x", randn(3, 4), True)],
         lambda t, p=p: [torch.pow(p, t["x"])], p=p)
case("rsub", [("x", randn(5), True)], lambda t: [2.5 - t["x"]], s=2.5)


def broadcast_pair():
    """Two shapes that broadcast (sometimes of different ranks, sometimes with 1s)."""
    out = shape(rng.randint(1, 4))
    a, b = list(out), list(out)
    for v in (a, b):
        for i in range(len(v)):
            if rng.random() < 0.3:
                v[i] = 1
    if rng.random() < 0.3:
        b = b[rng.randint(1, len(b)):] if len(b) > 1 else b
    if rng.random() < 0.15:
        a = []
    return a, b


BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}
for name, fn in BINARY.items():
    for _ in range(4):
        sa, sb = broadcast_pair()
        make_a = positive if name == "pow" else randn
        make_b = away_from_zero if name == "div" else randn
        case(name, [("a", make_a(*sa), True), ("b", make_b(*sb), True)],
             lambda t, fn=fn: [fn(t["a"], t["b"])])
    # Shapes that do not broadcast.
    case(name, [("a", randn(3, 4), True), ("b", randn(2, 4), True)],
         lambda t, fn=fn: [fn(t["a"], t["b"])])
for name, fn in [("eq", torch.eq), ("ne", torch.ne), ("lt", torch.lt), ("le", torch.le),
                 ("gt", torch.gt), ("ge", torch.ge)]:
    sa, sb = broadcast_pair()
    # Small integers, so that ties occur.
    a = torch.randint(-2, 3, sa).float()
    b = torch.randint(-2, 3, sb).float()
    case(name, [("a", a, False), ("b", b, False)],
         lambda t, fn=fn: [fn(t["a"], t["b"]).to(torch.uint8)])
for _ in range(3):
    sa, sb = broadcast_pair()
    cond_shape = rng.choice([sa, sb])
    cond = (torch.rand(cond_shape) < 0.5).to(torch.uint8)
    case("where", [("cond", cond, False), ("a", randn(*sa), True), ("b", randn(*sb), True)],
         lambda t: [torch.where(t["cond"].bool(), t["a"], t["b"])])
for _ in range(2):
    s = shape(3)
    mask_shape = [1 if rng.random() < 0.5 else d for d in s]
    mask = (torch.rand(mask_shape) < 0.5).to(torch.uint8)
    case("masked_fill", [("x", randn(*s), True), ("mask", mask, False)],
         lambda t: [t["x"].masked_fill(t["mask"].bool(), -3.0)], value=-3.0)

# ---- reductions --------------------------------------------------------------------------


def some_dims(rank):
    dims = [d for d in range(rank) if rng.random() < 0.5] or [rng.randrange(rank)]
    return [d - rank if rng.random() < 0.3 else d for d in dims]


for _ in range(6):
    r = rng.randint(1, 4)
    s, dims, keep = shape(r), None, rng.random() < 0.5
    dims = some_dims(r)
    case("sum", [("x", randn(*s), True)],
         lambda t, d=dims, k=keep: [t["x"].sum(d, keepdim=k)], dims=dims, keepdim=keep)
    case("mean", [("x", randn(*s), True)],
         lambda t, d=dims, k=keep: [t["x"].mean(d, keepdim=k)], dims=dims, keepdim=keep)
for correction in [0, 1, 2]:
    for _ in range(2):
        r = rng.randint(1, 3)
        s, dims, keep = shape(r, 2, 5), some_dims(r), rng.random() < 0.5
        for name, fn in [("var", torch.var), ("std", torch.std)]:
            case(name, [("x", randn(*s), True)],
                 lambda t, fn=fn, d=dims, c=correction, k=keep:
                 [fn(t["x"], d, correction=c, keepdim=k)],
                 dims=dims, correction=correction, keepdim=keep)
case("sum_all", [("x", randn(3, 4), True)], lambda t: [t["x"].sum()])
case("mean_all", [("x", randn(3, 4), True)], lambda t: [t["x"].mean()])
case("max_all", [("x", randn(3, 4), True)], lambda t: [t["x"].max()])
case("min_all", [("x", randn(2, 5), True)], lambda t: [t["x"].min()])
for _ in range(4):
    r = rng.randint(1, 3)
    s, keep = shape(r), rng.random() < 0.5
    dim = rng.randrange(-r, r)
    for name, fn in [("max", torch.max), ("min", torch.min)]:
        case(name, [("x", randn(*s), True)],
             lambda t, fn=fn, d=dim, k=keep: list(fn(t["x"], d, keepdim=k)), dim=dim, keepdim=keep)
    for name, fn in [("argmax", torch.argmax), ("argmin", torch.argmin)]:
        case(name, [("x", randn(*s), False)],
             lambda t, fn=fn, d=dim, k=keep: [fn(t["x"], d, keepdim=k)], dim=dim, keepdim=keep)
case("max", [("x", randn(3), True)], lambda t: list(torch.max(t["x"], 1)), dim=1, keepdim=False)
for _ in range(4):
    r = rng.randint(1, 4)
    s = shape(r)
    dim = rng.randrange(-r, r)
    case("softmax", [("x", randn(*s) * 3, True)],
         lambda t, d=dim: [torch.softmax(t["x"], d)], dim=dim)
    case("log_softmax", [("x", randn(*s) * 3, True)],
         lambda t, d=dim: [torch.log_softmax(t["x"], d)], dim=dim)

# ---- indexing ----------------------------------------------------------------------------
for _ in range(4):
    r = rng.randint(1, 3)
    s = shape(r)
    dim = rng.randrange(-r, r)
    parts = [list(s) for _ in range(rng.randint(1, 3))]
    for p in parts:
        p[dim] = rng.randint(0, 3)
    ins = [(f"t{i}", randn(*p), True) for i, p in enumerate(parts)]
    names = [n for n, _, _ in ins]
    case("cat", ins, lambda t, d=dim, n=names: [torch.cat([t[k] for k in n], d)], dim=dim)
for _ in range(3):
    r = rng.randint(0, 3)
    s = shape(r)
    dim = rng.randrange(-(r + 1), r + 1)
    ins = [(f"t{i}", randn(*s), True) for i in range(rng.randint(1, 3))]
    names = [n for n, _, _ in ins]
    case("stack", ins, lambda t, d=dim, n=names: [torch.stack([t[k] for k in n], d)], dim=dim)
case("cat", [("t0", randn(2, 3), True), ("t1", randn(3, 3), True)],
     lambda t: [torch.cat([t["t0"], t["t1"]], 1)], dim=1)
for _ in range(4):
    r = rng.randint(1, 3)
    s = shape(r)
    dim = rng.randrange(-r, r)
    idx = index(s[dim], rng.randint(0, 6))
    case("index_select", [("x", randn(*s), True), ("idx", idx, False)],
         lambda t, d=dim: [torch.index_select(t["x"], d, t["idx"])], dim=dim)
for _ in range(5):
    r = rng.randint(1, 3)
    s = shape(r)
    dim = rng.randrange(-r, r)
    ishape = [rng.randint(1, d) for d in s]
    ishape[dim] = rng.randint(1, 5)
    idx = index(s[dim], *ishape)
    case("gather", [("x", randn(*s), True), ("idx", idx, False)],
         lambda t, d=dim: [torch.gather(t["x"], d, t["idx"])], dim=dim)
    # src may be larger than the index; PyTorch's backward then fails (its src gradient has
    # the index's shape), so src requires grad only when it has the index's shape.
    sshape = [i + rng.randint(0, 1) for i in ishape]
    src = randn(*sshape)
    case("scatter_add",
         [("x", randn(*s), True), ("idx", idx, False), ("src", src, sshape == ishape)],
         lambda t, d=dim: [torch.scatter_add(t["x"], d, t["idx"], t["src"])], dim=dim)
for _ in range(3):
    n, d = rng.randint(1, 8), rng.randint(1, 5)
    idx = index(n, *shape(rng.randint(1, 2)))
    case("embedding", [("idx", idx, False), ("w", randn(n, d), True)],
         lambda t: [F.embedding(t["idx"], t["w"])])

# ---- products ----------------------------------------------------------------------------
MATMUL_SHAPES = [
    ([4], [4]), ([3, 4], [4]), ([4], [4, 5]), ([3, 4], [4, 5]), ([2, 3, 4], [4, 5]),
    ([3, 4], [2, 4, 5]), ([2, 1, 3, 4], [5, 4, 2]), ([2, 3, 4], [2, 4, 5]), ([4], [2, 4, 3]),
    ([2, 3, 4], [4]), ([3, 4], [5, 6]), ([0, 4], [4, 3]), ([3, 0], [0, 2]),
]
for sa, sb in MATMUL_SHAPES:
    case("matmul", [("a", randn(*sa), True), ("b", randn(*sb), True)],
         lambda t: [torch.matmul(t["a"], t["b"])])
for xs, bias in [([5, 3], True), ([2, 4, 3], False), ([3], True), ([6, 3], True)]:
    ins = [("x", randn(*xs), True), ("w", randn(4, 3), True)]
    if bias:
        ins.append(("b", randn(4), True))
    case("linear", ins, lambda t: [F.linear(t["x"], t["w"], t.get("b"))])
case("linear_relu", [("x", randn(5, 3), True), ("w", randn(4, 3), True), ("b", randn(4), True)],
     lambda t: [F.relu(F.linear(t["x"], t["w"], t["b"]))])

# ---- convolution and pooling -------------------------------------------------------------
for _ in range(14):
    groups = rng.choice([1, 1, 2, 3])
    c, o = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    kh, kw = rng.randint(1, 3), rng.randint(1, 3)
    stride = [rng.randint(1, 3), rng.randint(1, 3)]
    padding = [rng.randint(0, 2), rng.randint(0, 2)]
    dilation = [rng.randint(1, 2), rng.randint(1, 2)]
    h, w = rng.randint(3, 8), rng.randint(3, 8)
    xs = [rng.randint(1, 3), c, h, w] if rng.random() < 0.85 else [c, h, w]
    ins = [("x", randn(*xs), True), ("w", randn(o, c // groups, kh, kw), True)]
    if rng.random() < 0.6:
        ins.append(("b", randn(o), True))
    case("conv2d", ins,
         lambda t, s=stride, p=padding, d=dilation, g=groups:
         [F.conv2d(t["x"], t["w"], t.get("b"), s, p, d, g)],
         stride=stride, padding=padding, dilation=dilation, groups=groups)
for _ in range(10):
    groups = rng.choice([1, 1, 2])
    c, o = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    kh, kw = rng.randint(1, 3), rng.randint(1, 3)
    stride = [rng.randint(1, 3), rng.randint(1, 3)]
    dilation = [rng.randint(1, 2), rng.randint(1, 2)]
    padding = [rng.randint(0, 1), rng.randint(0, 1)]
    out_pad = [rng.randint(0, max(stride[i], dilation[i]) - 1) for i in range(2)]
    xs = [rng.randint(1, 2), c, rng.randint(2, 5), rng.randint(2, 5)]
    ins = [("x", randn(*xs), True), ("w", randn(c, o // groups, kh, kw), True)]
    if rng.random() < 0.5:
        ins.append(("b", randn(o), True))
    case("conv_transpose2d", ins,
         lambda t, s=stride, p=padding, op=out_pad, d=dilation, g=groups:
         [F.conv_transpose2d(t["x"], t["w"], t.get("b"), s, p, op, g, d)],
         stride=stride, padding=padding, output_padding=out_pad, dilation=dilation,
         groups=groups)
# Bad convolutions: channels that do not match, a kernel larger than the padded input.
case("conv2d", [("x", randn(1, 3, 5, 5), True), ("w", randn(2, 2, 3, 3), True)],
     lambda t: [F.conv2d(t["x"], t["w"])], stride=[1, 1], padding=[0, 0], dilation=[1, 1],
     groups=1)
case("conv2d", [("x", randn(1, 2, 2, 2), True), ("w", randn(2, 2, 3, 3), True)],
     lambda t: [F.conv2d(t["x"], t["w"])], stride=[1, 1], padding=[0, 0], dilation=[1, 1],
     groups=1)
for _ in range(14):
    k = [rng.randint(1, 3), rng.randint(1, 3)]
    stride = [rng.randint(1, 3), rng.randint(1, 3)]
    padding = [rng.randint(0, k[0] // 2), rng.randint(0, k[1] // 2)]
    dilation = [rng.randint(1, 2), rng.randint(1, 2)]
    ceil = rng.random() < 0.5
    xs = [rng.randint(1, 2), rng.randint(1, 3), rng.randint(3, 8), rng.randint(3, 8)]
    case("max_pool2d", [("x", randn(*xs), True)],
         lambda t, k=k, s=stride, p=padding, d=dilation, c=ceil:
         [F.max_pool2d(t["x"], k, s, p, d, ceil_mode=c)],
         kernel=k, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil)
    include = rng.random() < 0.5
    case("avg_pool2d", [("x", randn(*xs), True)],
         lambda t, k=k, s=stride, p=padding, c=ceil, i=include:
         [F.avg_pool2d(t["x"], k, s, p, ceil_mode=c, count_include_pad=i)],
         kernel=k, stride=stride, padding=padding, ceil_mode=ceil, count_include_pad=include)
for out in [[1, 1], [2, 3], [3, 3], [5, 7], [4, 1]]:
    xs = [rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 7), rng.randint(1, 7)]
    case("adaptive_avg_pool2d", [("x", randn(*xs), True)],
         lambda t, o=out: [F.adaptive_avg_pool2d(t["x"], o)], out=out)

# ---- normalisation -----------------------------------------------------------------------
for xs in [[4, 3], [2, 3, 5], [3, 2, 3, 4], [3, 4, 1, 1]]:
    for training in [True, False]:
        c = xs[1]
        ins = [("x", randn(*xs) * 2 + 1, True), ("rm", randn(c), False),
               ("rv", positive(c), False)]
        affine = rng.random() < 0.7
        if affine:
            ins += [("w", randn(c), True), ("b", randn(c), True)]

        def bn(t, tr=training):
            rm, rv = t["rm"].clone(), t["rv"].clone()
            y = F.batch_norm(t["x"], rm, rv, t.get("w"), t.get("b"), tr, 0.1, 1e-5)
            return [y, rm, rv]
        case("batch_norm", ins, bn, training=training, momentum=0.1, eps=1e-5)
for xs, norm in [([4, 6], [6]), ([2, 3, 4], [3, 4]), ([3, 5], [5]), ([2, 2, 3], [2, 3])]:
    ins = [("x", randn(*xs) * 2 + 1, True)]
    if rng.random() < 0.7:
        ins += [("w", randn(*norm), True), ("b", randn(*norm), True)]
    case("layer_norm", ins,
         lambda t, n=norm: [F.layer_norm(t["x"], n, t.get("w"), t.get("b"), 1e-5)],
         normalized_shape=norm, eps=1e-5)

# ---- losses ------------------------------------------------------------------------------
REDUCTIONS = ["mean", "sum", "none"]
for _ in range(12):
    n, c = rng.randint(1, 5), rng.randint(2, 5)
    spatial = [rng.randint(1, 3)] if rng.random() < 0.3 else []
    target = index(c, n, *spatial)
    ignore = -100
    if rng.random() < 0.4:
        ignore = rng.randrange(c)
    red = rng.choice(REDUCTIONS)
    smooth = rng.choice([0.0, 0.0, 0.1, 0.3])
    case("cross_entropy", [("x", randn(n, c, *spatial) * 2, True), ("target", target, False)],
         lambda t, r=red, i=ignore, s=smooth:
         [F.cross_entropy(t["x"], t["target"], reduction=r, ignore_index=i, label_smoothing=s)],
         reduction=red, ignore_index=ignore, label_smoothing=smooth)
    lp = torch.log_softmax(randn(n, c, *spatial) * 2, 1)
    case("nll_loss", [("x", lp, True), ("target", target, False)],
         lambda t, r=red, i=ignore: [F.nll_loss(t["x"], t["target"], reduction=r, ignore_index=i)],
         reduction=red, ignore_index=ignore)
# Every target ignored; one unbatched sample.
case("cross_entropy", [("x", randn(3, 4), True), ("target", torch.tensor([1, 1, 1]), False)],
     lambda t: [F.cross_entropy(t["x"], t["target"], ignore_index=1)],
     reduction="mean", ignore_index=1, label_smoothing=0.0)
case("cross_entropy", [("x", randn(4), True), ("target", torch.tensor(2), False)],
     lambda t: [F.cross_entropy(t["x"], t["target"])],
     reduction="mean", ignore_index=-100, label_smoothing=0.0)
for red in REDUCTIONS:
    s = shape(rng.randint(1, 3))
    case("mse_loss", [("x", randn(*s), True), ("target", randn(*s), True)],
         lambda t, r=red: [F.mse_loss(t["x"], t["target"], reduction=r)], reduction=red)
    case("bce_with_logits", [("x", randn(*s) * 4, True), ("target", torch.rand(*s), True)],
         lambda t, r=red: [F.binary_cross_entropy_with_logits(t["x"], t["target"], reduction=r)],
         reduction=red)

# ---- recurrent ---------------------------------------------------------------------------


def torch_lstm_cell(gates, c):
    i, f, g, o = gates.chunk(4, 1)
    c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return [torch.sigmoid(o) * torch.tanh(c2), c2]


for b, h in [(1, 1), (3, 4), (2, 7)]:
    case("lstm_cell", [("gates", randn(b, 4 * h) * 2, True), ("c", randn(b, h), True)],
         lambda t: torch_lstm_cell(t["gates"], t["c"]))


def torch_lstm_layer(t):
    h, c, outs = t["h0"], t["c0"], []
    for step in t["x"]:
        gates = F.linear(step, t["w_ih"], t["bias"]) + F.linear(h, t["w_hh"])
        h, c = torch_lstm_cell(gates, c)
        outs.append(h)
    return [torch.stack(outs), h, c]


for steps, b, i, h in [(1, 2, 3, 2), (4, 3, 2, 5), (3, 1, 4, 3)]:
    case("lstm_layer",
         [("x", randn(steps, b, i), True), ("h0", randn(b, h), True), ("c0", randn(b, h), True),
          ("w_ih", randn(4 * h, i) * 0.5, True), ("w_hh", randn(4 * h, h) * 0.5, True),
          ("bias", randn(4 * h) * 0.5, True)],
         torch_lstm_layer)


# ---- type promotion: dtype pairs, with 0-d operands -------------------------------------
DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
      "i64": torch.int64, "u8": torch.uint8}
DT_NAME = {v: k for k, v in DT.items()}
PROMOTE = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
           "maximum": torch.maximum, "pow": torch.pow}


def promote_case(fn_name, da, db, ra, rb):
    # Small positive integers: exact in every dtype, and sub is kept off u8 (PyTorch's u8
    # arithmetic wraps around; the engine's saturates).
    a = torch.randint(1, 4, [3] * ra).float()
    b = torch.randint(1, 4, [3] * rb).float()
    fn = PROMOTE[fn_name]
    try:
        out = {"out_dtype": DT_NAME[fn(a.to(DT[da]), b.to(DT[db])).dtype]}
    except RuntimeError:
        out = {}
    case("promote", [("a", a, False), ("b", b, False)],
         lambda t: [fn(t["a"].to(DT[da]), t["b"].to(DT[db])).double()],
         func=fn_name, dtypes=[da, db], **out)


for da in DT:
    for db in DT:
        for ra, rb in [(1, 1), (1, 0), (0, 1)]:
            promote_case("add", da, db, ra, rb)
for fn_name in ["sub", "mul", "div", "maximum", "pow"]:
    for da, db in [("i64", "i64"), ("f16", "f32"), ("i64", "f16"), ("u8", "i64"),
                   ("bf16", "f16"), ("f32", "f64"), ("f32", "i64")]:
        if fn_name == "sub" and "u8" in (da, db):
            continue
        for ra, rb in [(1, 1), (1, 0), (0, 0)]:
            promote_case(fn_name, da, db, ra, rb)

# Tensor and Python scalar: an int scalar keeps an integer tensor integer, a float scalar
# makes it f32; either takes a float tensor's dtype.
SCALAR_FNS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
              "pow": torch.pow, "maximum": lambda a, b: torch.clamp(a, min=b),
              "eq": torch.eq, "lt": torch.lt}
for fn_name, fn in SCALAR_FNS.items():
    for dt in ["f32", "f16", "i64"]:
        for scalar in [2, 2.5, -3]:
            if fn_name == "pow" and scalar == -3 and dt == "i64":
                continue  # PyTorch refuses negative integer powers of integers
            a = torch.randint(1, 5, (4,)).float()
            out = fn(a.to(DT[dt]), scalar)
            out_name = DT_NAME[torch.uint8 if out.dtype == torch.bool else out.dtype]
            case("scalar_op", [("a", a, False)],
                 lambda t, fn=fn, dt=dt, v=scalar: [fn(t["a"].to(DT[dt]), v).double()],
                 func=fn_name, dtypes=[dt], scalar=scalar,
                 scalar_kind="int" if isinstance(scalar, int) else "float", out_dtype=out_name)

# ---- medium sizes: past the CPU kernels' SIMD widths and blocking, with ragged tails ------
for name in ["exp", "tanh", "sigmoid", "gelu", "silu", "sqrt"]:
    fn, make = UNARY[name]
    case(name, [("x", make(1037), True)], lambda t, fn=fn: [fn(t["x"])])
case("add", [("a", randn(37, 61), True), ("b", randn(61), True)],
     lambda t: [t["a"] + t["b"]])
case("mul", [("a", randn(29, 1, 43), True), ("b", randn(7, 1), True)],
     lambda t: [t["a"] * t["b"]])
for dims in [[0], [1], [0, 1]]:
    case("sum", [("x", randn(67, 45), True)],
         lambda t, d=dims: [t["x"].sum(d)], dims=dims, keepdim=False)
case("var", [("x", randn(33, 70), True)],
     lambda t: [t["x"].var([1], correction=1)], dims=[1], correction=1, keepdim=False)
case("max", [("x", randn(45, 67), True)], lambda t: list(torch.max(t["x"], 0)), dim=0,
     keepdim=False)
case("softmax", [("x", randn(9, 261) * 3, True)], lambda t: [torch.softmax(t["x"], 1)], dim=1)
case("log_softmax", [("x", randn(261, 9) * 3, True)],
     lambda t: [torch.log_softmax(t["x"], 0)], dim=0)
case("matmul", [("a", randn(37, 70), True), ("b", randn(70, 29), True)],
     lambda t: [t["a"] @ t["b"]])
case("conv2d", [("x", randn(2, 6, 13, 11), True), ("w", randn(10, 6, 3, 3), True),
                ("b", randn(10), True)],
     lambda t: [F.conv2d(t["x"], t["w"], t["b"], 1, 1)],
     stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1)
case("max_pool2d", [("x", randn(2, 5, 17, 15), True)],
     lambda t: [F.max_pool2d(t["x"], 2, 2)],
     kernel=[2, 2], stride=[2, 2], padding=[0, 0], dilation=[1, 1], ceil_mode=False)
case("layer_norm", [("x", randn(21, 67) * 2 + 1, True), ("w", randn(67), True),
                    ("b", randn(67), True)],
     lambda t: [F.layer_norm(t["x"], [67], t["w"], t["b"], 1e-5)],
     normalized_shape=[67], eps=1e-5)
case("batch_norm", [("x", randn(7, 19, 5, 3) * 2 + 1, True), ("rm", randn(19), False),
                    ("rv", positive(19), False), ("w", randn(19), True), ("b", randn(19), True)],
     lambda t: (lambda rm, rv: [F.batch_norm(t["x"], rm, rv, t["w"], t["b"], True, 0.1, 1e-5),
                                rm, rv])(t["rm"].clone(), t["rv"].clone()),
     training=True, momentum=0.1, eps=1e-5)
case("cross_entropy", [("x", randn(131, 17) * 2, True), ("target", index(17, 131), False)],
     lambda t: [F.cross_entropy(t["x"], t["target"], label_smoothing=0.1)],
     reduction="mean", ignore_index=-100, label_smoothing=0.1)

# ---- variants: transposed (strided) inputs, and f16 / bf16 --------------------------------
HALF_OPS = {"exp", "log", "sqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "add", "mul", "div",
            "sum", "mean", "var", "max", "softmax", "log_softmax", "matmul", "linear", "conv2d",
            "conv_transpose2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm",
            "layer_norm", "cross_entropy", "nll_loss", "mse_loss", "bce_with_logits",
            "lstm_cell", "lstm_layer", "embedding", "index_select", "gather", "cat"}
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}


def add_variants():
    seen = {}
    for op, params, inputs, fn in list(cases):
        seen[op] = seen.get(op, 0) + 1
        if seen[op] > 2:
            continue
        strided = [n for n, x, _ in inputs if x.dim() >= 2]
        if strided:
            ins = [(n, x.transpose(-1, -2).contiguous() if n in strided else x, g)
                   for n, x, g in inputs]
            cases.append((op, {**params, "T": strided}, ins, fn))
        if op in HALF_OPS:
            for name, dt in HALF.items():
                ins = [(n, x.to(dt).float() if x.is_floating_point() else x, g)
                       for n, x, g in inputs]
                cases.append((op, {**params, "dtype": name}, ins, fn))


add_variants()

# ---- optimizers, schedules, clipping (after the variants: these are not varied) ----------
OPT_STEPS = 6


def torch_optim(kind, cfg):
    def fn(t):
        p = t["p"].detach().clone().requires_grad_(True)
        if kind == "sgd":
            opt = torch.optim.SGD([p], **cfg)
        elif kind == "adam":
            opt = torch.optim.Adam([p], **cfg)
        elif kind == "adamw":
            opt = torch.optim.AdamW([p], **cfg)
        elif kind == "rmsprop":
            opt = torch.optim.RMSprop([p], **cfg)
        elif kind == "adagrad":
            opt = torch.optim.Adagrad([p], **cfg)
        else:
            opt = torch.optim.Adadelta([p], **cfg)
        for k in range(OPT_STEPS):
            p.grad = t[f"g{k}"].clone()
            opt.step()
        return [p.detach()]
    return fn


OPTIMS = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("sgd", dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
    ("adam", dict(lr=0.01)),
    ("adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    ("adamw", dict(lr=0.01)),
    ("adamw", dict(lr=0.02, betas=(0.5, 0.9), weight_decay=0.3)),
    ("adadelta", dict(lr=1.0)),
    ("adadelta", dict(lr=0.5, rho=0.7, eps=1e-4, weight_decay=0.05)),
]
for kind, cfg in OPTIMS:
    ins = [("p", randn(3, 4), False)] + [(f"g{k}", randn(3, 4), False) for k in range(OPT_STEPS)]
    params = {k: v for k, v in cfg.items() if k != "betas"}
    if "betas" in cfg:
        params["beta1"], params["beta2"] = cfg["betas"]
    case("optim", ins, torch_optim(kind, cfg), kind=kind, steps=OPT_STEPS, **params)


def torch_lrs(make, steps, lr):
    def fn(t):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        sched = make(opt)
        lrs = []
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return [torch.tensor(lrs, dtype=torch.float64)]
    return fn


S = torch.optim.lr_scheduler
case("lr_schedule", [], torch_lrs(lambda o: S.StepLR(o, 3, 0.5), 10, 0.1),
     kind="step", base=0.1, step_size=3, gamma=0.5, steps=10)
case("lr_schedule", [], torch_lrs(lambda o: S.CosineAnnealingLR(o, 8, 0.001), 9, 0.1),
     kind="cosine", base=0.1, t_max=8, eta_min=0.001, steps=9)
for total in [10, 37]:
    case("lr_schedule", [], torch_lrs(lambda o, n=total: S.OneCycleLR(o, 0.3, total_steps=n), total,
                                      0.1),
         kind="one_cycle", max_lr=0.3, steps=total)
for max_norm in [0.5, 100.0]:
    def clip(t, m=max_norm):
        # Each parameter's gradient is twice its value.
        ps = [t[n].detach().clone().requires_grad_(True) for n in ("p0", "p1")]
        for p in ps:
            p.grad = 2 * p.detach()
        total = torch.nn.utils.clip_grad_norm_(ps, m)
        return [total] + [p.grad for p in ps]
    case("clip_grad_norm", [("p0", randn(3, 4), False), ("p1", randn(5), False)], clip,
         max_norm=max_norm)

# The loss scaler with Adam: steps whose gradients hold inf or NaN are skipped (parameter and
# Adam state unchanged) and back the scale off; every growth_interval clean steps it grows.
SCALER_STEPS = 10


def torch_scaler(t):
    w = t["w"].detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=3)
    scales = []
    for k in range(SCALER_STEPS):
        opt.zero_grad()
        scaler.scale((w * t[f"x{k}"]).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [w.detach(), torch.tensor(scales, dtype=torch.float64)]


for bad_steps in [[2], [0, 1, 5, 6, 7]]:
    xs = []
    for k in range(SCALER_STEPS):
        x = randn(3, 4)
        if k in bad_steps:
            x[rng.randrange(3), rng.randrange(4)] = rng.choice([math.inf, -math.inf, math.nan])
        xs.append((f"x{k}", x, False))
    case("grad_scaler", [("w", randn(3, 4), False)] + xs, torch_scaler, steps=SCALER_STEPS,
         init_scale=1024.0, growth_interval=3)

# ---- special values: NaN, infinities, ties ------------------------------------------------
nan, inf = math.nan, math.inf
special = torch.tensor([[1.0, nan, 3.0, -2.0], [0.5, 2.0, 2.0, -1.0], [-inf, 4.0, inf, 0.0]])
for dim in [0, 1]:
    case("max", [("x", special.clone(), True)],
         lambda t, d=dim: list(torch.max(t["x"], d)), dim=dim, keepdim=False)
    case("min", [("x", special.clone(), True)],
         lambda t, d=dim: list(torch.min(t["x"], d)), dim=dim, keepdim=False)
    case("argmax", [("x", special.clone(), False)],
         lambda t, d=dim: [torch.argmax(t["x"], d)], dim=dim, keepdim=False)
    case("argmin", [("x", special.clone(), False)],
         lambda t, d=dim: [torch.argmin(t["x"], d)], dim=dim, keepdim=False)
# Ties: the first index, as PyTorch documents for argmax.
ties = torch.tensor([[2.0, 5.0, 5.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
case("argmax", [("x", ties, False)], lambda t: [torch.argmax(t["x"], 1)], dim=1, keepdim=False)
case("argmin", [("x", ties, False)], lambda t: [torch.argmin(t["x"], 1)], dim=1, keepdim=False)
case("max_all", [("x", special.clone(), True)], lambda t: [t["x"].max()])
case("sum", [("x", special.clone(), True)], lambda t: [t["x"].sum([1])], dims=[1], keepdim=False)
case("relu", [("x", special.clone(), True)], lambda t: [torch.relu(t["x"])])
case("clamp", [("x", special.clone(), True)], lambda t: [torch.clamp(t["x"], -1.0, 1.5)],
     lo=-1.0, hi=1.5)
case("sigmoid", [("x", special[2:].clone(), True)], lambda t: [torch.sigmoid(t["x"])])
case("tanh", [("x", special[2:].clone(), True)], lambda t: [torch.tanh(t["x"])])
case("exp", [("x", special[2:].clone(), True)], lambda t: [torch.exp(t["x"])])
# Masked attention rows: some entries -inf, and one row entirely -inf (NaN in PyTorch).
masked = torch.tensor([[0.5, -inf, 1.0, -inf], [-inf, -inf, -inf, -inf], [1.0, 2.0, 3.0, 4.0]])
case("softmax", [("x", masked.clone(), True)], lambda t: [torch.softmax(t["x"], 1)], dim=1)
case("log_softmax", [("x", masked.clone(), True)], lambda t: [torch.log_softmax(t["x"], 1)],
     dim=1)
case("cross_entropy", [("x", masked[[0, 2]].clone(), True), ("target", torch.tensor([0, 3]), False)],
     lambda t: [F.cross_entropy(t["x"], t["target"])], reduction="mean", ignore_index=-100,
     label_smoothing=0.0)
case("max_pool2d", [("x", special.reshape(1, 1, 3, 4).clone(), True)],
     lambda t: [F.max_pool2d(t["x"], 2, 1)],
     kernel=[2, 2], stride=[1, 1], padding=[0, 0], dilation=[1, 1], ceil_mode=False)
case("bce_with_logits", [("x", torch.tensor([-inf, 200.0, -200.0, 0.0]), True),
                         ("target", torch.tensor([0.0, 1.0, 0.0, 0.5]), True)],
     lambda t: [F.binary_cross_entropy_with_logits(t["x"], t["target"], reduction="none")],
     reduction="none")

# Kinks: inputs exactly at the points where a derivative is a convention.
kinks = torch.tensor([[-1.0, 0.0, 0.5, 1.0], [2.0, 0.0, 1.0, -0.0]])
for name, fn in [("relu", torch.relu), ("abs", torch.abs),
                 ("leaky_relu", lambda x: F.leaky_relu(x, 0.1))]:
    case(name, [("x", kinks.clone(), True)], lambda t, fn=fn: [fn(t["x"])], slope=0.1)
case("clamp", [("x", kinks.clone(), True)], lambda t: [torch.clamp(t["x"], 0.0, 1.0)],
     lo=0.0, hi=1.0)
for name, fn in [("maximum", torch.maximum), ("minimum", torch.minimum)]:
    case(name, [("a", kinks.clone(), True), ("b", torch.tensor([0.0, 0.0, 1.0, 1.0]), True)],
         lambda t, fn=fn: [fn(t["a"], t["b"])])
ties = torch.tensor([[3.0, 1.0, 3.0], [2.0, 2.0, 2.0]])
case("max", [("x", ties.clone(), True)], lambda t: list(torch.max(t["x"], 1)), dim=1,
     keepdim=False)
case("max_all", [("x", ties.clone(), True)], lambda t: [t["x"].max()])
case("min_all", [("x", ties.clone(), True)], lambda t: [t["x"].min()])
case("max_pool2d", [("x", torch.tensor([[[[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]]]), True)],
     lambda t: [F.max_pool2d(t["x"], 2, 1)],
     kernel=[2, 2], stride=[1, 1], padding=[0, 0], dilation=[1, 1], ceil_mode=False)
case("sqrt", [("x", torch.tensor([0.0, 1.0, 4.0]), True)], lambda t: [torch.sqrt(t["x"])])
case("bce_with_logits", [("x", torch.zeros(3), True), ("target", torch.tensor([0.0, 0.3, 1.0]),
                                                       True)],
     lambda t: [F.binary_cross_entropy_with_logits(t["x"], t["target"])], reduction="mean")

# Zeros where a function or its derivative is singular or a convention.
zeros_in = torch.tensor([0.0, 0.0, 1.5, 2.0])
for p in [0.0, 1.0, 2.0, 0.5, 3.0]:
    case("pow_scalar", [("x", zeros_in.clone(), True)], lambda t, p=p: [torch.pow(t["x"], p)], p=p)
case("pow", [("a", zeros_in.clone(), True), ("b", torch.tensor([0.0, 2.0, 0.0, -1.0]), True)],
     lambda t: [torch.pow(t["a"], t["b"])])
case("scalar_pow", [("x", torch.tensor([0.0, -1.0, 2.0]), True)],
     lambda t: [torch.pow(0.0, t["x"])], p=0.0)
case("div", [("a", torch.tensor([1.0, -1.0, 0.0, 2.0]), True),
             ("b", torch.tensor([0.0, 0.0, 0.0, 4.0]), True)],
     lambda t: [t["a"] / t["b"]])
case("log", [("x", torch.tensor([0.0, 1.0, 2.0]), True)], lambda t: [torch.log(t["x"])])
case("rsqrt", [("x", torch.tensor([0.0, 1.0, 4.0]), True)], lambda t: [torch.rsqrt(t["x"])])
case("std", [("x", torch.tensor([[2.0, 2.0, 2.0], [1.0, 2.0, 3.0]]), True)],
     lambda t: [torch.std(t["x"], [1], correction=1)], dims=[1], correction=1, keepdim=False)
case("layer_norm", [("x", torch.tensor([[2.0, 2.0, 2.0], [1.0, 2.0, 3.0]]), True)],
     lambda t: [F.layer_norm(t["x"], [3], None, None, 1e-5)], normalized_shape=[3], eps=1e-5)

# ---- views (each with its gradient) --------------------------------------------------------
VIEWS = [
    ("squeeze", [3, 1, 4], dict(dim=1), lambda x: x.squeeze(1)),
    ("squeeze", [3, 1, 4], dict(dim=-1), lambda x: x.squeeze(-1)),
    ("squeeze", [3, 1, 4], dict(dim=0), lambda x: x.squeeze(0)),
    ("squeeze_all", [1, 3, 1, 1, 2], {}, lambda x: x.squeeze()),
    ("unsqueeze", [3, 4], dict(dim=-1), lambda x: x.unsqueeze(-1)),
    ("unsqueeze", [3, 4], dict(dim=-3), lambda x: x.unsqueeze(-3)),
    ("unsqueeze", [3, 4], dict(dim=2), lambda x: x.unsqueeze(2)),
    ("flatten", [2, 3, 4, 5], dict(start=1, end=-2), lambda x: x.flatten(1, -2)),
    ("flatten", [2, 3, 4], dict(start=0, end=-1), lambda x: x.flatten()),
    ("flatten", [], dict(start=0, end=-1), lambda x: x.flatten()),
    ("reshape_infer", [2, 3, 4], dict(shape=[-1, 6]), lambda x: x.reshape(-1, 6)),
    ("reshape_infer", [2, 3, 4], dict(shape=[4, -1, 2]), lambda x: x.reshape(4, -1, 2)),
    ("split", [7, 3], dict(size=3, dim=0), lambda x: list(x.split(3, 0))),
    ("split", [2, 5], dict(size=2, dim=-1), lambda x: list(x.split(2, -1))),
    ("transpose", [2, 3, 4], dict(d0=-1, d1=0), lambda x: x.transpose(-1, 0)),
    ("permute", [2, 3, 4], dict(perm=[2, 0, 1]), lambda x: x.permute(2, 0, 1)),
    ("narrow", [5, 4], dict(dim=-1, start=1, len=2), lambda x: x.narrow(-1, 1, 2)),
    ("expand", [3, 1], dict(shape=[2, 3, 4]), lambda x: x.expand(2, 3, 4)),
    ("t", [3, 4], {}, lambda x: x.t()),
    ("t", [5], {}, lambda x: x.t()),
    ("t", [2, 3, 4], {}, lambda x: x.t()),
]
for name, shp, params, fn in VIEWS:
    case(name, [("x", randn(*shp), True)],
         lambda t, fn=fn: (lambda y: y if isinstance(y, list) else [y])(fn(t["x"])), **params)

# ---- nn modules: PyTorch's parameter and buffer names, and their forward and backward -----
# The module's state_dict entries are inputs `p.<name>` (the parameters require grad); the
# engine's module of the same configuration gets them by name, so a name that differs fails.


def module_case(kind, make, xs, calls=("train",), **cfg):
    torch.manual_seed(rng.randrange(1 << 30))
    m = make().double()
    state = {k: v.detach().float().clone() for k, v in m.state_dict().items()}
    params = {k for k, _ in m.named_parameters()}
    ins = [(f"p.{k}", v, k in params) for k, v in state.items()]
    ins += [(f"x{i}", x, x.is_floating_point()) for i, x in enumerate(xs)]

    def fn(t):
        mod = make().double()
        tensors = {k: t[f"p.{k}"] for k in state}
        outs = []
        for i, mode in enumerate(calls):
            mod.train(mode == "train")
            y = torch.func.functional_call(mod, tensors, (t[f"x{i}"],))
            # nn.LSTM returns (output, (h, c)), nn.GRU (output, h).
            if isinstance(y, tuple):
                outs += [y[0], *(y[1] if isinstance(y[1], tuple) else (y[1],))]
            else:
                outs += [y]
        # Buffers after the calls (running statistics, batches tracked).
        outs += [tensors[k].detach() for k, _ in m.named_buffers()]
        return outs
    case("module", ins, fn, kind=kind, calls=list(calls), **cfg)


module_case("linear", lambda: torch.nn.Linear(5, 3), [randn(4, 5)], fan_in=5, fan_out=3)
module_case("conv2d", lambda: torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
            [randn(2, 4, 7, 6)], fan_in=4, fan_out=6, kernel=3, stride=2, padding=1, groups=2)
module_case("embedding", lambda: torch.nn.Embedding(7, 3), [index(7, 2, 5)], num=7, dim=3)
module_case("layer_norm", lambda: torch.nn.LayerNorm([3, 4]), [randn(2, 3, 4) * 2 + 1],
            shape=[3, 4])
module_case("batch_norm2d", lambda: torch.nn.BatchNorm2d(3),
            [randn(4, 3, 2, 2) * 2 + 1, randn(4, 3, 2, 2) - 1, randn(2, 3, 2, 2)],
            calls=("train", "train", "eval"), channels=3)
for layers, batch_first in [(1, False), (2, True)]:
    xs = [randn(3, 4, 5) if batch_first else randn(4, 3, 5)]
    module_case("lstm", lambda l=layers, b=batch_first: torch.nn.LSTM(5, 6, l, batch_first=b),
                xs, fan_in=5, hidden=6, layers=layers, batch_first=batch_first)
module_case("sequential",
            lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                        torch.nn.Flatten(), torch.nn.Linear(64, 3)),
            [randn(2, 1, 10, 10), randn(3, 1, 10, 10)], calls=("train", "eval"))

# ---- cases added later: appended, and drawn from a generator of their own, so that every
# case above keeps its inputs and the gradients run() draws for it -----------------------
_rng_before = torch.get_rng_state()
torch.manual_seed(SEED + 1)

# RMSprop and Adagrad, as the optimizers above.
OPTIMS_LATER = [
    ("rmsprop", dict(lr=0.01)),
    ("rmsprop", dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.05, momentum=0.8)),
    ("rmsprop", dict(lr=0.02, centered=True)),
    ("rmsprop", dict(lr=0.01, alpha=0.95, centered=True, momentum=0.5, weight_decay=0.1)),
    ("adagrad", dict(lr=0.1)),
    ("adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.02, initial_accumulator_value=0.3,
                     eps=1e-6)),
]
for kind, cfg in OPTIMS_LATER:
    ins = [("p", randn(3, 4), False)] + [(f"g{k}", randn(3, 4), False) for k in range(OPT_STEPS)]
    case("optim", ins, torch_optim(kind, cfg), kind=kind, steps=OPT_STEPS, **cfg)


# Parameter groups: a weight (the optimizer's own rate and decay) and a bias in a group of its
# own rate and no decay, under a StepLR that halves every 3 steps.
def torch_groups(kind, cfg, group):
    def fn(t):
        w = t["w"].detach().clone().requires_grad_(True)
        b = t["b"].detach().clone().requires_grad_(True)
        make = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW,
                "rmsprop": torch.optim.RMSprop}[kind]
        opt = make([{"params": [w]}, {"params": [b], **group}], **cfg)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        for k in range(OPT_STEPS):
            w.grad, b.grad = t[f"gw{k}"].clone(), t[f"gb{k}"].clone()
            opt.step()
            sched.step()
        return [w.detach(), b.detach()]
    return fn


GROUPS = [
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.1), dict(lr=0.3, weight_decay=0.0)),
    ("adamw", dict(lr=0.01, weight_decay=0.2), dict(weight_decay=0.0)),
    ("rmsprop", dict(lr=0.01, weight_decay=0.05), dict(lr=0.002)),
]
for kind, cfg, group in GROUPS:
    ins = [("w", randn(3, 4), False), ("b", randn(3), False)]
    for k in range(OPT_STEPS):
        ins += [(f"gw{k}", randn(3, 4), False), (f"gb{k}", randn(3), False)]
    case("optim_groups", ins, torch_groups(kind, cfg, group), kind=kind, steps=OPT_STEPS,
         **cfg, **{f"group_{k}": v for k, v in group.items()})

case("lr_schedule", [], torch_lrs(lambda o: S.MultiStepLR(o, [2, 5, 6], 0.5), 9, 0.1),
     kind="multi_step", base=0.1, milestones=[2, 5, 6], gamma=0.5, steps=9)


# ReduceLROnPlateau: the rate after each epoch's metric. The metrics improve, stall, improve
# a little (within or past the threshold), and hold NaN once.
def torch_plateau(cfg):
    def fn(t):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        sched = S.ReduceLROnPlateau(opt, **cfg)
        lrs = []
        for m in t["m"].tolist():
            sched.step(m)
            lrs.append(opt.param_groups[0]["lr"])
        return [torch.tensor(lrs, dtype=torch.float64)]
    return fn


METRICS = torch.tensor([1.0, 0.9, 0.9, 0.95, 0.89995, 0.9, 0.5, 0.6, float("nan"), 0.7, 0.7,
                        0.45, 0.46, 0.47, 0.48, 0.49, 0.5, 0.51, 0.52])
PLATEAUS = [
    dict(patience=1),
    dict(patience=2, factor=0.5, cooldown=1, min_lr=0.02),
    dict(mode="max", patience=1, factor=0.3, threshold=0.05, threshold_mode="abs"),
    dict(patience=0, threshold=0.1, threshold_mode="rel", cooldown=2),
]
for cfg in PLATEAUS:
    case("plateau", [("m", METRICS.clone(), False)], torch_plateau(cfg), **cfg)

# The everyday ops added with them: indexing views, scans and reductions made of other ops,
# creation. Each reduction and scan also in f16 and bf16, and on a transposed input.
LATER_OPS = [
    ("select", [3, 4], dict(dim=1, index=-1), lambda x: x.select(1, -1)),
    ("select", [3, 4, 2], dict(dim=0, index=2), lambda x: x.select(0, 2)),
    ("slice", [10, 3], dict(dim=0, start=1, end=-2, step=3), lambda x: x[1:-2:3]),
    ("slice", [4, 9], dict(dim=-1, start=-7, end=100, step=2), lambda x: x[:, -7:100:2]),
    ("slice", [5, 4], dict(dim=0, start=-2, step=1), lambda x: x[-2:]),
    ("slice", [5, 4], dict(dim=0, start=4, end=1, step=1), lambda x: x[4:1]),
    ("chunk", [7, 3], dict(chunks=3, dim=0), lambda x: list(x.chunk(3, 0))),
    ("chunk", [2, 6], dict(chunks=4, dim=1), lambda x: list(x.chunk(4, 1))),
    ("view", [2, 3, 4], dict(shape=[4, -1]), lambda x: x.view(4, -1)),
    ("repeat", [2, 3], dict(repeats=[2, 1, 3]), lambda x: x.repeat(2, 1, 3)),
    ("repeat", [3], dict(repeats=[4]), lambda x: x.repeat(4)),
    ("cumsum", [5, 6], dict(dim=1), lambda x: x.cumsum(1)),
    ("cumsum", [9, 2], dict(dim=0), lambda x: x.cumsum(0)),
    ("prod", [3, 5], dict(dim=1, keepdim=0), lambda x: x.prod(1)),
    ("prod", [4, 3], dict(dim=0, keepdim=1), lambda x: x.prod(0, keepdim=True)),
    ("prod_all", [2, 3], {}, lambda x: x.prod()),
    ("logsumexp", [3, 5], dict(dims=[1], keepdim=0), lambda x: x.logsumexp(1)),
    ("logsumexp", [2, 3, 4], dict(dims=[0, 2], keepdim=1),
     lambda x: x.logsumexp((0, 2), keepdim=True)),
]
for name, shp, params, fn in LATER_OPS:
    ins = [("x", randn(*shp), True)]
    wrap = (lambda fn: lambda t: (lambda y: y if isinstance(y, list) else [y])(fn(t["x"])))(fn)
    case(name, ins, wrap, **params)
    if name in ("cumsum", "prod", "logsumexp"):
        ins_t = [("x", ins[0][1].transpose(-1, -2).contiguous(), True)]
        case(name, ins_t, wrap, T=["x"], **params)
        for dn, dt in HALF.items():
            case(name, [("x", ins[0][1].to(dt).float(), True)], wrap, dtype=dn, **params)
# A product through zeros: the gradient PyTorch gives there (nonzero where one zero sits).
zeros_in = torch.tensor([[2.0, 0.0, 3.0, -1.0], [0.0, 0.0, 1.5, 2.0], [1.0, 2.0, 3.0, 4.0]])
case("prod", [("x", zeros_in, True)], lambda t: [t["x"].prod(1)], dim=1, keepdim=0)
# Infinite slices: -inf everywhere gives -inf, one +inf gives +inf.
inf_in = torch.tensor([[float("-inf")] * 3, [1.0, float("inf"), 2.0], [1.0, 2.0, 3.0]])
case("logsumexp", [("x", inf_in, False)], lambda t: [t["x"].logsumexp(1)], dims=[1], keepdim=0)
bools = torch.tensor([[1.0, 0.0, 2.0], [3.0, 4.0, float("nan")], [0.0, 0.0, 0.0]])
for op in ("all", "any"):
    for dims, keep in (([1], 0), ([0], 1), ([], 0)):
        f = (lambda op, dims, keep: lambda t: [
            (getattr(t["x"], op)(dim=tuple(dims), keepdim=bool(keep)) if dims
             else getattr(t["x"], op)()).to(torch.uint8)])(op, dims, keep)
        case(op, [("x", bools.clone(), False)], f, dims=dims, keepdim=keep)
case("eye", [], lambda t: [torch.eye(3, 5)], n=3, m=5)
case("eye", [], lambda t: [torch.eye(4, 2)], n=4, m=2)
for a, b, n in ((0.0, 1.0, 5), (-2.5, 7.0, 8), (3.0, -1.0, 1), (1.0, 2.0, 0)):
    case("linspace", [], (lambda a, b, n: lambda t: [torch.linspace(a, b, n)])(a, b, n),
         start=a, end=b, steps=n)
# Where PyTorch raises: a slice step of 0, an index past the end, a view of a transposed
# tensor's memory.
case("select", [("x", randn(3, 4), False)], lambda t: [t["x"].select(1, 4)], dim=1, index=4)
case("view_t", [("x", randn(3, 4), False)], lambda t: [t["x"].t().view(12)], shape=[12])

# Layers added with them: Conv1d, BatchNorm1d (2-D and 3-D input), GroupNorm; and the
# functional forms with options and in half precision.
module_case("conv1d", lambda: torch.nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=1,
                                              groups=2),
            [randn(2, 4, 9)], fan_in=4, fan_out=6, kernel=3, stride=2, padding=1, groups=2)
module_case("batch_norm1d", lambda: torch.nn.BatchNorm1d(3),
            [randn(5, 3) * 2 + 1, randn(4, 3, 6) - 1, randn(2, 3)],
            calls=("train", "train", "eval"), channels=3)
module_case("group_norm", lambda: torch.nn.GroupNorm(2, 6), [randn(3, 6, 5) * 3 + 1],
            groups=2, channels=6)
for dn, dt in [("f32", None)] + list(HALF.items()):
    rd = (lambda x: x) if dt is None else (lambda x, dt=dt: x.to(dt).float())
    extra = {} if dt is None else {"dtype": dn}
    case("conv1d", [("x", rd(randn(2, 4, 11)), True), ("w", rd(randn(6, 2, 3)), True),
                    ("b", rd(randn(6)), True)],
         lambda t: [F.conv1d(t["x"], t["w"], t["b"], stride=2, padding=2, dilation=2,
                             groups=2)],
         stride=2, padding=2, dilation=2, groups=2, **extra)
    case("group_norm", [("x", rd(randn(2, 6, 4)), True), ("w", rd(randn(6)), True),
                        ("b", rd(randn(6)), True)],
         lambda t: [F.group_norm(t["x"], 3, t["w"], t["b"], 1e-5)], groups=3, **extra)
case("conv1d", [("x", randn(4, 7), True), ("w", randn(5, 4, 2), True)],
     lambda t: [F.conv1d(t["x"], t["w"])], stride=1, padding=0, dilation=1, groups=1)

# Attention: F.scaled_dot_product_attention (masks, causal, scale; f16/bf16) and
# nn.MultiheadAttention loaded by its state_dict names.
def sdpa(mask=None, causal=False, scale=None):
    def fn(t):
        m = t.get("mask")
        if m is not None and m.dtype == torch.uint8:
            m = m.bool()
        return [F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=m,
                                               is_causal=causal, scale=scale)]
    return fn


SDPA = [
    ({}, None),
    (dict(is_causal=1), None),
    (dict(scale=0.3), None),
    ({}, "float"),
    ({}, "bool"),
]
for params, mask in SDPA:
    ins = [("q", randn(2, 3, 5, 4), True), ("k", randn(2, 3, 6, 4), True),
           ("v", randn(2, 3, 6, 3), True)]
    if params.get("is_causal"):
        ins[1] = ("k", randn(2, 3, 5, 4), True)
        ins[2] = ("v", randn(2, 3, 5, 3), True)
    if mask == "float":
        ins.append(("mask", randn(5, 6), False))
    if mask == "bool":
        keep = (torch.rand(2, 1, 5, 6) > 0.3)
        keep[..., 0] = True  # every row attends somewhere
        ins.append(("mask", keep.to(torch.uint8), False))
    fn = sdpa(causal=bool(params.get("is_causal")), scale=params.get("scale"))
    case("sdpa", ins, fn, **params)
    if not params and mask is None:
        for dn, dt in HALF.items():
            case("sdpa", [(n, x.to(dt).float(), g) for n, x, g in ins], fn, dtype=dn)


def mha_case(batch_first, padding, causal):
    torch.manual_seed(rng.randrange(1 << 30))
    m = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    state = {k: v.detach().float().clone() for k, v in m.state_dict().items()}
    x = randn(2, 5, 8) if batch_first else randn(5, 2, 8)
    ins = [(f"p.{k}", v, True) for k, v in state.items()] + [("x0", x, True)]
    if padding:
        pad = torch.zeros(2, 5, dtype=torch.uint8)
        pad[1, 3:] = 1
        ins.append(("kpm", pad, False))

    def fn(t):
        mod = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
        tensors = {k: t[f"p.{k}"] for k in state}
        kw = dict(need_weights=False)
        if padding:
            kw["key_padding_mask"] = t["kpm"].bool()
        if causal:
            kw["attn_mask"] = torch.ones(5, 5).triu(1).bool()
        x = t["x0"]
        y, _ = torch.func.functional_call(mod, tensors, (x, x, x), kw)
        return [y]
    case("mha", ins, fn, batch_first=batch_first, padding=padding, causal=causal)


for bf, pad, causal in [(True, False, False), (False, True, False), (True, True, True)]:
    mha_case(bf, pad, causal)

# Sorting: argsort and sort (stable: ties keep their order; NaN the largest value; -0 equals
# 0), along the last, a middle and the first dim, in f16/bf16 and i64; rows longer than the
# CUDA kernel's shared-memory sort (2048); topk on distinct values (PyTorch's order among
# equal values is unspecified), largest and smallest; a k past the dim's size.
ties = torch.tensor([[1.0, float("nan"), 0.0, 1.0, -0.0, 0.0, 2.0],
                     [3.0, 3.0, -1.0, float("nan"), float("nan"), 0.5, 3.0]])


def sort_fn(dim, desc):
    return lambda t: list(torch.sort(t["x"], dim=dim, descending=bool(desc), stable=True))


def distinct(*shape):
    n = math.prod(shape)
    return ((torch.randperm(n) - n // 2).float() * 0.25).reshape(shape)


for desc in (0, 1):
    case("argsort", [("x", ties.clone(), False)],
         lambda t, d=desc: [torch.argsort(t["x"], dim=1, descending=bool(d), stable=True)],
         dim=1, descending=desc)
    case("sort", [("x", ties.clone(), True)], sort_fn(-1, desc), dim=-1, descending=desc)
    case("sort", [("x", randn(3, 5, 4), True)], sort_fn(1, desc), dim=1, descending=desc)
    case("sort", [("x", randn(6, 3), True)], sort_fn(0, desc), dim=0, descending=desc)
    case("sort", [("x", torch.randint(-3, 4, (4, 9)), False)],
         sort_fn(1, desc), dim=1, descending=desc)
    for dn, dt in HALF.items():
        case("sort", [("x", randn(4, 33).to(dt).float(), True)], sort_fn(1, desc),
             dim=1, descending=desc, dtype=dn)
case("sort", [("x", randn(3, 1500), True)], sort_fn(-1, 0), dim=-1, descending=0)
case("sort", [("x", randn(2, 2100), True)], sort_fn(1, 1), dim=1, descending=1)
case("argsort", [("x", torch.randint(0, 5, (2100,)), False)],
     lambda t: [torch.argsort(t["x"], dim=0, stable=True)], dim=0, descending=0)
for k, dim, largest in ((3, 1, 1), (2, 0, 0), (5, -1, 0), (0, 1, 1), (5, 1, 1)):
    x = distinct(4, 5)
    case("topk", [("x", x, True)],
         lambda t, k=k, d=dim, l=largest: list(torch.topk(t["x"], k, dim=d, largest=bool(l))),
         k=k, dim=dim, largest=largest)
for dn, dt in HALF.items():
    case("topk", [("x", distinct(3, 40).to(dt).float(), True)],
         lambda t: list(torch.topk(t["x"], 7, dim=1)), k=7, dim=1, largest=1, dtype=dn)
case("topk", [("x", distinct(2, 2100), True)],
     lambda t: list(torch.topk(t["x"], 10, dim=1, largest=False)), k=10, dim=1, largest=0)

# nn.GRU loaded by its state_dict names: one layer sequence-first, two layers batch-first.
for layers, batch_first in [(1, False), (2, True)]:
    xs = [randn(3, 4, 5) if batch_first else randn(4, 3, 5)]
    module_case("gru", lambda l=layers, b=batch_first: torch.nn.GRU(5, 6, l, batch_first=b),
                xs, fan_in=5, hidden=6, layers=layers, batch_first=batch_first)
torch.set_rng_state(_rng_before)

# ---- run and write -----------------------------------------------------------------------


def run(op, params, inputs, fn):
    # Inputs named in T are stored transposed (last two dims); the op gets the transposed
    # view of the stored leaf, and the gradient is the leaf's.
    t, leaves = {}, {}
    for name, x, grad in inputs:
        x = x.double() if x.is_floating_point() else x
        leaves[name] = x.requires_grad_(grad) if grad else x
        t[name] = leaves[name].transpose(-1, -2) if name in params.get("T", []) else leaves[name]
    outs = fn(t)
    tensors = {f"in.{name}": x for name, x, _ in inputs}
    loss = 0
    for k, y in enumerate(outs):
        tensors[f"out.{k}"] = y.detach()
        if y.is_floating_point() and y.requires_grad:
            g = torch.randn(y.shape, dtype=torch.float32)
            tensors[f"gout.{k}"] = g
            loss = loss + (y * g.double()).sum()
    if torch.is_tensor(loss):
        loss.backward()
        for name, x, grad in inputs:
            if grad and leaves[name].grad is not None:
                tensors[f"grad.{name}"] = leaves[name].grad
    return tensors


def dtype_code(x):
    return {torch.float32: "F32", torch.float64: "F32", torch.int64: "I64",
            torch.uint8: "U8"}[x.dtype]


def main():
    header, blobs, offset, meta = {}, [], 0, {}
    errors = 0
    for n, (op, params, inputs, fn) in enumerate(cases):
        spec = {"op": op, "in": [name for name, _, _ in inputs],
                "grad": [name for name, _, g in inputs if g], **params}
        try:
            tensors = run(op, params, inputs, fn)
        except (RuntimeError, ValueError, IndexError) as e:
            spec["err"] = True
            errors += 1
            if "-v" in sys.argv:
                print(f"case {n} {op} {params}: {str(e).splitlines()[0]}", file=sys.stderr)
            tensors = {f"in.{name}": x for name, x, _ in inputs}
        meta[f"case.{n}"] = " ".join(f"{k}={csv(v)}" for k, v in spec.items())
        for name, x in tensors.items():
            x = x.detach().contiguous()
            if x.dtype == torch.float64:
                x = x.float()
            data = x.numpy().tobytes()
            header[f"{n}.{name}"] = {"dtype": dtype_code(x), "shape": list(x.shape),
                                     "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    print(f"{len(cases)} cases ({errors} where PyTorch raises), {offset} bytes of tensors, "
          f"torch {torch.__version__}: {path}")


if __name__ == "__main__":
    main()
