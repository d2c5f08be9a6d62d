#!/usr/bin/env python3
"""The summary of `bench/gpu_session.sh all`: each check's exit status, then one Markdown
table of named figures (figure, ours, peer, ratio) read from the runs' output, to paste as it
is. gpu_session.sh's `acc` leaves each run's output in RUNS/run.NAME and its exit status (or
`skipped`) in RUNS/rc.NAME.

    python3 bench/session_summary.py RUNS [--device NAME] [--commit ID]

A figure whose run was skipped, failed or printed no such line reads `-`, with the reason.
Ratios are ours / peer: above 1 is faster for a rate, larger for memory.
"""
import argparse
import os
import re

NUM = r"([0-9]+(?:\.[0-9]+)?)"
# What to read from a run's output: the last match of the pattern, its first group.
IMAGES = NUM + r" images/s"
TOKENS = NUM + r" training tokens/s"
# The mnist example's per-epoch line (its progress bar also says samples/s), and the peer's.
OUR_SAMPLES = r"^epoch [0-9]+: .*\| [0-9.]+ s, " + NUM + r" samples/s"
PEER_SAMPLES = r"^torch .* epoch [0-9]+: " + NUM + r" samples/s"
PEAK = r"peak allocated " + NUM + r" MiB"

# (figure, our run, its pattern, the peer's run, its pattern); run names as gpu_session.sh's
# `all` gives them.
FIGURES = [
    ("W3 ResNet-50 fp16, images/s", "w3-fp16", IMAGES, "w3-fp16-peer", IMAGES),
    ("W3 ResNet-50 bf16, images/s", "w3-bf16", IMAGES, "w3-bf16-peer", IMAGES),
    ("W3 ResNet-50 fp32, images/s", "w3-fp32", IMAGES, "w3-fp32-peer", IMAGES),
    ("W3 fp16 --fuse-conv-bn, images/s", "w3-fp16-fuse", IMAGES, "w3-fp16-peer", IMAGES),
    ("W3 fp16 beside torch.compile, images/s", "w3-fp16", IMAGES, "w3-fp16-compile", IMAGES),
    ("W3 fp16 peak allocated, MiB", "w3-fp16", PEAK, "w3-fp16-peer", PEAK),
    ("W3 bf16 peak allocated, MiB", "w3-bf16", PEAK, "w3-bf16-peer", PEAK),
    ("W3 fp32 peak allocated, MiB", "w3-fp32", PEAK, "w3-fp32-peer", PEAK),
    ("W1 MLP fp16 --cuda-graph, samples/s", "w1-graph", OUR_SAMPLES, "w1-peer", PEER_SAMPLES),
    ("W2 MNIST CNN fp16 --cuda-graph, samples/s", "w2-graph", OUR_SAMPLES, "w2-peer",
     PEER_SAMPLES),
    ("W4 LSTM fp16 --cuda-graph, tokens/s", "w4-graph", TOKENS, "w4-peer", TOKENS),
    ("W4 LSTM fp16 --cuda-graph peak allocated, MiB", "w4-graph", PEAK, "w4-peer", PEAK),
    ("W3 fp16 under torchrun, world of one (peer: ours without the wrapper), images/s",
     "w3-ddp", IMAGES, "w3-fp16", IMAGES),
]

# The correctness runs, most important first.
CHECKS = ["gpu_check", "test-suite", "test-cuda_graph", "test-cuda_fusions",
          "test-torch_reference", "cnn-graph", "cnn-eager", "losses-identical"]


def read(runs, name, what):
    """The file RUNS/WHAT.NAME, or None."""
    try:
        with open(os.path.join(runs, f"{what}.{name}"), errors="replace") as f:
            return f.read()
    except OSError:
        return None


def status(runs, name):
    """`rc=N`, `skipped` or `not run`."""
    rc = read(runs, name, "rc")
    if rc is None:
        return "not run"
    rc = rc.strip()
    return rc if rc == "skipped" else f"rc={rc}"


def value(runs, name, pattern):
    """The figure the run printed last, or None."""
    out = read(runs, name, "run")
    if out is None:
        return None
    found = None
    for line in re.split(r"[\r\n]+", out):
        m = re.search(pattern, line)
        if m:
            found = float(m.group(1))
    return found


def cell(runs, name, pattern):
    """A table cell: the figure, or `-` with why."""
    v = value(runs, name, pattern)
    if v is not None:
        return v, f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"
    st = status(runs, name)
    return None, f"- ({name}: {st if st != 'rc=0' else 'no figure printed'})"


def detail(runs, name):
    """What a check's output says in brief: the harness's `test result:` lines (and the tests
    that failed), else the last epoch's line, else its first line naming an error or a
    difference, else nothing."""
    out = read(runs, name, "run") or ""
    lines = [l.strip() for l in re.split(r"[\r\n]+", out) if l.strip()]
    results = [l for l in lines if l.startswith("test result:")]
    failed = [l.split()[1] for l in lines if l.startswith("test ") and l.endswith("FAILED")]
    if results:
        text = "; ".join(r[len("test result: "):] for r in results)
        return text + (f" (failed: {', '.join(failed)})" if failed else "")
    epochs = [l for l in lines if re.match(r"epoch [0-9]+:", l)]
    if epochs:
        return epochs[-1]
    bad = [l for l in lines if re.search(r"^error|DIFFER|panicked", l)]
    return bad[0][:200] if bad else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", help="the folder of run.NAME and rc.NAME files")
    ap.add_argument("--device", default="the GPU")
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    at = f" at {a.commit}" if a.commit else ""
    print(f"### `bench/gpu_session.sh all` on {a.device}{at}")
    print()
    print("Checks:")
    print()
    for name in CHECKS:
        said = detail(a.runs, name)
        print(f"- {name}: {status(a.runs, name)}" + (f", {said}" if said else ""))
    print()
    print("| figure | ours | peer | ratio |")
    print("|---|---:|---:|---:|")
    for figure, ours, op, peer, pp in FIGURES:
        (o, oc), (p, pc) = cell(a.runs, ours, op), cell(a.runs, peer, pp)
        ratio = f"{o / p:.2f}" if o is not None and p else "-"
        print(f"| {figure} | {oc} | {pc} | {ratio} |")


if __name__ == "__main__":
    main()
