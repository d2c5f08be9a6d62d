"""PyTorch peer of examples/mnist for the side-by-side runs (W1, W2 of BENCHMARKS.md).

Same models, initialisation scheme, optimizers and batch sizes; CPU with the same thread
count unless --device cuda. Reads the IDX files from data/mnist (or $MNIST_DIR).

  python3 bench/mnist_peer.py --model mlp --optimizer sgd --lr 0.05 --batch-size 128 --epochs 1
  python3 bench/mnist_peer.py --model cnn --epochs 1 --threads 2
"""
import argparse, gzip, os, time
import numpy as np
import peer_profile
import torch
import torch.nn as nn
import torch.nn.functional as F


def idx(path):
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            raw = open(p, "rb").read()
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            ndim = raw[3]
            dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
            return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
    raise FileNotFoundError(path)


def load(root, train):
    stem = "train" if train else "t10k"
    x = idx(os.path.join(root, f"{stem}-images-idx3-ubyte")).astype(np.float32) / 255.0
    y = idx(os.path.join(root, f"{stem}-labels-idx1-ubyte")).astype(np.int64)
    x = (x - 0.1307) / 0.3081
    return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y)


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout2(x))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn", choices=["mlp", "cnn"])
    ap.add_argument("--optimizer", default=None, choices=["sgd", "adam", "adadelta"])
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gamma", type=float, default=None, help="StepLR factor per epoch (default 0.7 cnn, 0.3 mlp)")
    ap.add_argument("--one-cycle", action="store_true", help="OneCycleLR per step with max lr = --lr")
    ap.add_argument("--amp", default=None, choices=["fp16", "bf16"],
                    help="autocast to this dtype (fp16 with a GradScaler), as mantissa's --precision")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    ap.add_argument("--channels-last", action="store_true",
                    help="model and images in torch.channels_last, as mantissa's --channels-last")
    peer_profile.add_args(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    root = os.environ.get("MNIST_DIR", "data/mnist")
    xtr, ytr = load(root, True)
    xte, yte = load(root, False)
    dev = torch.device(a.device)
    torch.backends.cudnn.benchmark = a.cudnn_benchmark
    low = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[a.amp]
    scaler = torch.amp.GradScaler(dev.type, enabled=a.amp == "fp16")
    xtr, ytr, xte, yte = xtr.to(dev), ytr.to(dev), xte.to(dev), yte.to(dev)
    model = (Cnn() if a.model == "cnn" else mlp()).to(dev)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    if a.channels_last:
        model = model.to(memory_format=fmt)
    kind = a.optimizer or ("adadelta" if a.model == "cnn" else "sgd")
    lr = a.lr or {"adadelta": 1.0, "sgd": 0.05, "adam": 1e-3}[kind]
    opt = {"sgd": lambda: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
           "adam": lambda: torch.optim.Adam(model.parameters(), lr=lr),
           "adadelta": lambda: torch.optim.Adadelta(model.parameters(), lr=lr)}[kind]()
    gamma = a.gamma if a.gamma is not None else (0.7 if a.model == "cnn" else 0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=gamma)
    n = xtr.shape[0]
    steps = (n + a.batch_size - 1) // a.batch_size
    # cycle_momentum=False: mantissa's OneCycle schedules the learning rate only (PyTorch's
    # default would also cycle Adam's beta1 between 0.85 and 0.95).
    cycle = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=a.epochs * steps,
                                                 cycle_momentum=False)
             if a.one_cycle else None)

    def train_step(idx_):
        x, y = xtr[idx_].contiguous(memory_format=fmt), ytr[idx_]
        with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return y

    for epoch in range(a.epochs):
        model.train()
        perm = torch.randperm(n, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        seen = 0
        for i in range(0, n, a.batch_size):
            y = train_step(perm[i:i + a.batch_size])
            if cycle is not None:
                cycle.step()
            seen += y.numel()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if cycle is None:
            sched.step()
        model.eval()
        with torch.no_grad(), torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
            acc = sum((model(xte[i:i + 1000]).argmax(1) == yte[i:i + 1000]).sum().item() for i in range(0, 10000, 1000)) / 10000
        print(f"torch {torch.__version__} {a.model} {kind} epoch {epoch + 1}: {seen / dt:.0f} samples/s, {dt:.1f} s, test acc {100 * acc:.2f}% ({a.threads} threads, {a.device}, {a.amp or 'fp32'}{', channels-last' if a.channels_last else ''})")
    if dev.type == "cuda":
        print(f"torch training: {peer_profile.peak_memory(dev)}")
    # Profiled steps: the first batches of one more shuffled epoch, the learning rate held.
    model.train()
    perm = torch.randperm(n, device=dev)
    starts = iter(range(0, n, a.batch_size))

    def next_step():
        i = next(starts)
        train_step(perm[i:i + a.batch_size])

    peer_profile.run(a, next_step, dev)


if __name__ == "__main__":
    main()
