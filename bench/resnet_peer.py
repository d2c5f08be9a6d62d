"""PyTorch peer of `examples/resnet --data synthetic` for side-by-side throughput runs (W3 of
BENCHMARKS.md).

The same networks (torchvision's ResNet-18/34/50 shapes, ImageNet stem), PyTorch's default
initialisation, one fixed random batch on the device, SGD with Nesterov momentum 0.9 and
weight decay 5e-4 at a constant rate; autocast with GradScaler for fp16. Eager mode, or with
`--compile` the network through `torch.compile` (default mode: inductor, no CUDA graphs); the
warm-up steps hold the compilation and are not timed (its time is printed).

  python3 bench/resnet_peer.py --data synthetic --arch resnet18 --image-size 64 --batch-size 16
  python3 bench/resnet_peer.py --data synthetic --arch resnet50 --batch-size 256 --device cuda \
      --amp fp16 --channels-last --cudnn-benchmark [--compile]
"""
import argparse, time
import peer_profile
import torch
import torch.nn as nn
import torch.nn.functional as F


def conv(i, o, k, stride):
    return nn.Conv2d(i, o, k, stride, k // 2, bias=False)


class Block(nn.Module):
    def __init__(self, c_in, width, stride, bottleneck):
        super().__init__()
        if bottleneck:
            c_out = 4 * width
            self.main = nn.Sequential(
                conv(c_in, width, 1, 1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                conv(width, width, 3, stride), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                conv(width, c_out, 1, 1), nn.BatchNorm2d(c_out))
        else:
            c_out = width
            self.main = nn.Sequential(
                conv(c_in, width, 3, stride), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                conv(width, width, 3, 1), nn.BatchNorm2d(width))
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(conv(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out))
        self.c_out = c_out

    def forward(self, x):
        s = x if self.shortcut is None else self.shortcut(x)
        return F.relu(self.main(x) + s)


def resnet(arch, width, classes):
    counts, bottleneck = {"resnet18": ([2, 2, 2, 2], False), "resnet34": ([3, 4, 6, 3], False),
                          "resnet50": ([3, 4, 6, 3], True)}[arch]
    layers = [conv(3, width, 7, 2), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    c = width
    for stage, count in enumerate(counts):
        for i in range(count):
            b = Block(c, width << stage, 2 if stage > 0 and i == 0 else 1, bottleneck)
            layers.append(b)
            c = b.c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--cudnn-benchmark", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="run the network through torch.compile (default mode)")
    peer_profile.add_args(p)
    a = p.parse_args()
    if a.compile and a.warmup < 1:
        p.error("--compile needs at least one warm-up step (the compilation)")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.backends.cudnn.benchmark = a.cudnn_benchmark
    torch.manual_seed(1)
    dev = torch.device(a.device)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    net = resnet(a.arch, a.width, a.classes).to(dev, memory_format=fmt)
    model = torch.compile(net) if a.compile else net
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    low = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[a.amp]
    scaler = torch.amp.GradScaler(dev.type, enabled=low == torch.float16)
    n, s = a.batch_size, a.image_size
    x = torch.randn(n, 3, s, s, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, a.classes, (n,), device=dev)
    print(f"{a.arch} width {a.width} ({sum(q.numel() for q in net.parameters())} parameters), "
          f"batch {n}, device {dev}, {a.amp}, channels-last {a.channels_last}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{'torch.compile' if a.compile else 'eager'}")
    net.train()

    def train_step():
        with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    t0 = time.perf_counter()
    start, last = t0, 0.0
    for step in range(a.warmup + a.steps):
        loss = train_step()
        if step + 1 == a.warmup:
            loss.item()
            start = time.perf_counter()
            print(f"torch warm-up ({a.warmup} steps{', compilation included' if a.compile else ''}): "
                  f"{start - t0:.1f} s")
        if step + 1 == a.warmup + a.steps:
            last = loss.item()
    secs = time.perf_counter() - start
    mode = "compiled" if a.compile else "eager"
    print(f"torch {mode} {a.arch} synthetic {s}x{s}, batch {n}, {a.amp}, channels-last {a.channels_last}: "
          f"{n * a.steps / secs:.1f} images/s ({a.steps} steps in {secs:.2f} s, last loss {last:.3f})")
    if dev.type == "cuda":
        print(f"torch timed steps: {peer_profile.peak_memory(dev)}")
    peer_profile.run(a, train_step, dev)


if __name__ == "__main__":
    main()
