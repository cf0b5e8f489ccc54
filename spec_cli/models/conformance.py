"""Can spec drive this model exactly? The conformance checks the tests run on every supported family, on any model.

`spec check MODEL` loads it in float32 and compares spec's runner with the model's own Hugging Face forward:
greedy decoding against `generate`, and every node of a tree scored in one forward against its path run
alone, on spec's runner (what exact speculation needs: at the model's dtype's tolerance) and on the model's own
forward (at the tolerance of what its products compute in: a quantized model's in bfloat16, where one rounding
flipped by another order of float32 operations grows through the layers). A family spec has no test for runs
these on first load (spec_cli/firstload.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from spec_cli.core.errors import described
from spec_cli.exec import Runner
from spec_cli.exec.backends import cache_keyword, cache_of
from spec_cli.exec.ops import argmax


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str


TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative to the largest logit


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCES.get(dtype, 3e-2)


def compute_dtype(model) -> torch.dtype:
    """What a model's products compute in: its dtype, or the kernels' bfloat16 where its projections are
    quantized (whatever its dtype)."""
    from spec_cli.exec import quant

    dtype = next(model.parameters()).dtype
    if any(isinstance(m, quant.Quantized) for m in model.modules()):
        return max((dtype, quant.ACTIVATIONS), key=tolerance)
    return dtype


def conformance(model, tokenizer, tokens: int = 24, seed: int = 0, levels: int = 3) -> Iterator[Result]:
    """Each check as it finishes: spec against itself within the tolerance of the model's dtype (float32: 1e-4
    of the largest logit), against the model's own forward within that of what its products compute in
    (`compute_dtype`); a check that cannot even run fails with what went wrong."""
    exact, limit = tolerance(next(model.parameters()).dtype), tolerance(compute_dtype(model))
    for check, size in ((_greedy, tokens), (_tree, levels)):
        try:
            yield check(model, tokenizer, size, random.Random(seed), (exact, limit))
        except Exception as e:  # noqa: BLE001 - an unknown architecture may break anywhere: report, don't crash
            yield Result(check.__doc__, False, described(e))


def _prompt(tokenizer) -> list[int]:
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
    return tokenizer(text)["input_ids"] or [tokenizer.bos_token_id or 0]


def _greedy(model, tokenizer, tokens, rng, limits) -> Result:
    """greedy decoding equals generate()"""
    limit = limits[1]
    prompt = _prompt(tokenizer)
    expected = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=tokens,
                              do_sample=False)[0, len(prompt):].tolist()
    runner = Runner(model)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    got = []
    logits = runner.forward(prompt, commit=len(prompt), last=1).logits[-1]
    while len(got) < len(expected):
        got.append(int(argmax(logits)))
        if got[-1] in eos:
            break
        logits = runner.forward(got[-1:], commit=1, last=1).logits[-1]
    if got == expected:
        return Result(_greedy.__doc__, True, f"{len(got)} tokens identical")
    same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if same < min(len(got), len(expected)):  # a near-tie that rounding may flip is no difference in the model
        with torch.no_grad():
            ref = model(torch.tensor([prompt + expected[:same]], device=model.device)).logits[0, -1].float()
        gap = abs(float(ref[expected[same]] - ref[got[same]])) / (float(ref.abs().max()) or 1.0)
        if gap <= limit:
            return Result(_greedy.__doc__, True, f"{same} tokens identical, then a near-tie (logits {gap:.1e} "
                                                 f"apart, within {limit:.0e})")
    return Result(_greedy.__doc__, False, f"first difference at token {same} of {len(expected)} "
                                          f"(spec {got[same:same + 3]}, generate() {expected[same:same + 3]})")


def _tree(model, tokenizer, levels, rng, limits) -> Result:
    """a tree scored in one forward equals each path alone"""
    exact, limit = limits
    prompt, vocab = _prompt(tokenizer), model.config.vocab_size
    runner, paths = Runner(model), Runner(model)
    runner.forward(prompt, commit=len(prompt))
    paths.forward(prompt, commit=len(prompt))
    parents, nodes, worst, itself, floor = [], [], 0.0, 0.0, 0.0
    cached, nudge = _cached(model, prompt), torch.finfo(compute_dtype(model)).eps / 2
    for _ in range(levels):
        start = runner.length
        level = rng.randint(2, 5)
        level_parents = [rng.choice([-1] + list(range(runner.committed, start))) for _ in range(level)]
        level_tokens = [rng.randrange(vocab) for _ in range(level)]
        logits = runner.forward(level_tokens, parents=level_parents).logits
        for i, (p, t) in enumerate(zip(level_parents, level_tokens)):
            parents.append(p)
            nodes.append(t)
            path, slot = [t], p
            while slot >= 0:
                path.insert(0, nodes[slot - runner.committed])
                slot = parents[slot - runner.committed]
            with torch.no_grad():
                alone = model(torch.tensor([prompt + path], device=model.device)).logits[0, -1].float()
                own = [_stepped(model, cached, path), _nudged(model, prompt + path, nudge, len(nodes))]
            scale = float(alone.abs().max()) or 1.0
            worst = max(worst, float((logits[i, : alone.shape[-1]] - alone).abs().max()) / scale)
            for other in own:
                if other is not None:
                    floor = max(floor, float((other - alone).abs().max()) / scale)
            chain = paths.forward(path, last=1).logits[-1]  # (the path alone on spec's runner, then dropped)
            paths.keep([])
            itself = max(itself, float((logits[i] - chain).abs().max()) / scale)
    # the model's own forward disagrees with itself by `floor`: a path run whole against step by step on its cache
    # (another order of float32 operations), and against its inputs nudged by one rounding of what its products
    # compute in (a thousandth of them). Either flips an activation's rounding (a quantized model's products take
    # bfloat16 activations quantized to 8 bits, 32 or 256 at a time), which grows through the layers: SmolLM2-135M's
    # Q4_1 file moves 2-4e-2 of its largest logit for one rounding in a thousandth of its inputs. spec's runner,
    # another order of the same operations, is held to twice that where it is more than the fixed tolerance
    against = max(limit, 2 * floor)
    said = (f"tolerance {against:.1e}: twice the model's own {floor:.1e}" if against > limit
            else f"tolerance {limit:.0e}")
    if not runner.exact_trees:  # (where trees do not get the bits of their paths, staged verifies chains)
        return Result(_tree.__doc__, itself < against and worst < against,
                      f"{len(nodes)} nodes, largest relative logit difference {itself:.1e} against each path alone on "
                      f"spec's runner, {worst:.1e} against the model's own forward ({said}; trees are verified as "
                      f"chains here)")
    return Result(_tree.__doc__, itself < exact and worst < against,
                  f"{len(nodes)} nodes, largest relative logit difference {itself:.1e} against each path alone on "
                  f"spec's runner (tolerance {exact:.0e}), {worst:.1e} against the model's own forward ({said})")


def _cached(model, prompt: list[int]):
    """The model's own cache after the prompt (None where it keeps none: no floor is measured then)."""
    try:
        with torch.no_grad():
            return cache_of(model(torch.tensor([prompt], device=model.device), use_cache=True))
    except Exception:  # noqa: BLE001 - an unknown architecture may break anywhere
        return None


