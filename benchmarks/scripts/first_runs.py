"""First runs: each method on each prompt in a fresh process (`spec generate ... --json`), as a user who types
one command meets it: no warm controller, no warm kernels.

    python benchmarks/scripts/first_runs.py --oracle ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts benchmarks/prompts/code-8.jsonl benchmarks/prompts/edit-8.jsonl
    python benchmarks/scripts/first_runs.py -p benchmarks/pyfam.toml --dtype float32 --methods baseline,speculative,staged

`--methods`: comma-separated; `default` runs with no --method at all (what the profile, `spec tune` or the
built-in default picks); a method may carry options of its own after `+` (`default+--draft2=lookup`), and
environment variables for its process (`default+SPEC_PROFILE_STEPS=1`). The methods take turns on each prompt, in an order that rotates from prompt to prompt.
Prints tokens/s per prompt, then per method and prompt file: the geometric mean of its speed relative to the
first method over prompts, total tokens over total seconds, how many outputs are identical to the first
method's, and on how many prompts it ran below 0.9x of it. `--out FILE` keeps every run's record (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spec_cli.core.hardware import cpu_name  # noqa: E402


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def read_prompts(path: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


def generate(args, method: str, prompt: str, env: dict | None = None) -> dict:
    """One fresh `spec generate --json` process (`env`: more environment for it)."""
    command = [sys.executable, "-m", "spec_cli", "generate", "--json", "-n", str(args.n), "-t", "0"]
    command += ["--profile", args.profile] if args.profile else []
    command += ["--oracle", args.oracle] if args.oracle else []
    command += ["--draft", args.draft] if args.draft else []
    command += ["--dtype", args.dtype] if args.dtype else []
    name, *options = re.split(r"\+(?=-|[A-Z_]+=)", method)  # (a variant: "default+--draft2=lookup"; a + before a
    # dash, or before an environment variable's NAME=: "default+SPEC_X=0")
    variables = dict(o.split("=", 1) for o in options if re.match(r"[A-Z_]+=", o))
    command += [] if name == "default" else ["--method", name]
    command += [o for o in options if not re.match(r"[A-Z_]+=", o)]
    command += args.extra or []
    command.append("-")
    checkout = Path(args.checkout).resolve() if args.checkout else ROOT
    env = {**os.environ, "PYTHONPATH": str(checkout), "NO_COLOR": "1", **variables, **(env or {})}
    done = subprocess.run(command, input=prompt, capture_output=True, text=True, cwd=checkout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def generation_rate(record: dict) -> float:
    """Tokens a second after the first token (the whole run's where it has none: a completion of one token)."""
    return record.get("generation_tokens_per_second") or record["tokens_per_second"]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-p", "--profile")
    parser.add_argument("--oracle")
    parser.add_argument("--draft")
    parser.add_argument("--dtype")
    parser.add_argument("--methods", default="baseline,default")
    parser.add_argument("--prompts", nargs="+", default=[str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl")])
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--out", help="append every run's record here (JSON lines)")
    parser.add_argument("--checkout", help="run another checkout's spec (a git worktree of an earlier commit); "
                                           "relative paths are then read from there")
    parser.add_argument("extra", nargs="*", help="more options for spec generate, after --")
    args = parser.parse_args()
    methods = args.methods.split(",")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; load average {load_average()}; methods {', '.join(methods)}; "
          f"{args.n} tokens, greedy, a fresh process each")
    runs: dict[tuple[str, int, str], dict] = {}
    for path in args.prompts:
        prompts = read_prompts(path)
        print(f"\n{Path(path).name}")
        widths = [max(14, len(m) + 2) for m in methods]
        print("prompt " + "".join(f"{m:>{w}}" for m, w in zip(methods, widths)) + "   load avg")
        for i, prompt in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for method in order:
                record = generate(args, method, prompt)
                runs[(path, i, method)] = record
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({**record, "file": path, "index": i, "run": method,
                                            "load": load_average(), "time": time.time()}) + "\n")
            print(f"{i:>6} " + "".join(f"{runs[(path, i, m)]['tokens_per_second']:>{w}.1f}"
                                        for m, w in zip(methods, widths))
                  + f"   {load_average():.2f}", flush=True)
        first = methods[0]
        for method in methods[1:]:
            ratios = [runs[(path, i, method)]["tokens_per_second"] / runs[(path, i, first)]["tokens_per_second"]
                      for i in range(len(prompts))]
            tokens = sum(len(runs[(path, i, method)]["tokens"]) for i in range(len(prompts)))
            seconds = sum(runs[(path, i, method)]["seconds"] for i in range(len(prompts)))
            base = sum(len(runs[(path, i, first)]["tokens"]) for i in range(len(prompts))) / sum(
                runs[(path, i, first)]["seconds"] for i in range(len(prompts)))
            same = sum(runs[(path, i, method)]["tokens"] == runs[(path, i, first)]["tokens"] for i in range(len(prompts)))
            slow = sum(r < 0.9 for r in ratios)
            after = [generation_rate(runs[(path, i, method)]) / generation_rate(runs[(path, i, first)])
                     for i in range(len(prompts))]
            print(f"{method}: {geomean(ratios):.2f}x {first} (geomean over prompts), {tokens / seconds:.1f} tok/s "
                  f"against {base:.1f} in all ({tokens / seconds / base:.2f}x), identical {same}/{len(prompts)}, "
                  f"below 0.9x on {slow}; after the first token {geomean(after):.2f}x")


if __name__ == "__main__":
    main()
