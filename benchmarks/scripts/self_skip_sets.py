"""Self-speculative decoding with two skip sets against baseline, interleaved prompt by prompt.

    python benchmarks/scripts/self_skip_sets.py     (held-out HumanEval problems 150-161, 128 tokens, greedy)
"""

from spec_cli import humaneval
from spec_cli.core.families import Skip
from spec_cli.engine import Engine, Plan
from spec_cli.models import profiles
from spec_cli.tune import measure

profile = profiles.load("benchmarks/pyfam.toml")
engine = Engine(profile, need_draft=False)
problems = humaneval.load("../shared/data/humaneval/HumanEval.jsonl.gz")[150:162]
prompts = [engine.encode(p["prompt"]) for p in problems]
base = profile.decoding.replace(max_new_tokens=128)
arms = [("baseline", None),
        ("self, hand-picked: attention 5,6,7, MLP 6,7", Skip.of([5, 6, 7], [6, 7])),
        ("self, tuned: attention 3,7, MLP 1,3,4", Skip.of([3, 7], [1, 3, 4]))]
measure(engine, prompts[:1], base.replace(method="baseline"))  # warm-up
totals = {name: [0, 0.0, 0] for name, _ in arms}
for i, ids in enumerate(prompts):
    for name, skip in arms[i % len(arms):] + arms[: i % len(arms)]:
        score = measure(engine, [ids], Plan(base.replace(method="baseline" if skip is None else "self"), skip=skip))
        totals[name][0] += score.tokens
        totals[name][1] += score.seconds
        totals[name][2] += score.oracle_forwards
baseline = totals["baseline"][0] / totals["baseline"][1]
for name, (tokens, seconds, forwards) in totals.items():
    print(f"{name}: {tokens / seconds:.1f} tok/s = {tokens / seconds / baseline:.2f}x, "
          f"{tokens / forwards:.2f} tokens/oracle forward")
