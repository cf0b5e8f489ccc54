"""Speed of the decoding methods side by side in one process, on a profile's models and HumanEval prompts.

    python benchmarks/speed.py --prompts 12 --dtype bfloat16 float32 --draft2 benchmarks/pyfam-draft2.npz

Per dtype and mode (greedy; top-k 50 at T=1), each prompt runs every method in a rotating order (so drift
hits all alike) after an untimed warm-up. Reports tokens/s, the ratio to baseline (median over prompts and
overall), oracle forwards per token relative to baseline, and for greedy every divergence from baseline with
the oracle's top-two logit margin at the first differing token.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from spec_cli import profiles  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402
from spec_cli.events import Stats, Token  # noqa: E402

DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def ours(engine, ids, settings):
    stats, tokens = Stats(), []
    start = time.perf_counter()
    for event in engine.events(ids, settings):
        stats.add(event)
        if isinstance(event, Token) and event.output:
            tokens.append(event.token)
    return tokens, time.perf_counter() - start, stats.oracle_forwards


def hugging_face(engine, ids, settings, assisted):
    oracle = engine.oracle.model
    kwargs = dict(max_new_tokens=settings.max_new_tokens, pad_token_id=engine.tokenizer.eos_token_id)
    if settings.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_k=settings.top_k or None)
    if assisted:
        kwargs.update(assistant_model=engine.draft.model)
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    start = time.perf_counter()
    out = oracle.generate(torch.tensor([ids], device=engine.device), **kwargs)
    seconds = time.perf_counter() - start
    return out[0, len(ids):].tolist(), seconds, None


def margin(engine, ids, common, a, b):
    """The oracle's logits at the first differing token: top-two margin and the gap between the two picks."""
    with torch.no_grad():
        logits = engine.oracle.model(torch.tensor([ids + common], device=engine.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]), float(logits[a] - logits[b])


def run(args):
    with gzip.open(args.data, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f][args.skip : args.skip + args.prompts]
    profile = profiles.load(args.profile)
    results = {}
    for dtype in args.dtype:
        engine = Engine(profile, device=args.device, dtype=dtype, draft2="none")
        staged2 = Engine(profile, device=args.device, dtype=dtype, draft2=args.draft2) if args.draft2 else None
        for mode in args.modes:
            sampling = dict(temperature=1.0, top_k=50, seed=0) if mode == "topk" else dict(temperature=0.0)
            base = profile.decoding.replace(max_new_tokens=args.max_new_tokens, **sampling)
            methods = {
                "baseline": lambda ids: ours(engine, ids, base.replace(method="baseline")),
                "speculative": lambda ids: ours(engine, ids, base.replace(method="speculative",
                                                                          draft_tokens=args.draft_tokens)),
                "staged": lambda ids: ours(engine, ids, base.replace(method="staged")),
                "staged+draft2": lambda ids: ours(staged2, ids, base.replace(method="staged")),
                "hf_greedy": lambda ids: hugging_face(engine, ids, base, assisted=False),
                "hf_assisted": lambda ids: hugging_face(engine, ids, base, assisted=True),
            }
            names = [m for m in methods if m in args.methods and (m != "staged+draft2" or staged2)]
            warm = engine.encode(prompts[0])
            for name in names:
                methods[name](warm)
            rows = []
            for i, prompt in enumerate(prompts):
                ids = engine.encode(prompt)
                row = {}
                for name in names[i % len(names):] + names[: i % len(names)]:
                    tokens, seconds, forwards = methods[name](ids)
                    row[name] = dict(tokens=tokens, seconds=seconds, forwards=forwards)
                rows.append((ids, row))
            results[(dtype, mode)] = report(engine, dtype, mode, names, rows)
    return results


def report(engine, dtype, mode, names, rows):
    print(f"\n== {engine.profile.name} · {dtype} · {mode} · {len(rows)} prompts · {engine.device.type} ==")
    summary = {}
    for name in names:
        n = sum(len(r[name]["tokens"]) for _, r in rows)
        s = sum(r[name]["seconds"] for _, r in rows)
        ratios = [
            (len(r[name]["tokens"]) / r[name]["seconds"]) / (len(r["baseline"]["tokens"]) / r["baseline"]["seconds"])
            for _, r in rows
        ]
        forwards = [r[name]["forwards"] for _, r in rows]
        traffic = None
        if None not in forwards:
            base_fpt = sum(r["baseline"]["forwards"] for _, r in rows) / sum(len(r["baseline"]["tokens"]) for _, r in rows)
            traffic = (sum(forwards) / n) / base_fpt
        summary[name] = dict(tokens=n, seconds=s, tok_s=n / s, median_ratio=statistics.median(ratios),
                             traffic=traffic)
        t = f"{traffic:.2f}" if traffic is not None else "  - "
        print(f"{name:14s} {n / s:8.1f} tok/s   x{n / s / (summary['baseline']['tok_s']):.2f} overall   "
              f"x{statistics.median(ratios):.2f} median   oracle traffic {t}")
    if mode == "greedy":
        pairs = [(m, "baseline") for m in ("speculative", "staged", "staged+draft2", "hf_greedy")]
        for other, reference in pairs + [("hf_assisted", "hf_greedy")]:
            if other not in names or reference not in names:
                continue
            same = 0
            for i, (ids, r) in enumerate(rows):
                a, b = r[reference]["tokens"], r[other]["tokens"]
                if a == b:
                    same += 1
                    continue
                j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                if j == min(len(a), len(b)):
                    print(f"  {other} prompt {i}: same tokens, lengths {len(a)} vs {len(b)}")
                    continue
                top2, gap = margin(engine, ids, a[:j], a[j], b[j])
                print(f"  {other} vs {reference}, prompt {i}, token {j}: {a[j]} vs {b[j]}; "
                      f"oracle top-two margin {top2:.4f}, logit gap between the two {gap:.4f}")
            print(f"  {other}: {same}/{len(rows)} identical to {reference}")
            summary[other]["identical"] = same
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(HERE / "pyfam.toml"))
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--modes", nargs="+", default=["greedy", "topk"])
    parser.add_argument("--methods", nargs="+",
                        default=["baseline", "speculative", "staged", "staged+draft2", "hf_greedy", "hf_assisted"])
    parser.add_argument("--draft2", help="an n-gram file for the staged+draft2 column")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="write the summary as JSON here")
    args = parser.parse_args()
    results = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps({f"{d}/{m}": v for (d, m), v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
