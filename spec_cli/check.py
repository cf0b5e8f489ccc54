"""Can spec drive this model exactly? The conformance checks the tests run on every supported family, on any model.

`spec check MODEL` loads it in float32 and compares spec's runner with the model's own Hugging Face forward:
greedy decoding against `generate`, and every node of a tree scored in one forward against its path run
alone. Untested families pass or fail here before anyone trusts them (then SPEC_ALLOW_UNTESTED=1 runs them).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from spec_cli.exec import Runner


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str


def conformance(model, tokenizer, tokens: int = 24, seed: int = 0) -> Iterator[Result]:
    """Each check as it finishes; a check that cannot even run fails with what went wrong."""
    for check in (_greedy, _tree):
        try:
            yield check(model, tokenizer, tokens, random.Random(seed))
        except Exception as e:  # noqa: BLE001 - an unknown architecture may break anywhere: report, don't crash
            first = str(e).splitlines()[0] if str(e) else ""
            yield Result(check.__doc__, False, f"{type(e).__name__}: {first}")


def _prompt(tokenizer) -> list[int]:
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
    return tokenizer(text)["input_ids"] or [tokenizer.bos_token_id or 0]


def _greedy(model, tokenizer, tokens, rng) -> Result:
    """greedy decoding equals generate()"""
    prompt = _prompt(tokenizer)
    expected = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=tokens,
                              do_sample=False)[0, len(prompt):].tolist()
    runner = Runner(model)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    got = []
    logits = runner.forward(prompt, commit=len(prompt), last=1)[-1]
    while len(got) < len(expected):
        got.append(int(logits.argmax()))
        if got[-1] in eos:
            break
        logits = runner.forward(got[-1:], commit=1, last=1)[-1]
    same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    return Result(_greedy.__doc__, got == expected,
                  f"{len(got)} tokens identical" if got == expected else f"first difference at token {same}")


def _tree(model, tokenizer, tokens, rng) -> Result:
    """a tree scored in one forward equals each path alone"""
    prompt, vocab = _prompt(tokenizer), model.config.vocab_size
    runner = Runner(model)
    runner.forward(prompt, commit=len(prompt))
    parents, nodes, worst = [], [], 0.0
    for _ in range(3):
        start = runner.length
        level = rng.randint(2, 5)
        level_parents = [rng.choice([-1] + list(range(runner.committed, start))) for _ in range(level)]
        level_tokens = [rng.randrange(vocab) for _ in range(level)]
        logits = runner.forward(level_tokens, parents=level_parents)
        for i, (p, t) in enumerate(zip(level_parents, level_tokens)):
            parents.append(p)
            nodes.append(t)
            path, slot = [t], p
            while slot >= 0:
                path.insert(0, nodes[slot - runner.committed])
                slot = parents[slot - runner.committed]
            with torch.no_grad():
                alone = model(torch.tensor([prompt + path], device=model.device)).logits[0, -1].float()
            scale = float(alone.abs().max()) or 1.0
            worst = max(worst, float((logits[i, : alone.shape[-1]] - alone).abs().max()) / scale)
    return Result(_tree.__doc__, worst < 1e-4, f"{len(nodes)} nodes, largest relative logit difference {worst:.1e}")
