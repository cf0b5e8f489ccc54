"""Where a method's text leaves baseline's: the first decision whose logits are not baseline's bits.

    python benchmarks/scripts/gpu_identity.py -p benchmarks/pyfam.toml [--tasks 0-7] [--modes greedy,topk]
        [--backends graphs,eager] [--device cuda]

For each problem and mode, in one process per backend (`graphs`: compiled and captured; `eager`), as
`spec bench humaneval` orders them: baseline, the other methods, then baseline again. Every decision's logits
(coupled scores when sampling) are kept: baseline's one a step, staged's plain steps' and the rows its walk
down a tree read. Printed: whether each method's tokens are baseline's, whether baseline repeats its own bits,
and for staged the first decision whose row is not baseline's bits: the step's kind, the row's place in its
forward, the difference, and whether it changed the token. Written for issue 49 (bfloat16 on an H200 left
baseline on 1 of 8 problems in each mode).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from spec_cli.completion import complete
from spec_cli.decoding import chain, staged
from spec_cli.engine import Engine
from spec_cli.models import profiles

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"
MODES = {"greedy": dict(temperature=0.0, top_k=0), "topk": dict(temperature=1.0, top_k=50)}
kept: list | None = None  # the decisions of the completion under way: (row on the host, kind, row, rows)


def record() -> None:
    pick, walk = chain.pick, staged._walk

    def picked(logits, sampler, draws):
        if kept is not None and logits.dim() == 1:
            kept.append((logits.float().cpu(), "plain", 0, 1))
        return pick(logits, sampler, draws)

    def walked(tree, chosen, logits):
        verdict = walk(tree, chosen, logits)
        if kept is not None:
            row = {node: k + 1 for k, node in enumerate(chosen)}
            rows = [0] + [row[node] for node in verdict.path]
            for r in rows:
                kept.append((logits[r].float().cpu(), "tree", r, len(chosen) + 1))
        return verdict

    chain.pick, staged.pick, staged._walk = picked, picked, walked


def run(engine, ids, settings, method):
    global kept
    kept = [] if method in ("baseline", "staged") else None
    done = complete(engine, ids, settings.replace(method=method))
    decisions, kept = kept, None
    return done.tokens, decisions


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", default="benchmarks/pyfam.toml")
    parser.add_argument("--tasks", default="0-7")
    parser.add_argument("--modes", default="greedy,topk")
    parser.add_argument("--methods", default="speculative,staged")
    parser.add_argument("--backends", default="graphs,eager")
    parser.add_argument("--device", default=None)
    parser.add_argument("-n", type=int, default=128)
    args = parser.parse_args()
    first, last = (int(x) for x in args.tasks.split("-"))
    problems = [json.loads(line)["prompt"] for line in gzip.open(DATA, "rt")][first:last + 1]
    profile = profiles.load(args.profile)
    record()
    for backend in args.backends.split(","):
        engine = Engine(profile, device=args.device, need_draft=True, compile=backend == "graphs")
        print(f"{backend} · {engine.device.type} {str(engine.dtype).removeprefix('torch.')}", flush=True)
        methods = args.methods.split(",")
        warm = engine.encode(problems[0])
        for method in ["baseline"] + methods:
            complete(engine, warm, profile.decoding.replace(method=method, max_new_tokens=16, **MODES["greedy"]))
        for i, prompt in enumerate(problems):
            ids = engine.encode(prompt)
            for mode in args.modes.split(","):
                settings = profile.decoding.replace(max_new_tokens=args.n, seed=i, **MODES[mode])
                order = methods[i % len(methods):] + methods[: i % len(methods)]
                base, base_rows = run(engine, ids, settings, "baseline")
                words = []
                for method in order:
                    tokens, rows = run(engine, ids, settings, method)
                    at = first_difference(tokens, base)
                    words.append(f"{method} {'same' if at is None else f'DIFFERS at token {at}'}")
                    if method == "staged":
                        words.append(describe(rows, base_rows))
                again, again_rows = run(engine, ids, settings, "baseline")
                bits = all(torch.equal(x[0], y[0]) for x, y in zip(again_rows, base_rows))
                words.append(f"baseline again {'same' if again == base else 'DIFFERS'}"
                             f"{'' if bits else ' (other bits)'}")
                print(f"  problem {first + i} {mode:6}: " + "; ".join(words), flush=True)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def describe(rows, base_rows) -> str:
    """The first staged decision whose row is not baseline's bits."""
    for k, ((row, kind, place, size), (base, *_)) in enumerate(zip(rows, base_rows)):
        if not torch.equal(row, base):
            diff = (row - base).abs()
            finite = diff[torch.isfinite(diff)]
            flips = int(row.argmax()) != int(base.argmax())
            return (f"first other bits at decision {k} ({kind} step, row {place} of {size}; "
                    f"{int((row != base).sum())} logits differ, at most {float(finite.max()) if finite.numel() else 0:.3g}"
                    f"{', the token too' if flips else ''})")
    return "every decision baseline's bits"


if __name__ == "__main__":
    main()
