"""Where a staged step's time goes, and what the controller decided: each step's report, summed.

    python benchmarks/scripts/controller_trace.py -p benchmarks/pyfam.toml [--mode topk] [--tasks 0-3] [--device cuda]
        [--flat 8,7]

`--flat ORACLE_MS,DRAFT_MS` plays a GPU on a CPU: every forward of the oracle (the draft) takes at least that
long, whatever its rows (a GPU's small forwards cost about the same; pyfam's draft costs nearly what its oracle
does there), so the controller meets the costs it meets on a GPU.

For each problem (HumanEval, 128 tokens; staged, then baseline for its rate), in one process: the steps that
speculated and those that did not, their tokens, and their time split into the oracle's forward and walk, the
drafting (and of it the draft's forwards: their count and rows), and the rest of the step (the host's work around
them: `Step.wall` less both), and the controller's
rates at the end. Written to find why top-k staged on a GPU ran at 0.66x baseline while greedy ran at 1.9x.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

from spec_cli.completion import complete
from spec_cli.decoding import adapt
from spec_cli.engine import Engine
from spec_cli.exec.runner import Runner
from spec_cli.models import profiles

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", default="benchmarks/pyfam.toml")
    parser.add_argument("--mode", default="topk", choices=["greedy", "topk"])
    parser.add_argument("--tasks", default="0-3")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--flat", type=milliseconds, default=None, help="ORACLE_MS,DRAFT_MS: a GPU's costs")
    args = parser.parse_args()
    first, last = (int(x) for x in args.tasks.split("-"))
    problems = [json.loads(line)["prompt"] for line in gzip.open(DATA, "rt")][first:last + 1]
    profile = profiles.load(args.profile)
    engine = Engine(profile, device=args.device, dtype=args.dtype, need_draft=True)
    if args.flat:
        flat(engine, *args.flat)
    sampled = args.mode == "topk"
    settings = profile.decoding.replace(max_new_tokens=128, temperature=1.0 if sampled else 0.0,
                                        top_k=50 if sampled else 0, seed=1)
    steps: list[adapt.Step] = []
    report, seen = adapt.Controller.report, []

    def traced(self, step):
        steps.append(step)
        seen.append(self)
        return report(self, step)

    adapt.Controller.report = traced
    plan = engine.plan(settings.replace(method="staged"))
    complete(engine, engine.encode("def f(x):"), plan)  # (warm)
    print(f"{profile.name} · {engine.device.type} {str(engine.dtype).removeprefix('torch.')} · {args.mode} · "
          f"HumanEval {args.tasks}", flush=True)
    totals = defaultdict(int)
    for i, prompt in enumerate(problems):
        ids = engine.encode(prompt)
        base = complete(engine, ids, settings.replace(method="baseline"))
        steps.clear()
        start = time.perf_counter()
        done = complete(engine, ids, plan)
        seconds = time.perf_counter() - start
        kinds = defaultdict(lambda: defaultdict(float))
        for s in steps:
            k = kinds["speculated" if s.speculated else ("guessed" if s.verified else "plain")]
            k["steps"] += 1
            k["tokens"] += s.tokens
            k["oracle"] += s.oracle_seconds
            k["drafting"] += s.drafting
            k["draft forwards"] += sum(seconds for _, seconds in s.drafts)
            k["draft rows"] += sum(rows for rows, _ in s.drafts)
            k["drafts"] += len(s.drafts)
            k["rest"] += max(0.0, (s.wall or 0.0) - s.oracle_seconds - s.drafting)
        drafts = done.stats.forwards.get("draft", 0)
        totals["tokens"] += done.stats.new_tokens
        totals["oracle"] += done.stats.oracle_forwards
        totals["draft"] += drafts
        print(f"problem {first + i}: staged {done.stats.new_tokens / seconds:7.1f} tok/s, baseline "
              f"{base.tokens_per_second:7.1f} ({done.stats.new_tokens / seconds / base.tokens_per_second:.2f}x), "
              f"{done.stats.tokens_per_oracle_forward:.2f} tokens an oracle forward, "
              f"{drafts / done.stats.new_tokens:.2f} draft forwards a token", flush=True)
        for name, k in kinds.items():
            total = k["oracle"] + k["drafting"] + k["rest"]
            print(f"  {name:10} {k['steps']:4.0f} steps {k['tokens']:4.0f} tokens · ms a step: oracle "
                  f"{1000 * k['oracle'] / k['steps']:6.2f} drafting {1000 * k['drafting'] / k['steps']:6.2f} "
                  f"(its forwards {1000 * k['draft forwards'] / k['steps']:6.2f}, {k['drafts'] / k['steps']:.1f} of "
                  f"{k['draft rows'] / max(1, k['drafts']):.1f} rows) rest "
                  f"{1000 * k['rest'] / k['steps']:6.2f} · {k['tokens'] / total if total else 0:7.1f} tok/s", flush=True)
        if seen:
            c = seen[-1]
            print(f"  plain steps, ms a token: {' '.join(f'{1000 * x:.1f}' for x in c.plain)}")
            print(f"  controller: spec rate {c.spec_rate or 0:.1f} tok/s, plain rate {c.plain_rate or 0:.1f}, "
                  f"credit {c.credit * 1000:.2f} ms", flush=True)
    print(f"all: {totals['tokens'] / totals['oracle']:.2f} tokens an oracle forward, "
          f"{totals['draft'] / totals['tokens']:.2f} draft forwards a token")


def milliseconds(text: str) -> tuple[float, float]:
    """`--flat`'s ORACLE_MS,DRAFT_MS, in seconds."""
    try:
        oracle, draft = (float(x) / 1000 for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"two numbers of milliseconds, ORACLE_MS,DRAFT_MS: not {text!r}") from None
    return oracle, draft


def flat(engine: Engine, oracle: float, draft: float) -> None:
    """Every forward of the oracle's model at least `oracle` seconds, of any other at least `draft`."""
    forward = Runner.forward

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        result = forward(self, *args, **kwargs)
        self.synchronize()
        least = oracle if self.model is engine.oracle.model else draft
        while time.perf_counter() - start < least:
            pass
        return result

    Runner.forward = timed


if __name__ == "__main__":
    main()
