"""Ad hoc: how often the edited copy (Index.edited) is offered and how far it is right, against the lookup's first
branch, on the final text (staged, warm)."""
import json
import sys

sys.path.insert(0, ".")
from spec_cli.completion import complete
from spec_cli.core.settings import Decoding
from spec_cli.draft2.lookup import Index
from spec_cli.engine import Engine
from spec_cli.models import profiles

oracle, f = sys.argv[1], sys.argv[2]
calls = []
edited, guess = Index.edited, Index.guess
def noted(self, text, depth):
    out = edited(self, text, depth)
    lk = guess(self, text, depth, 1, 99)
    calls.append((len(text), [g.token for g in out], [g.token for g in lk]))
    return out
Index.edited = noted
engine = Engine(profiles.select(None, oracle, None, "default"))
plan = engine.plan(Decoding(method="staged", max_new_tokens=128))
tot = dict(calls=0, offered=0, e_right=0, l_right=0, e_first=0, l_first=0, e_better=0, l_better=0)
for line in open(f):
    ids = engine.encode(json.loads(line)["prompt"])
    calls.clear()
    b = complete(engine, ids, plan)
    full = ids + b.tokens
    for at, e, l in calls:
        truth = full[at:at + 16]
        def run(c):
            k = 0
            while k < len(c) and k < len(truth) and c[k] == truth[k]: k += 1
            return k
        tot["calls"] += 1
        if e:
            tot["offered"] += 1
            re, rl = run(e), run(l)
            tot["e_right"] += re; tot["l_right"] += rl
            tot["e_first"] += re > 0; tot["l_first"] += rl > 0
            tot["e_better"] += re > rl; tot["l_better"] += rl > re
print(tot)
