"""PyTorch peer of `gpu_check --attention`'s GPT-2 line: causal attention forward + backward
on [16, 12, 1024, 64] bf16 through each of PyTorch's SDPA backends that takes it (cuDNN's
fused attention, FlashAttention-2, memory-efficient, math), median of five timings of ten
steps after three warm-ups, in ms and TFLOP/s by FlashAttention's count (4 b h l^2 e forward,
2.5 times that backward, halved when causal), as gpu_check counts.

    python3 bench/attention_peer.py [--shape 16,12,1024,64] [--dtype bf16] [--no-causal]
"""
import argparse
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16,12,1024,64")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--no-causal", action="store_true")
    args = ap.parse_args()
    n, h, l, e = (int(x) for x in args.shape.split(","))
    causal = not args.no_causal
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, g = (torch.randn(n, h, l, e, device="cuda", dtype=dt, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    flops = 3.5 * 4.0 * n * h * e * l * l / (2.0 if causal else 1.0)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):

        def step():
            with sdpa_kernel(backend):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            y.backward(g)
            for t in (q, k, v):
                t.grad = None

        try:
            for _ in range(3):
                step()
        except RuntimeError as err:
            print(f"torch attention [{n}, {h}, {l}, {e}] {args.dtype} {backend.name}: not taken "
                  f"({str(err).splitlines()[0][:120]})")
            continue
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / 10)
        ms = sorted(times)[2]
        print(f"torch {torch.__version__} attention [{n}, {h}, {l}, {e}] {args.dtype}"
              f"{' causal' if causal else ''} forward + backward, {backend.name}: {ms:.3f} ms "
              f"({flops / ms / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
