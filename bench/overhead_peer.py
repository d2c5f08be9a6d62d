"""PyTorch peer of `bench_cpu overhead` (M4 of BENCHMARKS.md, on the CPU): the host's cost per op on
one-element tensors, eager, no grad and recorded, and a chain of 1000 recorded ops with its
backward pass. Median of 5 runs after 2 warm-ups, as bench_cpu times.

    python3 bench/overhead_peer.py --threads 2
"""
import argparse
import statistics
import time

import torch


def median_time(f, runs=5):
    f()
    f()
    t = []
    for _ in range(runs):
        s = time.perf_counter()
        f()
        t.append(time.perf_counter() - s)
    return statistics.median(t)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = 10_000
    a = torch.tensor([1.5])
    b = torch.tensor([0.25])

    def adds(x, y):
        for _ in range(n):
            torch.add(x, y)

    s = median_time(lambda: adds(a, b))
    print(f"{'us per tiny add, no grad':<44} {s / n * 1e6:>10.3f}")
    ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
    s = median_time(lambda: adds(ga, gb))
    print(f"{'us per tiny add, recorded':<44} {s / n * 1e6:>10.3f}")
    chain = 1000
    back = [0.0]

    def run_chain():
        y = ga
        for k in range(chain):
            y = y * gb if k % 2 == 0 else y + gb
        t = time.perf_counter()
        y.backward()
        back[0] = time.perf_counter() - t

    s = median_time(run_chain)
    print(f"{'us per op, chain forward+backward':<44} {s / chain * 1e6:>10.3f}")
    print(f"{'us per op, chain backward (last run)':<44} {back[0] / chain * 1e6:>10.3f}")


if __name__ == "__main__":
    main()
