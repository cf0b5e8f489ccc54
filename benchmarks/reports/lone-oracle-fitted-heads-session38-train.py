"""Ad hoc (session 38): fit small heads on the 1.5B's own hidden states (capture.py's train.npz) that guess the
token after next, EAGLE/Hydra-like: head 1 takes (h_i, x_{i+1}) and guesses the oracle's argmax after x_{i+1};
head 2 takes (h_i, x_{i+1}, x_{i+2}) and guesses the one after x_{i+2}. The oracle's own head (its GGUF
output.weight, dequantized, restricted to the words the training targets use) scores them, frozen.

    python lone-oracle-fitted-heads-session38-train.py GGUF train.npz[,train2.npz...] eval.npz heads.pt [--epochs N] [--words M]
"""
import argparse
import time

import gguf
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("gguf"), ap.add_argument("train"), ap.add_argument("eval"), ap.add_argument("out")
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--words", type=int, default=32768)
ap.add_argument("--hidden", type=int, default=1536)
ap.add_argument("--chunks", type=int, default=0, help="the first N pieces of 512 only (0: all)")
ap.add_argument("--only-agreeing", action="store_true", help="train only where the text's token is the oracle's")
args = ap.parse_args()
torch.manual_seed(0)
torch.set_num_threads(2)

reader = gguf.GGUFReader(args.gguf)
tensors = {t.name: t for t in reader.tensors}


def dequantized(name):
    t = tensors[name]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(w)).float()


head_w = dequantized("output.weight")  # [vocab, 1536]
embed = dequantized("token_embd.weight")
print("head", tuple(head_w.shape), "embed", tuple(embed.shape), flush=True)

parts = [np.load(f) for f in args.train.split(",")]  # (several captures: comma-separated)
H = torch.cat([torch.from_numpy(d["h"]).float() for d in parts])
X = torch.cat([torch.from_numpy(d["x"]).long() for d in parts])
Y = torch.cat([torch.from_numpy(d["y"]).long() for d in parts])
C, L = X.shape
H = H.view(C, L, -1)
if args.chunks:
    C, X, Y, H = args.chunks, X[: args.chunks], Y[: args.chunks], H[: args.chunks]
counts = torch.bincount(Y.flatten(), minlength=head_w.shape[0])
words = torch.argsort(counts, descending=True)[: min(args.words, int((counts > 0).sum()))]
slot = torch.full((head_w.shape[0],), -1, dtype=torch.long)
slot[words] = torch.arange(len(words))
W = head_w[words].contiguous()
print(f"{C * L} training positions, {len(words)} words ({(counts > 0).sum()} seen)", flush=True)


def examples(depth):
    hs = H[:, : L - depth].reshape(-1, H.shape[-1])
    xs = [X[:, 1 + j : L - depth + 1 + j].reshape(-1) for j in range(depth)]
    ys = Y[:, depth : L].reshape(-1)
    keep = slot[ys] >= 0
    if args.only_agreeing:  # the text's tokens are the oracle's argmax, as on a greedy path
        for j in range(depth):
            keep &= X[:, 1 + j : L - depth + 1 + j].reshape(-1) == Y[:, j : L - depth + j].reshape(-1)
    return hs[keep], [x[keep] for x in xs], slot[ys[keep]]


class Head(nn.Module):
    def __init__(self, depth, width=1536, hidden=args.hidden):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(width) for _ in range(depth))
        self.up = nn.Linear(width * (1 + depth), hidden)
        self.down = nn.Linear(hidden, width)
        nn.init.zeros_(self.down.weight), nn.init.zeros_(self.down.bias)

    def forward(self, h, xs):
        parts = [h] + [n(embed[x]) for n, x in zip(self.norms, xs)]
        return h + self.down(F.silu(self.up(torch.cat(parts, -1))))


def logits(z):
    return z @ W.T


def fit(depth):
    hs, xs, ys = examples(depth)
    n = len(ys)
    perm = torch.randperm(n)
    val, tr = perm[: n // 20], perm[n // 20 :]
    head = Head(depth)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
    steps = args.epochs * (len(tr) // 512)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=steps, pct_start=0.05)
    base = (logits(hs[val]).argmax(-1) == ys[val]).float().mean()  # the oracle's own head on h_i: ignores x's
    t0, k = time.time(), 0
    for epoch in range(args.epochs):
        order = tr[torch.randperm(len(tr))]
        for s in range(len(tr) // 512):
            b = order[s * 512 : (s + 1) * 512]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(logits(head(hs[b], [x[b] for x in xs])).float(), ys[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            k += 1
        with torch.no_grad():
            acc = (logits(head(hs[val], [x[val] for x in xs])).argmax(-1) == ys[val]).float().mean()
        print(f"depth {depth} epoch {epoch} loss {loss.item():.3f} val top-1 {acc:.3f} (h alone {base:.3f}) "
              f"{time.time() - t0:.0f}s", flush=True)
    return head


heads = [fit(1), fit(2)]
torch.save({"heads": [h.state_dict() for h in heads], "words": words, "hidden": args.hidden}, args.out)

# greedy paths held out: the guess for ids[t] from (h[t-2], ids[t-1]); head 2's for ids[t+1] given ids[t] right
e = np.load(args.eval)
keys = sorted({k.rsplit(":", 1)[0] for k in e.files})
with torch.no_grad():
    for group in sorted({k.split(":")[0] for k in keys}):
        hit1 = hit4 = hit2 = n = 0
        for key in [k for k in keys if k.startswith(group)]:
            ids, p = torch.from_numpy(e[key + ":ids"]), int(e[key + ":prompt"][0])
            h = torch.from_numpy(e[key + ":h"]).float()
            t = torch.arange(p + 1, len(ids) - 1)
            top = logits(heads[0](h[t - 2], [ids[t - 1]])).topk(4, -1).indices
            truth = slot[ids[t]]
            hit1 += (top[:, 0] == truth).sum().item()
            hit4 += (top == truth[:, None]).any(-1).sum().item()
            g2 = logits(heads[1](h[t - 2], [ids[t - 1], ids[t]])).argmax(-1)
            hit2 += ((g2 == slot[ids[t + 1]]) & (top[:, 0] == truth)).sum().item()
            n += len(t)
        print(f"{group:18} {n} positions: head 1 top-1 {hit1 / n:.3f}, top-4 {hit4 / n:.3f}; head 1 and 2 both "
              f"right {hit2 / n:.3f}", flush=True)
