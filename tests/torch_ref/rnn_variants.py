#!/usr/bin/env python3
"""Writes tests/torch_ref/rnn_variants.safetensors: PyTorch's nn.GRU and nn.LSTM in their
variants (bidirectional, bias=False, proj_size, unbatched input, batch_first, dropout in eval
mode, given initial states, and combinations), for tests/rnn_variants.rs.

Each case builds the module in f32 from a fixed seed and draws f32 inputs; PyTorch then runs
it in float64 from those same values (the module converted with .double(), exact), forward and
backward of sum(out * g) + sum(h_n * gh) (+ sum(c_n * gc) for the LSTM), with g, gh, gc random.
Stored per case `N.`: the state_dict under PyTorch's names (`N.p.weight_ih_l0`, ...), the
inputs (`N.x`, `N.h0`, `N.c0`, `N.g`, `N.gh`, `N.gc`), the outputs (`N.out.y`, `N.out.h`,
`N.out.c`) and the gradients (`N.grad.x`, `N.grad.h0`, `N.grad.c0`, `N.grad.p.<name>`), all as
f32. The metadata `case.N` is the case's configuration as `key=value` words.

Regenerate (PyTorch on the CPU is enough):  python3 tests/torch_ref/rnn_variants.py
"""
import json
import os
import struct

import torch

SEED = 20260541

# (kind, input, hidden, options, unbatched, given initial state, mode)
CASES = [
    ("gru", 4, 5, dict(num_layers=2, bidirectional=True), False, False, "train"),
    ("lstm", 4, 5, dict(num_layers=2, bidirectional=True, batch_first=True), False, False,
     "train"),
    ("gru", 3, 6, dict(num_layers=2, bias=False), False, True, "train"),
    ("lstm", 3, 6, dict(num_layers=2, bias=False), False, True, "train"),
    ("lstm", 4, 5, dict(num_layers=2, proj_size=3), False, False, "train"),
    ("lstm", 4, 6, dict(num_layers=2, proj_size=2, bidirectional=True, batch_first=True,
                        bias=False), False, True, "train"),
    ("gru", 3, 4, dict(num_layers=2, bidirectional=True), True, True, "train"),
    ("lstm", 3, 5, dict(num_layers=2, proj_size=3), True, True, "train"),
    ("lstm", 3, 4, dict(batch_first=True), True, False, "train"),
    ("gru", 2, 3, dict(num_layers=3, batch_first=True), False, True, "train"),
    ("lstm", 4, 3, dict(bidirectional=True), False, True, "train"),
    ("gru", 4, 5, dict(num_layers=2, bidirectional=True, batch_first=True, bias=False), False,
     False, "train"),
    # Dropout between layers acts in training only: in eval mode the outputs are the
    # dropout-free ones.
    ("gru", 3, 4, dict(num_layers=3, dropout=0.5, bidirectional=True), False, False, "eval"),
    ("lstm", 3, 5, dict(num_layers=2, dropout=0.3, proj_size=2), False, True, "eval"),
]

SEQ, BATCH = 5, 3


def randn(*shape):
    return torch.randn(shape, dtype=torch.float32)


def csv(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def run_case(n, kind, inp, hidden, opts, unbatched, given, mode):
    torch.manual_seed(SEED + n)
    make = {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[kind]
    m = make(inp, hidden, **opts)
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    m = m.double()
    m.train(mode == "train")
    layers = opts.get("num_layers", 1) * (2 if opts.get("bidirectional") else 1)
    h_out = opts.get("proj_size", 0) or hidden
    batch_first = opts.get("batch_first", False)
    if unbatched:
        x = randn(SEQ, inp)
    elif batch_first:
        x = randn(BATCH, SEQ, inp)
    else:
        x = randn(SEQ, BATCH, inp)
    lead = [layers] if unbatched else [layers, BATCH]
    ins = {"x": x}
    if given:
        ins["h0"] = randn(*lead, h_out)
        if kind == "lstm":
            ins["c0"] = randn(*lead, hidden)
    leaves = {k: v.double().requires_grad_(True) for k, v in ins.items()}
    if kind == "lstm":
        hx = (leaves["h0"], leaves["c0"]) if given else None
        y, (h, c) = m(leaves["x"], hx)
        outs = {"y": y, "h": h, "c": c}
    else:
        y, h = m(leaves["x"], leaves.get("h0"))
        outs = {"y": y, "h": h}
    grads_out = {"g": randn(*y.shape), "gh": randn(*h.shape)}
    if kind == "lstm":
        grads_out["gc"] = randn(*outs["c"].shape)
    loss = (y * grads_out["g"].double()).sum() + (h * grads_out["gh"].double()).sum()
    if kind == "lstm":
        loss = loss + (outs["c"] * grads_out["gc"].double()).sum()
    loss.backward()
    tensors = {f"p.{k}": v for k, v in state.items()}
    tensors.update(ins)
    tensors.update(grads_out)
    tensors.update({f"out.{k}": v for k, v in outs.items()})
    tensors.update({f"grad.{k}": leaves[k].grad for k in ins})
    tensors.update({f"grad.p.{k}": p.grad for k, p in m.named_parameters()})
    spec = dict(kind=kind, input=inp, hidden=hidden, num_layers=opts.get("num_layers", 1),
                bias=opts.get("bias", True), batch_first=batch_first,
                dropout=opts.get("dropout", 0.0), bidirectional=opts.get("bidirectional", False),
                proj_size=opts.get("proj_size", 0), unbatched=unbatched, given=given, mode=mode)
    return spec, tensors


def main():
    header, blobs, offset, meta = {}, [], 0, {}
    for n, case in enumerate(CASES):
        spec, tensors = run_case(n, *case)
        meta[f"case.{n}"] = " ".join(f"{k}={csv(v)}" for k, v in spec.items())
        for name, x in tensors.items():
            v = x.detach().float().flatten().tolist()
            data = struct.pack(f"<{len(v)}f", *v)
            header[f"{n}.{name}"] = {"dtype": "F32", "shape": list(x.shape),
                                     "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rnn_variants.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    print(f"{len(CASES)} cases, {offset} bytes of tensors, torch {torch.__version__}: {path}")


if __name__ == "__main__":
    main()
