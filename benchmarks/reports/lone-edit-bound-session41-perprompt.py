"""Ad hoc (session 41): per prompt, a model alone: baseline vs staged after the first token, tok/fwd, and a copy
bound: steps an oracle that always guessed the longest run found anywhere earlier (capped at CAP) would need."""
import json
import sys

sys.path.insert(0, ".")  # (run from spec's root)
from spec_cli.completion import complete
from spec_cli.core.settings import Decoding
from spec_cli.engine import Engine
from spec_cli.models import profiles

oracle, path = sys.argv[1], sys.argv[2]
CAP = int(sys.argv[3]) if len(sys.argv) > 3 else 8
engine = Engine(profiles.select(None, oracle, None, "default"))
plan = engine.plan(Decoding(method="staged", max_new_tokens=128))
base = Decoding(method="baseline", max_new_tokens=128)

def copy_steps(prompt, out, cap):
    steps, i = 0, 0
    while i < len(out):
        ctx = prompt + out[:i]
        best = 0
        for s in range(len(ctx)):
            L = 0
            while L < cap and i + L < len(out) and s + L < len(ctx) and ctx[s + L] == out[i + L]:
                L += 1
            best = max(best, L)
        i += best + 1
        steps += 1
    return steps

tp = ts = 0
for n, line in enumerate(open(path)):
    ids = engine.encode(json.loads(line)["prompt"])
    a, b = complete(engine, ids, base), complete(engine, ids, plan)
    assert a.tokens == b.tokens
    pa = a.seconds - (a.first_token_seconds or 0); pb = b.seconds - (b.first_token_seconds or 0)
    tp += pa; ts += pb
    out = a.tokens
    cs = copy_steps(ids, out, CAP)
    print(f"#{n} {pa/pb:.2f}x  {b.stats.new_tokens / b.stats.oracle_forwards:.2f} tok/fwd  "
          f"copy bound {len(out)/cs:.2f} tok/step (cap {CAP})  {pb*1000/b.stats.oracle_forwards:.1f} ms/fwd vs {pa*1000/len(out):.1f}", flush=True)
print(f"all {tp/ts:.2f}x")
