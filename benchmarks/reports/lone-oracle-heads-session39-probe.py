"""Ad hoc (session 39), from spec's root: a model alone with its fitted heads, warm, in one process (each prompt
baseline then staged, identical asserted): steps that guess, the heads' nodes offered / verified / accepted, how
often head 1's first guess is the step's first token (top1) or among its four (top4), tokens a forward and speed
after the first token. SPEC_CACHE_DIR holds the heads (`spec tune --only heads`).

    SPEC_CACHE_DIR=DIR python lone-oracle-heads-session39-probe.py GGUF PROMPTS.jsonl[,MORE.jsonl] VARIANT

VARIANT: heads (as spec runs), noheads (the plan's heads dropped), forced (every step guesses: the controller's
`guess` always true), forced-noheads, head1 (head 1's guesses alone, no head 2 under them).
"""
import json
import sys
from collections import Counter

sys.path.insert(0, ".")
from spec_cli.completion import complete  # noqa: E402
from spec_cli.core.settings import Decoding  # noqa: E402
from spec_cli.decoding import adapt, staged  # noqa: E402
from spec_cli.draft2 import heads  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402
from spec_cli.models import profiles  # noqa: E402

oracle, files, variant = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
count = Counter()
offered = []  # the step's heads' guesses, as made
verify, guesses = staged._verify, heads.Heads.guesses


def counted_verify(runner, tree, chosen, slots, tail, last, sampler, draws, looked):
    verdict, token = verify(runner, tree, chosen, slots, tail, last, sampler, draws, looked)
    count["steps"] += 1
    count["guessing steps"] += bool(tree.nodes)
    count["rows"] += len(chosen)
    for i, node in enumerate(tree.nodes):
        if node.stage == "heads":
            count["heads offered"] += 1
            count["heads verified"] += i in chosen
    count["heads accepted"] += sum(tree.nodes[i].stage == "heads" for i in verdict.path)
    if offered:
        truth = tree.nodes[verdict.path[0]].token if verdict.path else verdict.final
        count["top1 tried"] += 1
        count["top1 right"] += offered[0].token == truth
        count["top4 right"] += any(g.token == truth for g in offered)
        offered.clear()
    return verdict, token


def noted_guesses(self, *args, **kwargs):
    if variant == "head1":
        kwargs["below"] = 0
    out = guesses(self, *args, **kwargs)
    offered[:] = out
    return out


staged._verify, heads.Heads.guesses = counted_verify, noted_guesses
if variant.startswith("forced"):
    adapt.Controller.guess = lambda self, cue=None, priced=False: True
engine = Engine(profiles.select(None, oracle, None, "default"))
plan = engine.plan(Decoding(method="staged", max_new_tokens=128))
print("heads", plan.heads is not None)
if variant.endswith("noheads"):
    plan = plan.replace(heads=None)
base = Decoding(method="baseline", max_new_tokens=128)
plain = spec = 0.0
tokens = forwards = 0
for f in files:
    for line in open(f):
        ids = engine.encode(json.loads(line)["prompt"])
        a, b = complete(engine, ids, base), complete(engine, ids, plan)
        assert a.tokens == b.tokens
        plain += a.seconds - (a.first_token_seconds or 0)
        spec += b.seconds - (b.first_token_seconds or 0)
        tokens += b.stats.new_tokens
        forwards += b.stats.oracle_forwards
print(variant, f"after first token: {plain / spec:.2f}x baseline; {tokens / forwards:.2f} tok/fwd;", dict(count))
