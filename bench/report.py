"""Writes the markdown report of `bench/gpu_session.sh report DIR` from the logs in DIR:
throughput of W1-W4 beside the PyTorch peers (ratio), peak memory both sides, and the
profile tables both sides (mantissa's `--profile`, the peers' torch.profiler).

  python3 bench/report.py DIR > DIR/report.md
"""
import os
import re
import sys

# (id, what, unit, our log, peer log, our throughput pattern, peer throughput pattern)
WORKLOADS = [
    ("W1", "MLP 784-512-512-10, batch 128, SGD momentum, one MNIST epoch", "samples/s",
     "w1", "w1-peer", r"epoch 1: .*?([\d.]+) samples/s", r"epoch 1: ([\d.]+) samples/s"),
    ("W2", "MNIST CNN, batch 64, Adadelta, one epoch", "samples/s",
     "w2", "w2-peer", r"epoch 1: .*?([\d.]+) samples/s", r"epoch 1: ([\d.]+) samples/s"),
    ("W3", "ResNet-50 224x224 synthetic, batch 256, fp16 AMP, channels-last", "images/s",
     "w3", "w3-peer", r"synthetic .*: ([\d.]+) images/s", r"torch .*: ([\d.]+) images/s"),
    ("W4", "LSTM 2 x 512, sequence 100, batch 64, fp16 AMP", "tokens/s",
     "w4", "w4-peer", r"^([\d.]+) training tokens/s", r"^torch ([\d.]+) training tokens/s"),
]
MEMORY = r"(?:mantissa|torch) (?:timed steps|training): peak allocated ([\d.]+) MiB, reserved ([\d.]+) MiB"


def read(d, name):
    path = os.path.join(d, name + ".log")
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.read().replace("\r", "\n")


def first(pattern, text):
    if text is None:
        return None
    m = re.search(pattern, text, re.M)
    return m.groups() if m else None


def section(text, start, ends):
    """The lines from the one starting with `start` up to (without) one starting with an end."""
    if text is None:
        return None
    lines = text.splitlines()
    for i, l in enumerate(lines):
        if l.startswith(start):
            out = []
            for m in lines[i:]:
                if out and any(m.startswith(e) for e in ends):
                    break
                out.append(m)
            return "\n".join(out).rstrip()
    return None


def status(text):
    rc = first(r"^rc=(\d+)", text)
    if text is None:
        return "not run"
    if rc and rc[0] != "0":
        return f"exit {rc[0]}" + (" (time limit)" if rc[0] == "124" else "")
    return None


def main():
    d = sys.argv[1]
    check = read(d, "gpu_check") or ""
    device = first(r"^(Cuda.*|.*NVIDIA.*)$", check)
    print("# GPU report\n")
    print(f"Device: {device[0].strip() if device else 'unknown (see gpu_check.log)'}.\n")
    print("| id | workload | unit | mantissa | PyTorch | ratio | peak MiB mantissa | peak MiB PyTorch |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for wid, what, unit, ours, peer, p_ours, p_peer in WORKLOADS:
        t_ours, t_peer = read(d, ours), read(d, peer)
        a, b = first(p_ours, t_ours), first(p_peer, t_peer)
        va = float(a[0]) if a else None
        vb = float(b[0]) if b else None
        ratio = f"{va / vb:.2f}x" if va and vb else "-"
        ma, mb = first(MEMORY, t_ours), first(MEMORY, t_peer)
        cell = lambda v, t: f"{v:,.0f}" if v else (status(t) or "-")
        mem = lambda m: m[0] if m else "-"
        print(f"| {wid} | {what} | {unit} | {cell(va, t_ours)} | {cell(vb, t_peer)} | {ratio} "
              f"| {mem(ma)} | {mem(mb)} |")
    print("\nRatios are mantissa over PyTorch on the same GPU in the same run; peak memory is the "
          "allocator's peak allocated bytes (torch.cuda.max_memory_allocated on the PyTorch side).")
    for wid, what, _, ours, peer, _, _ in WORKLOADS:
        t_ours, t_peer = read(d, ours), read(d, peer)
        mine = section(t_ours, "profile of ", ["trace in "])
        theirs = section(t_peer, "torch profile of ", ["torch profiled steps", "torch trace in "])
        if mine is None and theirs is None:
            continue
        print(f"\n## {wid}: {what}\n")
        print("mantissa (`--profile`):\n")
        print("```text\n" + (mine or status(t_ours) or "no profile in the log") + "\n```\n")
        print("PyTorch (torch.profiler, top 25 by device time):\n")
        print("```text\n" + (theirs or status(t_peer) or "no profile in the log") + "\n```")


if __name__ == "__main__":
    main()
