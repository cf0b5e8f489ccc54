"""Ad hoc (session 38, from session 37's): replay greedy decoding of one model alone from captured top-k's (the -capture.py beside
this), with trees merged from the lookup, the corpus trigram and the oracle's recycled top-k (Token Recycling),
each node worth its parent's worth times its bin's acceptance rate, the best `budget` verified.

    python lone-oracle-fitted-heads-session38-sim.py eval.npz [--heads heads.pt GGUF]

Session 38 adds source H: the fitted heads of train_head.py (head 1's top 4 under the root, head 2's top 2 under
head 1's first two), from the hidden state of the token before the root.
"""

import collections
import glob
import sys

import numpy as np

sys.path.insert(0, ".")
from spec_cli.draft2.lookup import ROOT, Index  # noqa: E402
from spec_cli.draft2.ngram import KatzTrigram  # noqa: E402

HEADS = {}  # (key, t) -> [(token, p, [(token2, p2), ...]), ...]
if "--heads" in sys.argv:
    import importlib.util
    import os
    spec_ = importlib.util.spec_from_file_location(
        "heads_model", os.path.join(os.path.dirname(os.path.abspath(__file__)), "lone-oracle-fitted-heads-session38-model.py"))
    thm = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(thm)
    at = sys.argv.index("--heads")
    heads, words = thm.load(sys.argv[at + 1], sys.argv[at + 2])
tri = KatzTrigram.load(glob.glob("/root/.cache/spec/draft2/corpus-*.npz")[0])
data = np.load(sys.argv[1])
keys = sorted({k.rsplit(":", 1)[0] for k in data.files})
stats = collections.defaultdict(lambda: [1, 2])  # bin -> [hits + 1, tries + 2]
TRIGRAM = dict(depth=4, firsts=2, second=0, under=0)  # spec's: a chain 4 deep and the runner-up first word


def rate(b):
    hits, tries = stats[b]
    return hits / tries


def candidates(text, index, adj, adj2, sources, k=4, depth=4):
    """[token, parent, bin] of every source's guesses, merged into one trie."""
    trie, info = {}, []

    def add(parent, tok, b):
        if (parent, tok) not in trie:
            trie[(parent, tok)] = len(info)
            info.append([tok, parent, b])
        return trie[(parent, tok)]

    if "L" in sources:
        at = []
        for g in index.guess(text, 8, 4, 64):
            parent = ROOT if g.parent == ROOT else at[g.parent]
            at.append(add(parent, g.token, ("L", min(g.match, 8), round(g.share * 4), min(g.rank, 2))))
    if "T" in sources:
        node, chain = ROOT, tri.chain(text, TRIGRAM["depth"])
        for tok, p in chain:
            node = add(node, tok, ("T", 0, int(p * 10)))
        for tok, p in tri.tops(*tri.last_two(text))[1:TRIGRAM["firsts"]]:
            if p > 0:
                below = add(ROOT, tok, ("T", 1, int(p * 10)))
                for t2, p2 in tri.chain(text + [tok], TRIGRAM["second"]):
                    below = add(below, t2, ("T", 0, int(p2 * 10)))
        if TRIGRAM["under"] and chain:
            first = trie[(ROOT, chain[0][0])]
            for tok, p in tri.tops(text[-1], chain[0][0])[1:TRIGRAM["under"]]:
                if p > 0:
                    add(first, tok, ("T", 1, int(p * 10)))
    if "H" in sources:
        for r, (tok, p, below) in enumerate(HEADS[(KEY[0], len(text))]):
            node = add(ROOT, tok, ("H", 0, r, int(p * 10)))
            for r2, (t2, p2) in enumerate(below):
                add(node, t2, ("H", 1, r2, int(p2 * 10)))
    if "R" in sources:
        frontier = [(ROOT, text[-2], text[-1])]
        for level in range(depth):
            following = []
            for parent, prev, tok in frontier:
                seen = (prev, tok) in adj2
                kids = adj2[(prev, tok)] if seen else adj.get(tok, ())
                for r, c in enumerate(kids[: (k if level == 0 else 2)]):
                    following.append((add(parent, c, ("R", min(r, 3), seen, min(level, 3))), tok, c))
            frontier = following
    return info


