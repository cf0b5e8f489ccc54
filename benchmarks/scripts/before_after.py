"""spec of an earlier commit against today's, side by side in one process, on pyfam and HumanEval.

    python benchmarks/scripts/before_after.py [COMMIT] [--dtype float32] [--tasks 100-111] [-n 128]
        [--profile benchmarks/pyfam.toml]

The earlier commit's whole `spec_cli` package is imported under another name, each side loads the pyfam
pair (or `--profile`'s models) with its own Engine and runs its own `complete()` (runner and strategies
together), prompt by prompt, alternating which goes first; prints tokens/s per method and the ratio, and whether
outputs agree.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # today's spec_cli, run from anywhere
HUMANEVAL = ROOT.parent / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def package(commit: str, name: str):
    """The commit's spec_cli, importable as `name`."""
    archive = subprocess.run(["git", "archive", commit, "spec_cli", "profiles"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    folder = Path(tempfile.mkdtemp())
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(folder, filter="data")
    (folder / "spec_cli").rename(folder / name)
    for path in (folder / name).rglob("*.py"):
        path.write_text(re.sub(r"\bspec_cli\b", name, path.read_text()))
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def module(pkg: str, *places: str):
    """The first of `places` (a module's place in the package before and after the house moved) that exists."""
    for place in places:
        try:
            return importlib.import_module(f"{pkg}.{place}")
        except ModuleNotFoundError as error:
            if not error.name.startswith(f"{pkg}.{place.split('.')[0]}"):
                raise
    raise ModuleNotFoundError(f"none of {places} in {pkg}")


def side(pkg, profile: Path, dtype: str):
    profiles = module(pkg, "models.profiles", "profiles")
    engine = importlib.import_module(f"{pkg}.engine").Engine(profiles.load(str(profile)), dtype=dtype,
                                                             need_draft=True)
    complete = importlib.import_module(f"{pkg}.completion").complete
    plan = importlib.import_module(f"{pkg}.engine").Plan

    def run(ids, **settings):
        decoding = engine.profile.decoding.replace(**settings)
        done = complete(engine, ids, engine.plan(decoding) if hasattr(engine, "plan") else plan(decoding))
        return done.tokens, done.stats.new_tokens / done.seconds

    return engine, run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("commit", nargs="?", default="1abec4e")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tasks", default="100-111")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--methods", default="baseline,speculative,staged")
    parser.add_argument("--profile", default=str(ROOT / "benchmarks" / "pyfam.toml"),
                        help="a profile file (the Qwen pair: one naming $QWEN_1_5B and $QWEN_0_5B)")
    parser.add_argument("--topk", action="store_true", help="top-k sampling (k=50, T=1, coupled, seed = problem "
                                                           "index) instead of greedy")
    args = parser.parse_args()
    first, last = (int(x) for x in args.tasks.split("-"))
    problems = [json.loads(line) for line in gzip.open(HUMANEVAL)][first : last + 1]
    profile = Path(args.profile)
    package(args.commit, "spec_before")
    sides = {"before": side("spec_before", profile, args.dtype), "after": side("spec_cli", profile, args.dtype)}
    rates: dict = {}
    for i, problem in enumerate(problems):
        ids = sides["after"][0].encode(problem["prompt"])
        for method in args.methods.split(","):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            outputs = {}
            for label in order:
                sampling = dict(temperature=1.0, top_k=50, seed=i) if args.topk else dict(temperature=0.0)
                outputs[label], rate = sides[label][1](ids, method=method, max_new_tokens=args.n, **sampling)
                rates.setdefault((method, label), []).append(rate)
            same = outputs["before"] == outputs["after"]
            print(f"{problem['task_id']:14} {method:12} before {rates[(method, 'before')][-1]:6.1f} "
                  f"after {rates[(method, 'after')][-1]:6.1f} tok/s{'' if same else '  (outputs differ)'}",
                  flush=True)
    cpu = module("spec_cli", "core.hardware", "hardware").cpu_name()
    mode = "top-k 50" if args.topk else "greedy"
    print(f"\n{cpu}, {args.dtype}, {len(problems)} problems, {args.n} tokens, {mode}; spec {args.commit} vs today")
    for method in args.methods.split(","):
        before, after = rates[(method, "before")], rates[(method, "after")]
        ratios = [a / b for a, b in zip(after, before)]
        print(f"{method:12} before {statistics.mean(before):6.1f}  after {statistics.mean(after):6.1f} tok/s  "
              f"after/before geomean {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
