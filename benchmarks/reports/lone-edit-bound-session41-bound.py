"""Ad hoc (session 41): how fast could any lookup make a model alone on these prompts? For each prompt, the oracle's
own greedy completion (baseline), then an ideal lookup that at every step knows the longest run of the coming tokens
found anywhere earlier in the text (prompt + completion so far), verifies exactly that run (capped at CAP rows) and
gets it all plus the oracle's own next token. Each step priced by the measured cost of a forward of its rows
(ms, this CPU, this session: `split.py`), against baseline's one-row forwards. No miss is ever paid for."""
import json
import sys

sys.path.insert(0, ".")  # (run from spec's root)
from spec_cli.completion import complete
from spec_cli.core.settings import Decoding
from spec_cli.engine import Engine
from spec_cli.models import profiles

COST = {1: 32.2, 2: 34.4, 3: 33.3, 4: 34.9, 5: 38.1, 6: 39.4, 7: 40.1, 8: 40.4, 9: 48.1, 10: 51.9, 11: 54.8,
        12: 57.5, 13: 61.7, 14: 63.8, 15: 66.5, 16: 70.2}
PLAIN = 31.8

oracle, path = sys.argv[1], sys.argv[2]
engine = Engine(profiles.select(None, oracle, None, "default"))
base = Decoding(method="baseline", max_new_tokens=128)

KEY = int(sys.argv[3]) if len(sys.argv) > 3 else 0
def runs(prompt, out):
    found = []
    for i in range(len(out)):
        ctx = prompt + out[:i]
        best = 0
        for s in range(len(ctx)):
            if KEY and (s < KEY or ctx[s - KEY:s] != ctx[len(ctx) - KEY:]):
                continue
            L = 0
            while i + L < len(out) and s + L < len(ctx) and ctx[s + L] == out[i + L]:
                L += 1
            best = max(best, L)
        found.append(best)
    return found

def ideal(found, n, cap):
    i = steps = 0; ms = 0.0
    while i < n:
        L = min(found[i], cap, n - i - 1)
        ms += COST[L + 1]; i += L + 1; steps += 1
    return n / steps, n * PLAIN / ms

rows = {c: [] for c in (4, 8, 15)}
for k, line in enumerate(open(path)):
    ids = engine.encode(json.loads(line)["prompt"])
    out = complete(engine, ids, base).tokens
    found = runs(ids, out)
    copied = sum(1 for f in found if f > 0) / len(out)
    parts = []
    for cap in rows:
        t, x = ideal(found, len(out), cap); rows[cap].append(x)
        parts.append(f"cap {cap:2d}: {t:.2f} tok/fwd {x:.2f}x")
    print(f"#{k} next token found earlier {copied:.0%} | " + " | ".join(parts), flush=True)
for cap, xs in rows.items():
    print(f"cap {cap}: mean {sum(xs)/len(xs):.2f}x")
