"""The heads of -train.py, loaded for -sim.py: every position's guesses precomputed."""
import gguf
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self, depth, embed, width=1536, hidden=1536):
        super().__init__()
        self.embed = embed
        self.norms = nn.ModuleList(nn.RMSNorm(width) for _ in range(depth))
        self.up = nn.Linear(width * (1 + depth), hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, h, xs):
        parts = [h] + [n(self.embed[x]) for n, x in zip(self.norms, xs)]
        return h + self.down(F.silu(self.up(torch.cat(parts, -1))))


def load(path, gguf_path):
    reader = gguf.GGUFReader(gguf_path)
    t = {t.name: t for t in reader.tensors}
    deq = lambda n: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t[n].data, t[n].tensor_type))).float()
    saved = torch.load(path)
    words = saved["words"]
    embed, W = deq("token_embd.weight"), deq("output.weight")[words].contiguous()
    heads = []
    for depth, state in enumerate(saved["heads"], 1):
        state = {k: v for k, v in state.items()}
        h = Head(depth, embed, hidden=saved["hidden"])
        h.load_state_dict(state)
        heads.append(h.eval())
    return (heads, W), words


@torch.no_grad()
def guesses(heads_w, words, key, data, k1=4, k2=2, under=2):
    (h1, h2), W = heads_w
    ids, p = torch.from_numpy(data[key + ":ids"]), int(data[key + ":prompt"][0])
    h = torch.from_numpy(data[key + ":h"]).float()
    t = torch.arange(p + 1, len(ids))
    probs = F.softmax(h1(h[t - 2], [ids[t - 1]]) @ W.T, -1)
    p1, top1 = probs.topk(k1, -1)
    out = {}
    for j in range(len(t)):
        level = []
        for r in range(k1):
            below = []
            if r < under:
                g = words[top1[j, r]]
                q = F.softmax(h2(h[t[j] - 2][None], [ids[t[j] - 1][None], g[None]]) @ W.T, -1)[0]
                p2, top2 = q.topk(k2)
                below = [(int(words[a]), float(b)) for a, b in zip(top2, p2)]
            level.append((int(words[top1[j, r]]), float(p1[j, r]), below))
        out[(key, int(t[j]))] = level
    return out


if __name__ == "__main__":  # the prototype's bundle: python -model.py heads.pt GGUF heads_full.pt
    import sys

    (heads, W), words = load(sys.argv[1], sys.argv[2])
    torch.save({"h1": heads[0].state_dict(), "h2": heads[1].state_dict(), "W": W.to(torch.bfloat16),
                "embed": heads[0].embed.to(torch.bfloat16), "words": words,
                "hidden": torch.load(sys.argv[1])["hidden"]}, sys.argv[3])
