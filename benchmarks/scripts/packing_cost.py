"""A forward's cost by token count, with the projections packed for oneDNN (spec_cli/exec/packing.py) and not,
on pyfam's oracle and draft and on SmolLM2-135M (the GGUF in ../shared/models), after a 199-token prompt.

    python benchmarks/scripts/packing_cost.py [--dtype float32] [--models pyfam,smollm2] [--rounds 5]

Each round times every token count once per model and setting, settings alternating; prints the median ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner
from spec_cli.models import profiles
from spec_cli.models.loading import load

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ModelRef(str(ROOT.parent / "shared" / "models" / "smollm2-135m-instruct"),
                   gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
TOKENS = (1, 2, 4, 8, 16, 32)


def milliseconds(runner: Runner, n: int, reps: int) -> float:
    runner.forward([5] * n)
    runner.keep([])
    start = time.perf_counter()
    for _ in range(reps):
        runner.forward([5] * n)
        runner.keep([])
    return (time.perf_counter() - start) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--models", default="pyfam,smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    models = {}
    if "pyfam" in args.models:
        profile = profiles.load(str(ROOT / "benchmarks" / "pyfam.toml"))
        models["pyfam oracle"] = load(profile.oracle, cpu, dtype).model
        models["pyfam draft"] = load(profile.draft, cpu, dtype).model
    if "smollm2" in args.models:
        models["smollm2-135m"] = load(SMOLLM2, cpu, dtype).model
    for name, model in models.items():
        runners = {pack: Runner(model, capacity=512, pack=pack) for pack in (False, None)}
        for runner in runners.values():
            runner.forward(list(range(1, 200)), commit=199)
        reps = max(3, int(200 / (1 + sum(p.numel() for p in model.parameters()) / 2e6)))
        times = {(pack, n): [] for pack in runners for n in TOKENS}
        for r in range(args.rounds):
            order = list(runners) if r % 2 == 0 else list(runners)[::-1]
            for n in TOKENS:
                for pack in order:
                    times[pack, n].append(milliseconds(runners[pack], n, reps))
        print(f"{name} ({args.dtype}, {runners[None].packed} products packed): ms per forward, median of {args.rounds}")
        print("tokens   " + "".join(f"{n:>8}" for n in TOKENS))
        for pack, label in ((False, "unpacked"), (None, "packed  ")):
            print(f"{label} " + "".join(f"{statistics.median(times[pack, n]):8.2f}" for n in TOKENS))


if __name__ == "__main__":
    main()
