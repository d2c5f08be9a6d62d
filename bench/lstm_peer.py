"""PyTorch peer of `examples/lstm --synthetic` (W4 of BENCHMARKS.md): embedding, a
stacked nn.LSTM (batch first; cuDNN's on a GPU) and a linear read-out over 256 symbols, one
fixed random batch, Adam, gradients clipped to norm 1, autocast with GradScaler for fp16.

  python3 bench/lstm_peer.py --hidden 128 --steps 5
  python3 bench/lstm_peer.py --device cuda --amp bf16
"""
import argparse, time
import peer_profile
import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--embedding", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="fp32", choices=["fp32", "fp16", "bf16"])
    peer_profile.add_args(p)
    a = p.parse_args()
    torch.manual_seed(1)
    dev = torch.device(a.device)
    vocab = 256
    embed = nn.Embedding(vocab, a.embedding).to(dev)
    lstm = nn.LSTM(a.embedding, a.hidden, a.layers, batch_first=True).to(dev)
    head = nn.Linear(a.hidden, vocab).to(dev)
    params = [*embed.parameters(), *lstm.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=a.lr)
    low = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[a.amp]
    scaler = torch.amp.GradScaler(dev.type, enabled=low == torch.float16)
    x = torch.randint(0, vocab, (a.batch_size, a.seq_len), device=dev)
    y = torch.randint(0, vocab, (a.batch_size, a.seq_len), device=dev)
    print(f"torch LSTM {a.layers} x {a.hidden}, sequence {a.seq_len}, batch {a.batch_size}, "
          f"device {dev}, {a.amp}, {torch.get_num_threads()} threads, torch {torch.__version__}")

    def train_step():
        with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
            h, _ = lstm(embed(x))
            loss = F.cross_entropy(head(h).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    start = time.perf_counter()
    for step in range(a.warmup + a.steps):
        loss = train_step()
        if step + 1 == a.warmup:
            loss.item()
            start = time.perf_counter()
    loss.item()
    secs = time.perf_counter() - start
    tokens = a.steps * a.batch_size * a.seq_len
    print(f"torch {round(tokens / secs)} training tokens/s ({a.steps} steps in {secs:.2f} s)")
    if dev.type == "cuda":
        print(f"torch timed steps: {peer_profile.peak_memory(dev)}")
    peer_profile.run(a, train_step, dev)


if __name__ == "__main__":
    main()
