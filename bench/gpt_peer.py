"""PyTorch peer of `examples/gpt` (W5 and W5-cpu of BENCHMARKS.md): nanoGPT's model (the
same tensor names: token and position embeddings, pre-LayerNorm blocks with causal
`scaled_dot_product_attention` and a 4x MLP with tanh-approximated GELU, the head tied to the
token embedding) and its loop (AdamW 0.9/beta2 with weight decay on 2-D weights only, linear
warm-up then cosine decay, clipping, gradient accumulation, autocast with GradScaler for fp16).

  python3 bench/gpt_peer.py --data synthetic --steps 20                     # baby GPT, tokens/s
  python3 bench/gpt_peer.py --model gpt2 --data synthetic --device cuda --amp bf16 [--compile]
  python3 bench/gpt_peer.py --text input.txt --model shakespeare-char --steps 5000
  python3 bench/gpt_peer.py --write-init init.safetensors ...   # the example loads it: --init

`--write-init` writes the initial weights (f32, nanoGPT's names, `n_head` in the metadata) as
safetensors without numpy, so both engines can start from the same point.
"""
import argparse, json, math, os, struct, time
import peer_profile
import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    "baby": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0),
    "shakespeare-char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, dropout=0.0),
}


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"])
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"])
        self.resid_dropout = nn.Dropout(c["dropout"])
        self.n_head, self.dropout = c["n_head"], c["dropout"]

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        heads = lambda u: u.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"])
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"])
        self.dropout = nn.Dropout(c["dropout"])

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c["n_embd"]), Attention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c["n_embd"]), Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab_size"], c["n_embd"]),
            wpe=nn.Embedding(c["block_size"], c["n_embd"]),
            drop=nn.Dropout(c["dropout"]),
            h=nn.ModuleList([Block(c) for _ in range(c["n_layer"])]),
            ln_f=nn.LayerNorm(c["n_embd"])))
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * c["n_layer"]))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias") and "ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    @torch.no_grad()
    def generate_greedy(self, idx, new_tokens):
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.config["block_size"]:])
            idx = torch.cat([idx, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
        return idx


def optimizer(model, lr, weight_decay, beta2, fused=False):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), eps=1e-8, fused=fused)


def lr_at(step, lr, min_lr, warmup, total):
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > total or total <= warmup:
        return min_lr
    ratio = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def write_safetensors(path, tensors, meta):
    """`tensors`: name -> tensor (float written as F32, integer as I64), without numpy."""
    header, blobs, offset = {}, [], 0
    for name, x in tensors.items():
        x = x.detach().cpu().contiguous()
        vals = x.flatten().tolist()
        if x.dtype.is_floating_point:
            code, data = "F32", struct.pack(f"<{len(vals)}f", *vals)
        else:
            code, data = "I64", struct.pack(f"<{len(vals)}q", *vals)
        header[name] = {"dtype": code, "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def state_of(model):
    """The model's weights by nanoGPT's names, the tied head under both."""
    return {k: v for k, v in model.state_dict().items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="baby", choices=list(PRESETS))
    for k in ["n_layer", "n_head", "n_embd", "block_size"]:
        p.add_argument("--" + k.replace("_", "-"), type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--data", default="text", choices=["text", "synthetic"])
    p.add_argument("--text", help="a UTF-8 text, tokenised by characters")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--write-init")
    peer_profile.add_args(p)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    c = dict(PRESETS[a.model])
    for k in ["n_layer", "n_head", "n_embd", "block_size", "dropout"]:
        if getattr(a, k) is not None:
            c[k] = getattr(a, k)
    if a.data == "text":
        text = open(a.text, encoding="utf-8").read()
        chars = sorted(set(text))
        lookup = {ch: i for i, ch in enumerate(chars)}
        data = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
        cut = len(data) * 9 // 10
        train, val = data[:cut], data[cut:]
        c["vocab_size"] = len(chars)
    else:
        c["vocab_size"] = 50304 if a.model.startswith("gpt2") else 65
        train = val = torch.randint(0, min(c["vocab_size"], 50257), (1 << 16,))
    model = GPT(c).to(dev)
    if a.write_init:
        write_safetensors(a.write_init, state_of(model), {"n_head": c["n_head"]})
    low = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[a.amp]
    scaler = torch.amp.GradScaler(dev.type, enabled=low == torch.float16)
    opt = optimizer(model, a.lr, a.weight_decay, a.beta2, fused=dev.type == "cuda")
    step_model = torch.compile(model) if a.compile else model
    min_lr = a.min_lr if a.min_lr is not None else a.lr / 10
    T, B = c["block_size"], a.batch_size

    def batch(data):
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([data[i:i + T] for i in ix]).to(dev, non_blocking=True)
        y = torch.stack([data[i + 1:i + T + 1] for i in ix]).to(dev, non_blocking=True)
        return x, y

    def step(micro):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in micro:
            with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
                _, loss = step_model(x, y)
            scaler.scale(loss / len(micro)).backward()
            total += loss.detach() / len(micro)
        scaler.unscale_(opt)
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        scaler.step(opt)
        scaler.update()
        return total

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if a.data == "synthetic":
        micro = [batch(train) for _ in range(a.accumulate)]
        for _ in range(3):
            step(micro)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step(micro)
        loss = loss.item()
        secs = time.perf_counter() - t0
        tokens = a.steps * B * T * a.accumulate
        print(f"step {a.steps + 2}: loss {loss:.4f}")
        print(f"{tokens / secs:.0f} training tokens/s ({a.steps} steps in {secs:.2f} s)")
        if dev.type == "cuda":
            print(f"torch training: peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
        peer_profile.run(a, lambda: step(micro), dev)
        return
    t0 = time.perf_counter()
    for s in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, a.lr, min_lr, a.warmup_steps, a.steps)
        step([batch(train) for _ in range(a.accumulate)])
        if (s + 1) % a.eval_interval == 0 or s + 1 == a.steps:
            model.eval()
            with torch.no_grad(), torch.autocast(dev.type, dtype=low or torch.float32,
                                                 enabled=low is not None):
                losses = {n: sum(model(*batch(d))[1].item() for _ in range(a.eval_batches))
                          / a.eval_batches for n, d in [("train", train), ("val", val)]}
            model.train()
            print(f"step {s + 1}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
