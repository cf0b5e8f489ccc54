"""First runs of two checkouts side by side: for each prompt, a fresh `spec generate --json` process for each
(checkout, method), in an order that rotates from prompt to prompt, each checkout with its own cache dir (its
own kernels, converted GGUF and learned state, emptied after a first untimed run).

    git worktree add /tmp/old COMMIT
    python benchmarks/scripts/first_runs_versus.py --old /tmp/old --oracle FILE.gguf [--draft DRAFT.gguf] \\
        --prompts benchmarks/prompts/code-24.jsonl benchmarks/prompts/edit-8.jsonl

Prints tokens/s per prompt, then per prompt file the geometric means over prompts of default/baseline within
each checkout and new/old for each method; each checkout's methods must agree token for token, and it counts the
prompts on which both checkouts wrote the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_runs import generate as first_run  # noqa: E402
from first_runs import geomean

from spec_cli.core.hardware import cpu_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--oracle", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--prompts", nargs="+", default=[str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl")])
    parser.add_argument("-n", type=int, default=128)
    args = parser.parse_args()
    caches = Path(tempfile.mkdtemp(prefix="spec-versus-"))
    sides = {"old": (Path(args.old).resolve(), caches / "old"), "new": (ROOT, caches / "new")}

    def generate(side: str, method: str, prompt: str) -> dict:
        checkout, cache = sides[side]
        run = argparse.Namespace(profile=None, oracle=str(Path(args.oracle).resolve()),
                                 draft=args.draft and str(Path(args.draft).resolve()), dtype=None,
                                 n=args.n, extra=None, checkout=str(checkout))
        return first_run(run, method, prompt, env={"SPEC_CACHE_DIR": str(cache)})

    print(f"{cpu_name()}, {os.cpu_count()} CPUs; old {sides['old'][0]}, new {ROOT}; {args.n} tokens, greedy, "
          f"a fresh process each", flush=True)
    for side in sides:  # kernels built, the files converted (a draft's too), draft2 fitted; then no learned state
        for method in ("baseline", "default"):
            generate(side, method, "def f():")
        shutil.rmtree(sides[side][1] / "learned", ignore_errors=True)
    keys = [(side, method) for side in sides for method in ("baseline", "default")]
    for path in args.prompts:
        prompts = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
        rates: dict = {key: [] for key in keys}
        same = 0
        print(f"\n{Path(path).name}\nprompt " + " ".join(f"{s + '-' + m:>12}" for s, m in keys))
        for i, prompt in enumerate(prompts):
            tokens = {}
            for key in keys[i % 4:] + keys[: i % 4]:
                record = generate(*key, prompt)
                rates[key].append(record["tokens_per_second"])
                tokens[key] = record["tokens"]
            for side in sides:
                if tokens[(side, "baseline")] != tokens[(side, "default")]:
                    raise SystemExit(f"{side}: default differs from baseline on prompt {i}")
            same += tokens[("old", "baseline")] == tokens[("new", "baseline")]
            print(f"{i:>6} " + " ".join(f"{rates[key][-1]:>12.1f}" for key in keys), flush=True)

        def ratio(a, b):
            return geomean([x / y for x, y in zip(rates[a], rates[b])])

        print(f"default/baseline: old {ratio(('old', 'default'), ('old', 'baseline')):.3f}, new "
              f"{ratio(('new', 'default'), ('new', 'baseline')):.3f}; new/old: baseline "
              f"{ratio(('new', 'baseline'), ('old', 'baseline')):.3f}, default "
              f"{ratio(('new', 'default'), ('old', 'default')):.3f} (geometric means over prompts; outputs "
              f"identical within each checkout; the same text in both on {same}/{len(prompts)})")
    shutil.rmtree(caches, ignore_errors=True)


if __name__ == "__main__":
    main()