def _nudged(model, tokens: list[int], nudge: float, seed: int):
    """The model's own last logits of `tokens` with a thousandth of its input embeddings scaled by 1 + `nudge` (one
    rounding of what its products compute in); None where it takes no embeddings for inputs."""
    try:
        embedded = model.get_input_embeddings()(torch.tensor([tokens], device=model.device))
        chosen = torch.rand(embedded.shape, generator=torch.Generator().manual_seed(seed)) < 1e-3
        nudged = embedded * (1 + nudge * chosen.to(embedded.device, embedded.dtype))
        return model(inputs_embeds=nudged).logits[0, -1].float()
    except Exception:  # noqa: BLE001 - an unknown architecture may break anywhere: no floor measured this way
        return None


def _stepped(model, cached, path: list[int]):
    """The model's own last logits of `path` after the prompt's cache, a token at a time (None where its cache
    cannot be copied or extended: the check then holds spec to the fixed tolerance alone)."""
    import copy

    if cached is None:
        return None
    try:
        past, keyword = copy.deepcopy(cached), cache_keyword(model)
        for token in path:
            out = model(torch.tensor([[token]], device=model.device), use_cache=True, **{keyword: past})
            past = cache_of(out)
        return out.logits[0, -1].float()
    except Exception:  # noqa: BLE001 - a model without a usable cache: no floor measured
        return None
