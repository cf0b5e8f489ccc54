"""What staged's controller costs where speculation does not pay: the oracle alone, staged with speculation
switched off (the loop and its bookkeeping), and staged as it is, in one process, a problem's runs taking
turns (every other round in reverse), each the median of three.

    python benchmarks/scripts/probe_cost.py --mode topk --tasks 27,35,38,41,44,45,46,54,100,105,107,111

Each variant has its own controller (kept across problems, as in `spec bench`). Prints the geometric mean over
problems of each variant's speed relative to the oracle alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import time
from pathlib import Path

from spec_cli.bench import MODES
from spec_cli.decoding import adapt
from spec_cli.engine import Engine
from spec_cli.models import profiles

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES), default="topk")
    parser.add_argument("--tasks", default="27,35,38,41,44,45,46,54,100,105,107,111")
    parser.add_argument("--dataset", default=str(ROOT.parent / "shared/data/humaneval/HumanEval.jsonl.gz"))
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    engine = Engine(profiles.load(str(ROOT / "benchmarks/pyfam.toml")), device="cpu", dtype="float32")
    with gzip.open(args.dataset, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    speculate = adapt.Controller.speculate
    controllers = {}  # variant -> the engine's controllers while it runs
    variants = {"baseline": None, "never": lambda self, cue=None: False, "staged": speculate}
    times: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    warm = False
    tasks = [int(t) for t in args.tasks.split(",")]
    for i in [tasks[0]] + tasks:  # the first pass warms up, untimed
        for r in range(args.rounds):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                engine._controllers = controllers.setdefault(name, {})
                adapt.Controller.speculate = variants[name] or speculate
                settings = engine.profile.decoding.replace(
                    max_new_tokens=args.n, method="baseline" if name == "baseline" else "staged", **MODES[args.mode])
                started = time.perf_counter()
                for _ in engine.events(engine.encode(prompts[i]), engine.plan(settings)):
                    pass
                if warm:
                    times[name].setdefault(i, []).append(time.perf_counter() - started)
        warm = True
    adapt.Controller.speculate = speculate
    medians = {v: {i: statistics.median(s) for i, s in by.items()} for v, by in times.items()}
    for name in ("never", "staged"):
        ratios = [medians["baseline"][i] / medians[name][i] for i in medians[name]]
        print(f"{args.mode} {name}: {math.exp(statistics.fmean(map(math.log, ratios))):.3f}x the oracle alone")


if __name__ == "__main__":
    main()
