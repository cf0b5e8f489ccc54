"""The most a draft can bring its oracle on this machine: steps that know in advance how far the draft is right.

    eval "$(../shared/tools/fetch-models --env)"
    python benchmarks/scripts/draft_bound.py --oracle $QWEN_1_5B --draft $QWEN_0_5B \
        [--prompts benchmarks/prompts/code-8.jsonl] [-n 128] [--branching 1,4] [--budget 16]

For each prompt, the oracle's greedy text (`-m baseline`), then one draft forward over prompt and text: at each
position the draft's top words given the true text before it (what it proposes there while its proposals are
accepted). A step from position i then brings the run of positions from i where the oracle's token is among
the draft's top BRANCHING words (1: its greedy chain; more: a tree that happens to hold the right child), at
most BUDGET, plus the oracle's own token. The step is priced as if it knew the run: the oracle's forward of the
run's rows and its pending token only (no wrong branch verified), and the draft's forwards either free or one a
drafted token (draft2 and the lookup may propose several in one; they cannot make it cheaper than free).
Forward costs are measured here, in this process (ms by rows, after a 200-token cache). Every real step pays
more (wrong branches, a draft run past the run's end, a step not knowing when to stop), so each speedup printed
is an upper bound for any method drafting with this draft, on this machine, for these prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pair_cost import milliseconds  # noqa: E402  (ms a forward of `rows` new tokens after the cache)

from spec_cli.completion import complete  # noqa: E402
from spec_cli.core.hardware import cpu_name  # noqa: E402
from spec_cli.core.settings import Decoding, ModelRef, Profile  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 12, 17)  # rows timed; the others interpolated


def costs(runner, prefix: int = 200) -> dict[int, float]:
    """ms a forward by rows, 1..max(ROWS), linear between those timed."""
    runner.reset()
    runner.forward(list(range(1000, 1000 + prefix)), commit=prefix)
    timed = {r: milliseconds(runner, r, repeats=8) for r in ROWS}
    runner.reset()
    out = {}
    for lo, hi in zip(ROWS, ROWS[1:]):
        for r in range(lo, hi + 1):
            out[r] = timed[lo] + (timed[hi] - timed[lo]) * (r - lo) / (hi - lo)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--oracle", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", nargs="+", default=[str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl")])
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--branching", default="1,4")
    parser.add_argument("--budget", type=int, default=16)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    profile = Profile(name="pair", source="--oracle/--draft", oracle=ModelRef(args.oracle), draft=ModelRef(args.draft))
    engine = Engine(profile, need_draft=True)
    budget = min(args.budget, max(ROWS) - 1)
    oracle = engine._runner("oracle", engine.oracle.model, 512)
    draft = engine._runner("draft", engine.draft.model, 512)
    oracle_ms, draft_ms = costs(oracle), costs(draft)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads · oracle ms by rows "
          + " ".join(f"{r}:{oracle_ms[r]:.1f}" for r in ROWS) + f" · draft one row {draft_ms[1]:.1f} ms")
    for path in args.prompts:
        texts = []
        for line in Path(path).read_text().splitlines():
            ids = engine.encode(json.loads(line)["prompt"])
            out = complete(engine, ids, Decoding(method="baseline", max_new_tokens=args.n)).tokens
            draft.reset()
            whole = ids + out
            logits = draft.forward(whole, commit=len(whole), last=len(out) + 1).logits  # rows predicting out
            draft.reset()
            texts.append((out, logits[:len(out)]))
        print(f"{Path(path).name}: {len(texts)} prompts, {sum(len(o) for o, _ in texts)} tokens, "
              f"greedy; one plain step {oracle_ms[1]:.1f} ms")
        for branching in (int(b) for b in args.branching.split(",")):
            steps = tokens = free = paid = 0.0
            for out, logits in texts:
                top = logits.topk(branching, dim=-1).indices
                right = [bool((top[j] == out[j]).any()) for j in range(len(out))]
                i = 0
                while i < len(out):
                    run = 0
                    while run < budget and i + run < len(out) - 1 and right[i + run]:
                        run += 1
                    steps, tokens = steps + 1, tokens + run + 1
                    free += oracle_ms[run + 1]
                    paid += oracle_ms[run + 1] + run * draft_ms[1]
                    i += run + 1
            plain = tokens * oracle_ms[1]
            print(f"  the oracle's token among the draft's top {branching}: {tokens / steps:.2f} tokens a step at "
                  f"most; speedup at most {plain / free:.2f}x with drafting free, {plain / paid:.2f}x at one draft "
                  f"forward a drafted token")


if __name__ == "__main__":
    main()
