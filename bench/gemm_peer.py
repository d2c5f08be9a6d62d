"""PyTorch peer of `examples/bench_cpu.rs`'s "W1 step's 8 matmuls" row: the products of one
W1 training step (MLP 784-512-512-10, batch 128) in the layouts training uses, median of 15
timed runs after two warm-ups.

    python3 bench/gemm_peer.py --threads 2
"""
import argparse
import time

import torch

SHAPES = [  # (m, n, k, a transposed, b transposed)
    (128, 512, 784, False, True),
    (128, 512, 512, False, True),
    (128, 10, 512, False, True),
    (128, 512, 10, False, False),
    (10, 512, 128, True, False),
    (128, 512, 512, False, False),
    (512, 512, 128, True, False),
    (512, 784, 128, True, False),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = []
    for m, n, k, ta, tb in SHAPES:
        a = torch.randn(k, m).t() if ta else torch.randn(m, k)
        b = torch.randn(n, k).t() if tb else torch.randn(k, n)
        ops.append((a, b))

    def step():
        for a, b in ops:
            torch.mm(a, b)

    step()
    step()
    times = []
    for _ in range(15):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    s = times[len(times) // 2]
    flops = sum(2 * m * n * k for m, n, k, _, _ in SHAPES)
    print(f"torch {torch.__version__} W1 step's 8 matmuls F32: {s * 1e3:.2f} ms "
          f"{flops / s / 1e9:.1f} GFLOP/s ({args.threads} threads)")


if __name__ == "__main__":
    main()
