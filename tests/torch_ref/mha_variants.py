#!/usr/bin/env python3
"""Writes tests/torch_ref/mha_variants.safetensors: nn.MultiheadAttention in each of its
variants (separate kdim/vdim projections, add_bias_kv, add_zero_attn, no bias, unbatched
inputs, weights averaged or per head, boolean and float masks), for tests/mha_variants.rs.

Every parameter and input is an f32 value; PyTorch computes in float64 from them the output,
the attention weights, and the gradients of sum(y * gy) + sum(w * gw) for the query, key,
value and every parameter. Tensors are named `<case>.<kind>.<name>`; the case's constructor
and forward arguments are in the metadata as `key=value` lists.

Regenerate (PyTorch on the CPU is enough):  python3 tests/torch_ref/mha_variants.py
"""
import json
import os
import struct

import torch

torch.manual_seed(20261129)

CASES = [
    # name, constructor keywords, forward keywords, (L, S, N or None for unbatched), masks
    ("packed", dict(batch_first=False), dict(need_weights=True), (3, 4, 2), ("kpm_bool",)),
    ("kdim_vdim_per_head", dict(kdim=6, vdim=5, batch_first=True),
     dict(need_weights=True, average_attn_weights=False), (3, 4, 2), ("attn_bool",)),
    ("bias_kv_zero_attn", dict(add_bias_kv=True, add_zero_attn=True),
     dict(need_weights=True), (3, 4, 2), ("kpm_bool", "attn_float3")),
    ("unbatched", dict(), dict(need_weights=True), (3, 4, None), ("kpm_bool",)),
    ("no_bias", dict(bias=False, batch_first=True), dict(need_weights=False), (3, 4, 2),
     ("attn_float",)),
    ("unbatched_kdim_zero_attn", dict(kdim=6, vdim=5, add_zero_attn=True, add_bias_kv=True),
     dict(need_weights=True, average_attn_weights=False), (2, 5, None), ("attn_float3",)),
    ("weights_not_needed_kv", dict(kdim=3, vdim=7), dict(need_weights=False), (4, 3, 2),
     ("kpm_float",)),
]
E, H = 8, 2


def f32(t):
    return t.float().double()


def main():
    header, blobs, meta, offset = {}, [], {}, 0

    def put(name, x):
        nonlocal offset
        x = x.detach().contiguous()
        if x.dtype == torch.bool:
            code, data = "U8", bytes(int(v) for v in x.flatten().tolist())
        else:
            vals = x.flatten().tolist()
            code, data = "F32", struct.pack(f"<{len(vals)}f", *vals)
        header[name] = {"dtype": code, "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)

    for name, ctor, fwd, (L, S, N), masks in CASES:
        m = torch.nn.MultiheadAttention(E, H, **ctor).double()
        with torch.no_grad():
            for p in m.parameters():
                # Nonzero biases, so that their gradients and effects are checked.
                p.copy_(f32(torch.randn_like(p) * 0.5))
        kdim, vdim = ctor.get("kdim", E), ctor.get("vdim", E)
        bf = ctor.get("batch_first", False)

        def shape(T, F):
            if N is None:
                return (T, F)
            return (N, T, F) if bf else (T, N, F)

        q = f32(torch.randn(shape(L, E))).requires_grad_()
        k = f32(torch.randn(shape(S, kdim))).requires_grad_()
        v = f32(torch.randn(shape(S, vdim))).requires_grad_()
        n = N or 1
        kw = dict(fwd)
        for mk in masks:
            if mk == "kpm_bool":
                kpm = torch.zeros(n, S, dtype=torch.bool)
                kpm[-1, -2:] = True  # the last sequence's last two keys are padding
                kw["key_padding_mask"] = kpm if N else kpm[0]
            elif mk == "kpm_float":
                kw["key_padding_mask"] = f32(torch.randn(n, S))
            elif mk == "attn_bool":
                kw["attn_mask"] = torch.ones(L, S, dtype=torch.bool).triu(1)
            elif mk == "attn_float":
                kw["attn_mask"] = f32(torch.randn(L, S))
            elif mk == "attn_float3":
                kw["attn_mask"] = f32(torch.randn(n * H, L, S))
        y, w = m(q, k, v, **kw)
        gy = f32(torch.randn_like(y))
        loss = (y * gy).sum()
        if w is not None:
            gw = f32(torch.randn_like(w))
            loss = loss + (w * gw).sum()
            put(f"{name}.out.w", w)
            put(f"{name}.g.w", gw)
        loss.backward()
        put(f"{name}.out.y", y)
        put(f"{name}.g.y", gy)
        for t, tn in ((q, "query"), (k, "key"), (v, "value")):
            put(f"{name}.in.{tn}", t)
            put(f"{name}.grad.{tn}", t.grad)
        for mk in ("key_padding_mask", "attn_mask"):
            if mk in kw:
                put(f"{name}.in.{mk}", kw[mk])
        for pn, p in m.state_dict().items():
            put(f"{name}.param.{pn}", p)
        for pn, p in m.named_parameters():
            put(f"{name}.pgrad.{pn}", p.grad)
        spec = {**{"batch_first": False, "bias": True, "add_bias_kv": False,
                   "add_zero_attn": False, "kdim": E, "vdim": E}, **ctor,
                **{"need_weights": True, "average_attn_weights": True}, **fwd}
        meta[f"case.{name}"] = " ".join(f"{k}={int(v)}" for k, v in spec.items())
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mha_variants.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    print(f"{len(CASES)} cases, {offset} bytes of tensors, torch {torch.__version__}: {path}")


if __name__ == "__main__":
    main()
