"""One model alone, three ways side by side in one process: baseline, staged with prompt lookup, and staged with
prompt lookup and a trigram (`spec fit-draft2`), rounds alternating in order, greedy (or coupled sampling:
`--temperature`, `--top-p`, `--top-k`, seed 0, so every way samples baseline's text).

    python benchmarks/scripts/lone_trigram.py --oracle $QWEN_1_5B --trigram TRIGRAM.npz \\
        --prompts benchmarks/prompts/code-8.jsonl --rounds 2

Prints each round's tok/s (the prompt's read included), tokens an oracle forward, outputs identical to
baseline's and the tokens by who proposed them; then each way's mean speed relative to baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spec_cli.completion import complete  # noqa: E402
from spec_cli.core.hardware import cpu_name  # noqa: E402
from spec_cli.core.settings import Decoding, ModelRef, Profile  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--oracle", required=True)
    parser.add_argument("--trigram", required=True, help="an n-gram .npz (spec fit-draft2)")
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else coupled sampling")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()
    engine = Engine(Profile("lone", "--oracle", ModelRef(args.oracle), None))
    texts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    ids = [engine.encode(t) for t in texts]
    settings = Decoding(max_new_tokens=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        seed=0)
    plans = {"baseline": engine.plan(settings.replace(method="baseline")),
             "lookup": engine.plan(settings.replace(method="staged"), draft2="prompt-lookup"),
             "lookup+trigram": engine.plan(settings.replace(method="staged"), draft2="prompt-lookup+" + args.trigram)}
    for plan in plans.values():  # warm
        complete(engine, ids[0][:20], plan)
    print(f"{cpu_name()}; {Path(args.oracle).name}; {Path(args.prompts).name}; {args.n} tokens; T {args.temperature}, "
          f"top-p {args.top_p}, top-k {args.top_k}", flush=True)
    expected, rates = {}, {}
    for round_ in range(args.rounds):
        for name in (list(plans) if round_ % 2 == 0 else list(plans)[::-1]):
            tokens = forwards = same = 0
            stages: dict[str, int] = {}
            started = time.perf_counter()
            for i, prompt in enumerate(ids):
                result = complete(engine, prompt, plans[name])
                tokens += result.stats.new_tokens
                forwards += result.stats.oracle_forwards
                for stage, n in result.stats.by_stage.items():
                    stages[stage] = stages.get(stage, 0) + n
                if name == "baseline":
                    expected[i] = result.tokens
                same += result.tokens == expected.get(i)
            rate = tokens / (time.perf_counter() - started)
            rates.setdefault(name, []).append(rate)
            print(f"round {round_} {name}: {rate:.1f} tok/s, {tokens / forwards:.2f} tokens a forward, "
                  f"{same}/{len(ids)} identical to baseline, {stages}", flush=True)
    base = sum(rates["baseline"]) / len(rates["baseline"])
    print("mean: " + ", ".join(f"{name} {sum(r) / len(r) / base:.2f}x" for name, r in rates.items()))


if __name__ == "__main__":
    main()
