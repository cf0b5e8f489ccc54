"""pyfam's oracle in memory against the same oracle mostly on disk (--max-memory), in fresh processes.

    python benchmarks/scripts/offload.py [--max-memory cpu=30MiB] [-n 96] [--methods baseline,speculative,staged]
    python benchmarks/scripts/offload.py --costs      # ms per oracle forward by its tokens, in memory and offloaded
    python benchmarks/scripts/offload.py --warm       # the prompts in one process: the controller warm throughout

Each prompt runs `spec generate -p benchmarks/pyfam.toml --dtype float32 --untuned -m METHOD --json`, greedy,
once per method in memory and once offloaded, each a new process (the offloaded weights are read from disk
at every forward), the order rotating from prompt to prompt. Prints tokens/s per run (the decoding's, not
the load's), whether every offloaded output equals the in-memory one, where the layers went, and staged
against the offloaded baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # (this checkout's spec_cli, as `python -m spec_cli` in ROOT runs it)
PROMPTS = [  # short function headers, not used to tune anything
    "def merge_sorted(a, b):\n",
    "def count_words(text):\n",
    "def flatten(nested):\n",
    "def is_prime(n):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_csv_line(line, sep=','):\n",
]


def run(prompt: str, method: str, tokens: int, max_memory: str | None, threads: int | None = None) -> dict:
    command = [sys.executable, "-m", "spec_cli", "generate", "-p", str(ROOT / "benchmarks" / "pyfam.toml"),
               "--dtype", "float32", "--untuned", "-n", str(tokens), "-t", "0", "-m", method, "--json", prompt]
    if max_memory:
        command += ["--max-memory", max_memory]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPEC_BACKGROUND_FIT": "0"}
    if threads:  # (one thread: a busy neighbour on a 2-core machine no longer stalls every parallel region)
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(command)}\n{done.stderr}")
    return json.loads(done.stdout)


def costs(max_memory: str) -> None:
    """Milliseconds per oracle forward of 1 to 32 tokens after a 100-token prefix, in memory and offloaded."""
    import time

    from spec_cli.engine import Engine
    from spec_cli.exec import Runner
    from spec_cli.exec import placement as offload
    from spec_cli.models import profiles

    profile = profiles.load(str(ROOT / "benchmarks" / "pyfam.toml"))
    print("tokens  " + "  ".join(f"{n:>6}" for n in (1, 2, 4, 8, 16, 32)))
    for where, limits in (("memory", ()), ("offloaded", offload.parse(max_memory))):
        engine = Engine(profile.__class__(**{**vars(profile), "max_memory": limits}), dtype="float32")
        runner = Runner(engine.oracle.model, capacity=512)
        runner.forward(list(range(1, 101)), commit=100)
        row = []
        for n in (1, 2, 4, 8, 16, 32):
            times = []
            for _ in range(12):
                start = time.perf_counter()
                runner.forward(list(range(5, 5 + n)))
                times.append(time.perf_counter() - start)
                runner.keep([])
            row.append(statistics.median(times[2:]) * 1000)
        print(f"{where:<9}" + "  ".join(f"{ms:6.1f}" for ms in row) + " ms")


def warm(max_memory: str, tokens: int) -> None:
    """Baseline and staged over the prompts in this process (the staged controller learning from one to the
    next), in memory and offloaded, with the share of the time in each model's forwards."""
    import dataclasses
    import time

    from spec_cli.completion import complete
    from spec_cli.engine import Engine
    from spec_cli.exec import placement as offload
    from spec_cli.exec import runner
    from spec_cli.models import profiles

    spent: dict = {}
    forward = runner.Runner.forward

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            key = "oracle" if self.model is engine.oracle.model else "draft"
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

    runner.Runner.forward = timed
    profile = profiles.load(str(ROOT / "benchmarks" / "pyfam.toml"))
    for where, limits in (("memory", ()), ("offloaded", offload.parse(max_memory))):
        engine = Engine(dataclasses.replace(profile, max_memory=limits), dtype="float32", need_draft=True)
        rates = {}
        for method in ("baseline", "staged"):
            plan = engine.plan(profile.decoding.replace(method=method, max_new_tokens=tokens, temperature=0.0))
            seconds = made = 0
            spent.clear()
            for prompt in PROMPTS:
                done = complete(engine, engine.encode(prompt), plan)
                seconds, made = seconds + done.seconds, made + done.stats.new_tokens
            rates[method] = made / seconds
            shares = ", ".join(f"{model} {share / seconds:.0%}" for model, share in sorted(spent.items()))
            print(f"{where:<9} {method:<8} {rates[method]:6.1f} tok/s  (forwards: {shares})")
        print(f"{where:<9} staged {rates['staged'] / rates['baseline']:.2f}x baseline")


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-memory", default="cpu=30MiB")
    parser.add_argument("-n", type=int, default=96)
    parser.add_argument("--methods", default="baseline,speculative,staged")
    parser.add_argument("--out", type=Path, help="write every run's record (less its events) here as JSON lines")
    parser.add_argument("--costs", action="store_true", help="time oracle forwards by their tokens instead")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every run (default: torch's)")
    parser.add_argument("--warm", action="store_true", help="the prompts in one process instead")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="only the first N prompts")
    args = parser.parse_args()
    if args.threads and (args.costs or args.warm):
        import torch

        torch.set_num_threads(args.threads)
    if args.costs:
        return costs(args.max_memory)
    if args.warm:
        return warm(args.max_memory, args.n)
    methods = args.methods.split(",")
    runs = [(method, where) for method in methods for where in ("memory", "offloaded")]
    rates: dict = {run_: [] for run_ in runs}
    forwards: dict = {run_: [] for run_ in runs}
    same, placements, records = 0, set(), []
    prompts = PROMPTS[: args.prompts]
    for i, prompt in enumerate(prompts):
        order = runs[i % len(runs):] + runs[: i % len(runs)]
        got = {}
        for method, where in order:
            record = run(prompt, method, args.n, args.max_memory if where == "offloaded" else None, args.threads)
            got[method, where] = record
            rates[method, where].append(record["tokens_per_second"])
            stats = record["stats"]
            forwards[method, where].append((stats["tokens_per_oracle_forward"],
                                            stats["proposed"].get("oracle", 0) / stats["oracle_forwards"]))
            if where == "offloaded":
                placements.add(json.dumps(record["weights"].get("placement")))
            records.append({k: v for k, v in record.items() if k != "events"} | {"where": where})
        reference = got["baseline", "memory"]["tokens"] if "baseline" in methods else got[methods[0], "memory"]["tokens"]
        identical = all(record["tokens"] == reference for record in got.values())
        same += identical
        print(f"{prompt.splitlines()[0]:<40} " + "  ".join(
            f"{m[:4]}/{w[:3]} {got[m, w]['tokens_per_second']:6.1f}" for m, w in runs) + ("" if identical else "  DIFFERS"),
            flush=True)
    print(f"\n{len(prompts)} prompts, {args.n} tokens, greedy, float32, {args.threads or 'default'} threads; "
          f"offloaded: --max-memory {args.max_memory}, layers {', '.join(sorted(placements))}")
    for run_ in runs:
        print(f"  {run_[0]:<12} {run_[1]:<10} {geomean(rates[run_]):7.1f} tok/s (geomean; median "
              f"{statistics.median(rates[run_]):.1f})  {statistics.fmean(t for t, _ in forwards[run_]):.2f} "
              f"tokens/oracle forward, {statistics.fmean(n for _, n in forwards[run_]):.1f} draft tokens verified "
              f"per oracle forward")
    print(f"prompts whose every output is identical to the in-memory baseline's: {same}/{len(prompts)}")
    if "baseline" in methods:
        base = rates["baseline", "offloaded"]
        print(f"offloaded baseline against in-memory: {geomean(base) / geomean(rates['baseline', 'memory']):.2f}x")
        for method in methods:
            if method != "baseline":
                ratios = [a / b for a, b in zip(rates[method, "offloaded"], base)]
                print(f"offloaded {method} against the offloaded baseline: {geomean(ratios):.2f}x (geomean; per "
                      f"prompt {', '.join(f'{r:.2f}' for r in ratios)})")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
