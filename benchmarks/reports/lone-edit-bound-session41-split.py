"""Ad hoc (session 41): where a lone model's staged step spends its time: oracle forwards (by rows) against the rest."""
import json
import sys
import time
from collections import defaultdict

sys.path.insert(0, ".")  # (run from spec's root)
from spec_cli.completion import complete
from spec_cli.core.settings import Decoding
from spec_cli.engine import Engine
from spec_cli.exec import runner as R
from spec_cli.models import profiles

oracle, path = sys.argv[1], sys.argv[2]
engine = Engine(profiles.select(None, oracle, None, "default"))
plan = engine.plan(Decoding(method=sys.argv[3] if len(sys.argv) > 3 else "staged", max_new_tokens=128))
spent = defaultdict(float); count = defaultdict(int)
fwd = R.Runner.forward
def timed(self, tokens, *a, **k):
    t = time.perf_counter(); out = fwd(self, tokens, *a, **k)
    n = len(tokens); b = n if n <= 16 else 99
    spent[b] += time.perf_counter() - t; count[b] += 1
    return out
R.Runner.forward = timed
lines = open(path).readlines()
ids0 = engine.encode(json.loads(lines[0])["prompt"]); complete(engine, ids0, plan)  # warm
spent.clear(); count.clear()
total = 0.0
for line in lines:
    ids = engine.encode(json.loads(line)["prompt"])
    r = complete(engine, ids, plan)
    total += r.seconds - 0
fw = sum(v for k, v in spent.items() if k != 99)
print(f"total {total:.2f}s, prompt reads {spent[99]:.2f}s, forwards {fw:.2f}s, rest {total - fw - spent[99]:.2f}s")
for k in sorted(count):
    print(f"  {k:3d} rows: {count[k]:4d} forwards, {spent[k]/count[k]*1000:.1f} ms each")
