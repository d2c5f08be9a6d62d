"""PyTorch peer of M1 (BENCHMARKS.md): torch.matmul TFLOP/s on n^3 GEMMs in bf16, fp16 and f32
with TF32 allowed, median of 10 CUDA-event-timed runs after 3 warm-ups, N(0, 1) operands.
Compare with the GEMM line of `examples/gpu_check` from the same session.

    python3 bench/matmul_peer_cuda.py --n 8192
"""
import argparse

import torch


def tflops(n, dtype):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return 2 * n**3 / (times[5] * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    n = ap.parse_args().n
    torch.backends.cuda.matmul.allow_tf32 = True
    r = {name: tflops(n, dt) for name, dt in
         [("bf16", torch.bfloat16), ("fp16", torch.float16), ("f32 with TF32", torch.float32)]}
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()} GEMM {n}^3: "
          + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in r.items()))


if __name__ == "__main__":
    main()