def choose(info, budget):
    worth = []
    for tok, parent, b in info:
        worth.append((worth[parent] if parent != ROOT else 1.0) * rate(b))
    chosen = set()
    for i in sorted(range(len(info)), key=lambda i: -worth[i]):
        if len(chosen) >= budget:
            break
        if info[i][1] == ROOT or info[i][1] in chosen:
            chosen.add(i)
    return chosen


def walk(info, chosen, truth):
    """Tokens accepted down the chosen nodes; every chosen node whose parent was reached counts in its bin."""
    kids = collections.defaultdict(list)
    for i in sorted(chosen):
        kids[info[i][1]].append(i)
    node, a = ROOT, 0
    while True:
        hit = None
        for i in kids[node]:
            ok = a < len(truth) and info[i][0] == truth[a]
            stats[info[i][2]][0] += ok
            stats[info[i][2]][1] += 1
            hit = i if ok else hit
        if hit is None:
            return a
        node, a = hit, a + 1


KEY = [None]


def run(key, sources, budget):
    KEY[0] = key
    ids, prompt, top = data[key + ":ids"].tolist(), int(data[key + ":prompt"][0]), data[key + ":top"]
    if "H" in sources and (key, prompt + 1) not in HEADS:
        HEADS.update(thm.guesses(heads, words, key, data))
    adj, adj2 = {}, {}

    def recycle(i):  # row i: the top-k after ids[:i + 1]
        adj[ids[i]] = top[i].tolist()
        if i > 0:
            adj2[(ids[i - 1], ids[i])] = top[i].tolist()

    for i in range(prompt - 1):
        recycle(i)
    index = Index()
    t, steps, rows, end = prompt + 1, 0, 0, len(ids)  # ids[prompt]: the prompt's forward's token
    while t < end:
        text = ids[:t]
        index.extend(text)
        info = candidates(text, index, adj, adj2, sources)
        chosen = choose(info, budget)
        a = walk(info, chosen, ids[t:])
        for i in range(t - 1, min(t + a, end - 1)):
            recycle(i)
        t, steps, rows = t + a + 1, steps + 1, rows + len(chosen) + 1
    return (end - prompt - 1) / steps, rows / steps


def table(label, sources, budget):
    stats.clear()
    groups = collections.defaultdict(list)
    for key in keys:
        groups[key.split(":")[0]].append(key)
    for _ in range(2):  # the first pass learns the bins' rates over all prompts
        res = {g: np.mean([run(k, sources, budget) for k in ks], axis=0) for g, ks in groups.items()}
    print(f"{label:28} budget {budget:2}: "
          + "  ".join(f"{g.removesuffix('.jsonl')} {v[0]:.2f} ({v[1]:.1f} rows)" for g, v in res.items()), flush=True)


if "--variants" in sys.argv:
    for depth, firsts, second, under in [(4, 2, 0, 0), (6, 2, 0, 0), (4, 3, 0, 0), (4, 2, 2, 0), (4, 2, 0, 2),
                                         (6, 3, 2, 2), (4, 3, 1, 2)]:
        TRIGRAM.update(depth=depth, firsts=firsts, second=second, under=under)
        for budget in (7, 11):
            table(f"LT depth {depth} firsts {firsts} {second} {under}", "LT", budget)
elif "--heads" in sys.argv:
    for sources in ("LT", "H", "LH", "LTH"):
        for budget in (7, 11):
            table(sources, sources, budget)
else:
    for sources in ("L", "LT", "R", "LR", "LTR"):
        for budget in (7, 11):
            table(sources, sources, budget)
