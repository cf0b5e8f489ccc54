"""`spec generate --compile` under TORCH_LOGS=graph_breaks,recompiles, for every method, greedy and top-k, at
two lengths: graph breaks and recompiles counted from the log, output compared with the eager run.

    python benchmarks/scripts/compile_check.py [--profile benchmarks/pyfam.toml] [--lengths 32,96]

The compile backend is SPEC_COMPILE_BACKEND's (default here: eager, which traces exactly what inductor
would compile, without building kernels). A step that recompiles per token shows as more recompiles at
the longer length; a graph break fails the run (fullgraph=True).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

METHODS = ("baseline", "speculative", "staged", "self")
MODES = {"greedy": [], "top-k": ["-t", "1", "--top-k", "50", "--seed", "1"]}


def generate(profile: str, method: str, mode: str, n: int, compiled: bool, extra: list[str]) -> tuple[dict, str]:
    args = [sys.executable, "-m", "spec_cli", "generate", "-p", profile, "-m", method, "-n", str(n),
            "--dtype", "float32", "--json", "--compile" if compiled else "--no-compile", "--fixed-tree",
            *MODES[mode], *extra, "def fib(n):"]
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}
    env.setdefault("SPEC_COMPILE_BACKEND", "eager")
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout), done.stderr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="benchmarks/pyfam.toml")
    parser.add_argument("--lengths", default="32,96")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--skip", default="5,6,7", help="the self-draft's skipped attention and MLP sublayers")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    skip = ["--skip-attention", args.skip, "--skip-mlp", args.skip]
    print(f"{'method':12} {'mode':7} " + " ".join(f"{'n=' + str(n):>22}" for n in lengths))
    for method in args.methods.split(","):
        extra = skip if method == "self" else []
        for mode in MODES:
            cells = []
            for n in lengths:
                compiled, log = generate(args.profile, method, mode, n, True, extra)
                eager, _ = generate(args.profile, method, mode, n, False, extra)
                breaks = log.count("Graph break")
                recompiles = log.count("Recompiling function")
                same = "same" if compiled["tokens"] == eager["tokens"] else "DIFFERENT"
                cells.append(f"{breaks} breaks {recompiles:2} recompiles {same}")
            print(f"{method:12} {mode:7} " + " ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
