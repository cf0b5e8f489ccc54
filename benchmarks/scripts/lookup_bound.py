"""The most the prompt lookup can bring an oracle alone: its tokens a step were every guess verified, from the
oracle's own greedy text (no speculation run, no timing).

    eval "$(../shared/tools/fetch-models --env)"
    python benchmarks/scripts/lookup_bound.py --oracle $QWEN_1_5B --prompts benchmarks/prompts/code-8.jsonl \
        benchmarks/prompts/edit-8.jsonl [-n 128] [--shapes 4x1x4,8x1x8,8x4x16,16x4x64] [--trigram]

For each prompt, the oracle's greedy text (`-m baseline`); then, position by position as a step would meet it,
the lookup's trie (`draft2.lookup.Index.guess`: DEPTH tokens deep, BRANCHES children a node, NODES in all) walked
down the true text: a step brings the guesses the text follows plus the oracle's own token. The oracle accepts a
guess exactly when it is the greedy text's next token, so no verifying forward can accept more: tokens a step is
what verifying every guess at every step brings, the most such steps can (a controller that skips some takes
plain steps of one token there). A step costs at least a plain step's forward, so the speedup of the oracle with
its lookup is about this at most, on any device, and on a CPU less (a forward of k rows costs more than one).
Also printed: how often the lookup's first guess is the next token, and its runs. With `--trigram`, each step's
guesses are those a staged step of the model alone offers (`decoding.staged._guesses`: the lookup's trie and the
trigram's chain of its tokenizer, fitted by a first run or `spec fit-draft2 --oracle`), before the controller
picks those worth verifying: what a step could accept with every guess it makes verified.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spec_cli.completion import complete  # noqa: E402
from spec_cli.core.settings import Decoding, ModelRef, Profile  # noqa: E402
from spec_cli.decoding import adapt  # noqa: E402
from spec_cli.decoding.staged import _guesses  # noqa: E402
from spec_cli.draft2 import trigrams  # noqa: E402
from spec_cli.draft2.lookup import ROOT as TOP  # noqa: E402
from spec_cli.draft2.lookup import Index  # noqa: E402
from spec_cli.draft2.ngram import KatzTrigram  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402
from spec_cli.models import profiles  # noqa: E402


def walk(text: list[int], out: list[int], depth: int, branches: int, nodes: int,
         trigram: KatzTrigram | None = None) -> tuple[int, int, int]:
    """(steps, tokens, guesses verified) of lookup steps over `out` after the prompt `text` (with `trigram`: a
    staged step's guesses, the lookup's trie and the trigram's chain)."""
    text, index, i, steps, rows = list(text), Index(), 0, 0, 0
    calibration = adapt.Calibration()
    while i < len(out):
        index.extend(text)
        if trigram is None:
            guesses = index.guess(text, depth, branches, nodes)
        else:
            guesses = _guesses(index, text, "greedy", depth, branches, calibration, trigram).tree.nodes
        node, accepted = TOP, 0
        while i + accepted < len(out):
            follow = [k for k, g in enumerate(guesses) if g.parent == node and g.token == out[i + accepted]]
            if not follow:
                break
            node, accepted = follow[0], accepted + 1
        taken = min(accepted + 1, len(out) - i)  # the guesses it followed and the oracle's own token
        text += out[i:i + taken]
        i, steps, rows = i + taken, steps + 1, rows + len(guesses)
    return steps, len(out), rows


def first_guesses(text: list[int], out: list[int]) -> tuple[int, list[int]]:
    """(how many of `out`'s tokens the lookup's first guess named, the lengths of their runs)."""
    text, index, hits, runs, run = list(text), Index(), 0, [], 0
    for token in out:
        index.extend(text)
        guess = index.guess(text, 1, 1, 1)
        if guess and guess[0].token == token:
            hits, run = hits + 1, run + 1
        elif run:
            runs, run = runs + [run], 0
        text.append(token)
    return hits, runs + ([run] if run else [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", default=None)
    parser.add_argument("--oracle", default=None)
    parser.add_argument("--prompts", nargs="+", default=[str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl")])
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--shapes", default="4x1x4,8x1x8,8x4x16,16x4x64", help="DEPTHxBRANCHESxNODES, comma-separated")
    parser.add_argument("--trigram", action="store_true", help="a staged step's guesses: the lookup's and the trigram's")
    args = parser.parse_args()
    if args.oracle:
        profile = Profile(name=Path(args.oracle).stem, source="--oracle", oracle=ModelRef(args.oracle), draft=None)
    else:
        profile = profiles.load(args.profile or str(ROOT / "benchmarks" / "pyfam.toml"))
    engine = Engine(profile)
    trigram = None
    if args.trigram:
        fitted = trigrams.ready(profile, engine.tokenizer)
        if fitted is None:
            sys.exit("no trigram is fitted for this model: `spec fit-draft2 --oracle MODEL` fits one")
        trigram = KatzTrigram.load(fitted)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    guessed = "lookup and trigram" if trigram is not None else "lookup"
    print(f"{profile.name} · greedy, {args.n} tokens · tokens a step were every {guessed} guess verified (an upper "
          f"bound)")
    for path in args.prompts:
        texts = []
        for line in Path(path).read_text().splitlines():
            ids = engine.encode(json.loads(line)["prompt"])
            texts.append((ids, complete(engine, ids, Decoding(method="baseline", max_new_tokens=args.n)).tokens))
        total = sum(len(out) for _, out in texts)
        hits, runs = 0, []
        for ids, out in texts:
            h, r = first_guesses(ids, out)
            hits, runs = hits + h, runs + r
        print(f"{Path(path).name}: {len(texts)} prompts, {total} tokens · the first guess is the next token "
              f"{hits / total:.0%} of the time, in {len(runs)} runs of {hits / max(1, len(runs)):.1f} on average")
        for depth, branches, nodes in shapes:
            steps = tokens = rows = 0
            for ids, out in texts:
                s, t, r = walk(ids, out, depth, branches, nodes, trigram)
                steps, tokens, rows = steps + s, tokens + t, rows + r
            print(f"  depth {depth}, {branches} a node, {nodes} nodes: at most {tokens / steps:.2f} tokens a step "
                  f"({rows / steps:.1f} guesses verified a step)")


if __name__ == "__main__":
    main()
