"""Writes gpt.safetensors, the reference of tests/gpt.rs: a small GPT of bench/gpt_peer.py
(2 layers, 4 heads, 64 wide, context 32, 65 tokens, head tied to the token embedding) with
its initial weights (`init.<name>`), 20 training steps' batches (`x`, `y`: [20, 4, 32]) and
losses (`loss`, f32 in fp32; `loss_bf16` under bf16 autocast), AdamW with weight-decay groups,
warm-up and cosine decay, clipping at 0.5 as the example runs them, the token embedding after
training (`final.wte`), and greedy tokens (`greedy`) from the first 5 tokens of the first
window, 40 new ones (past the context, so the window slides).

  python3 tests/torch_ref/gpt.py
"""
import copy, os, sys
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../bench"))
import gpt_peer  # noqa: E402

CONFIG = dict(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
STEPS, B, LR, MIN_LR, WARMUP, WD, BETA2, CLIP = 20, 4, 3e-3, 3e-4, 5, 0.1, 0.95, 0.5


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = gpt_peer.GPT(CONFIG).double()
    init = {k: v.float() for k, v in gpt_peer.state_of(model).items()}
    model.load_state_dict({k: v.double() for k, v in init.items()})
    # A text with structure to learn: a repeating phrase with one token in seven random.
    base = torch.arange(65).repeat(40)[torch.randperm(2600)][:200].repeat(12)
    noise = torch.randint(0, 65, base.shape)
    data = torch.where(torch.rand(base.shape) < 1 / 7, noise, base)
    starts = torch.randint(0, len(data) - 33, (STEPS, B))
    x = torch.stack([torch.stack([data[s:s + 32] for s in row]) for row in starts])
    y = torch.stack([torch.stack([data[s + 1:s + 33] for s in row]) for row in starts])

    def train(m, low):
        opt = gpt_peer.optimizer(m, LR, WD, BETA2)
        losses = []
        for s in range(STEPS):
            for g in opt.param_groups:
                g["lr"] = gpt_peer.lr_at(s, LR, MIN_LR, WARMUP, STEPS)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                _, loss = m(x[s], y[s])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
        return losses

    low_model = copy.deepcopy(model).float()
    losses = train(model, False)
    losses_bf16 = train(low_model, True)
    model.eval()
    greedy = model.generate_greedy(x[0, 0, :5].unsqueeze(0), 40)[0]
    out = {f"init.{k}": v for k, v in init.items()}
    out.update(x=x, y=y, loss=torch.tensor(losses), loss_bf16=torch.tensor(losses_bf16),
               greedy=greedy, **{"final.wte": model.transformer.wte.weight.float()})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.safetensors")
    gpt_peer.write_safetensors(path, out, {"n_head": CONFIG["n_head"], "torch": torch.__version__})
    print("losses", [round(v, 4) for v in losses])
    print("bf16  ", [round(v, 4) for v in losses_bf16])
    print("greedy", greedy.tolist())
    print(path)


if __name__ == "__main__":
    main()
