"""Ad hoc (session 40): per-step anatomy of a model alone (or a pair: a .gguf third argument) on prompts, warm, one process: per prompt speed after the first token, tokens a forward, rows a step, the steps whose whole chain was accepted, ms by rows verified, and each step as accepted/rows. NO_EDITED=1: the edited copy (the -edited-copy.patch) left out; PRICED=1: every step guesses as priced.

    SPEC_CACHE_DIR=DIR python lone-oracle-heads-tokens-session40-steps.py GGUF PROMPTS.jsonl [DRAFT.gguf]
"""
import json
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, ".")
from spec_cli.completion import complete
from spec_cli.core.settings import Decoding
from spec_cli.decoding import staged
from spec_cli.engine import Engine
from spec_cli.models import profiles

oracle, files = sys.argv[1], sys.argv[2].split(",")
draft = None
if sys.argv[3:] and sys.argv[3].endswith(".gguf"):
    draft = sys.argv.pop(3)
extra = dict(a.split("=") for a in sys.argv[3:])
steps = []
verify = staged._verify
def counted(runner, tree, chosen, slots, tail, last, sampler, draws, looked):
    t = time.perf_counter()
    verdict, token = verify(runner, tree, chosen, slots, tail, last, sampler, draws, looked)
    dt = time.perf_counter() - t
    deepest = max((tree.nodes[i].depth for i in chosen), default=0)
    offered = max((n.depth for n in tree.nodes), default=0)
    full = bool(verdict.path) and not any(tree.nodes[i].parent == verdict.path[-1] for i in chosen) and not verdict.rejected
    stages = Counter(tree.nodes[i].stage for i in verdict.path)
    steps.append(dict(rows=len(chosen), acc=len(verdict.path), deepest=deepest, offered=offered, tail=len(tail), dt=dt, full=full, stages=dict(stages)))
    return verdict, token
staged._verify = counted
import os

from spec_cli.decoding import adapt

if os.environ.get("NO_EDITED"):
    from spec_cli.draft2.lookup import Index
    Index.edited = lambda self, text, depth: []
if os.environ.get("PRICED"):
    _guess = adapt.Controller.guess
    adapt.Controller.guess = lambda self, cue=None, priced=False: _guess(self, cue, True)
engine = Engine(profiles.select(None, oracle, draft, "default"))
kw = {k: int(v) for k, v in extra.items()}
plan = engine.plan(Decoding(method="staged", max_new_tokens=128, **kw))
base = Decoding(method="baseline", max_new_tokens=128)
plain = spec = 0.0; tokens = forwards = 0
for f in files:
    for n, line in enumerate(open(f)):
        ids = engine.encode(json.loads(line)["prompt"])
        steps.clear()
        a, b = complete(engine, ids, base), complete(engine, ids, plan)
        assert a.tokens == b.tokens
        pa = a.seconds - (a.first_token_seconds or 0); pb = b.seconds - (b.first_token_seconds or 0)
        plain += pa; spec += pb
        tokens += b.stats.new_tokens; forwards += b.stats.oracle_forwards
        s = steps[1:]
        full = sum(x["full"] for x in s); acc = Counter(x["acc"] for x in s)
        print(f"{f.split('/')[-1]}#{n}: {pa/pb:.2f}x {b.stats.new_tokens/b.stats.oracle_forwards:.2f} tok/fwd steps={len(s)} "
              f"rows/step={sum(x['rows'] for x in s)/len(s):.1f} full-accepted={full} ms/step={1000*sum(x['dt'] for x in s)/len(s):.1f} "
              f"acc-hist={sorted(acc.items())}", flush=True)
        byrows = defaultdict(list)
        for x in s: byrows[x["rows"]].append(x["dt"])
        print("   ms by rows:", {r: round(1000*sum(v)/len(v),1) for r, v in sorted(byrows.items())})
        print("   seq:", " ".join(f"{x['acc']}/{x['rows']}{'*' if x['full'] else ''}" for x in s))
print(f"after first token: {plain/spec:.2f}x; {tokens/forwards:.2f} tok/fwd")
