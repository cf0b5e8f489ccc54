"""The runner of an earlier commit against today's, side by side in one process, on pyfam and HumanEval.

    python benchmarks/scripts/runner_before_after.py [COMMIT] [--dtype float32] [--tasks 100-111] [-n 128]

Both runners drive the same loaded models under today's decoding strategies (which only use the runner's
public API), prompt by prompt, alternating which goes first; prints tokens/s per method and the ratio.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spec_cli import profiles
from spec_cli.decoding import Models
from spec_cli.methods import decode
from spec_cli.engine import Engine
from spec_cli.events import Token
from spec_cli.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
HUMANEVAL = ROOT.parent / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def old_runner(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:spec_cli/runner.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "runner_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("runner_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Runner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("commit", nargs="?", default="58baac0")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tasks", default="100-111")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--methods", default="baseline,speculative,staged")
    args = parser.parse_args()
    first, last = (int(x) for x in args.tasks.split("-"))
    problems = [json.loads(line) for line in gzip.open(HUMANEVAL)][first : last + 1]
    engine = Engine(profiles.load(str(ROOT / "benchmarks" / "pyfam.toml")), dtype=args.dtype)
    oracle, draft = engine.oracle.model, engine.load_draft().model
    Before = old_runner(args.commit)
    runners = {
        "before": Models(Before(oracle, engine.vocab_size, 1024), Before(draft, engine.vocab_size, 1024), eos=engine.eos),
        "after": Models(Runner(oracle, engine.vocab_size, 1024), Runner(draft, engine.vocab_size, 1024), eos=engine.eos),
    }
    settings = engine.profile.decoding
    rates: dict = {}
    for i, problem in enumerate(problems):
        ids = engine.encode(problem["prompt"])
        for method in args.methods.split(","):
            chosen = settings.replace(method=method, max_new_tokens=args.n, temperature=0.0)
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            outputs = {}
            for label in order:
                start = time.perf_counter()
                outputs[label] = [e.token for e in decode(runners[label], ids, chosen)
                                  if isinstance(e, Token) and e.output]
                rates.setdefault((method, label), []).append(len(outputs[label]) / (time.perf_counter() - start))
            same = outputs["before"] == outputs["after"]
            print(f"{problem['task_id']:14} {method:12} before {rates[(method, 'before')][-1]:6.1f} "
                  f"after {rates[(method, 'after')][-1]:6.1f} tok/s{'' if same else '  (outputs differ)'}",
                  flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?") if sys.platform == "linux" else "?"
    print(f"\n{cpu}, {args.dtype}, {len(problems)} problems, {args.n} tokens, greedy; runner {args.commit} vs today")
    for method in args.methods.split(","):
        before, after = rates[(method, "before")], rates[(method, "after")]
        ratios = [a / b for a, b in zip(after, before)]
        print(f"{method:12} before {statistics.mean(before):6.1f}  after {statistics.mean(after):6.1f} tok/s  "
              f"after/before geomean {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
