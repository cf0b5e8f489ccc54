"""Row invariance, bitwise: a row's logits from a forward that verifies a chain of k tokens are the bits the
one-token steps give at the same positions, in bfloat16 on the CPU (what `dtype = auto` picks on a CPU with
AVX-512 BF16 or AMX). What breaks it without care, measured: the CPU attention kernel's single-row path and
its short tail chunk (an attended length not a multiple of the vector width) round differently."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE, PYFAM, load_pair
from spec_cli.exec import Runner

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's kernels")


def chain_equals_steps(model, prompt: list[int], chain: list[int], **runner) -> list[int]:
    """The positions of `chain` whose logits differ between one k-token forward and k one-token steps."""
    steps = Runner(model, capacity=512, **runner)
    steps.forward(prompt, commit=len(prompt))
    ones = [steps.forward([t], commit=1).logits[-1] for t in chain]
    verify = Runner(model, capacity=512, **runner)
    verify.forward(prompt, commit=len(prompt))
    rows = verify.forward(chain).logits
    return [i for i in range(len(chain)) if not torch.equal(rows[i], ones[i])]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # llama: grouped queries, folded into rows
@pytest.mark.parametrize("pack", [None, True])
def test_a_verified_chain_has_the_bits_of_one_token_steps_in_bfloat16(tiny_dir, arch, pack):
    oracle, _ = load_pair(tiny_dir, arch, dtype=torch.bfloat16)
    rng = random.Random(7)
    for length in (5, 37, 63, 64, 65, 150):
        prompt = [rng.randrange(300) for _ in range(length)]
        for k in (2, 3, 5, 9, 12, 20):
            chain = [rng.randrange(300) for _ in range(k)]
            assert chain_equals_steps(oracle, prompt, chain, pack=pack) == [], (length, k)


@pytest.mark.skipif(not PYFAM.is_dir(), reason="needs ../shared")
def test_pyfams_oracle_verifies_chains_with_the_bits_of_one_token_steps_in_bfloat16():
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for length in (150, 201):
        prompt = torch.randint(0, 1000, (length,), generator=gen).tolist()
        for k in (3, 8, 12, 17):
            chain = torch.randint(0, 1000, (k,), generator=gen).tolist()
            assert chain_equals_steps(oracle, prompt, chain) == [], (length, k)


@pytest.mark.parametrize("dtype, branches", [(torch.bfloat16, False), (torch.float32, True)])
def test_staged_verifies_chains_where_tree_rows_are_not_bitwise(tiny_dir, dtype, branches):
    """On a CPU in bfloat16 a tree row's ancestors between its cousins change its bits, so staged gives every
    node one child there (its trees are chains); in float32 its trees branch as configured."""
    from spec_cli.decoding import Models
    from spec_cli.methods import decode
    from spec_cli.ngram import PromptLookup
    from spec_cli.profiles import Decoding

    oracle, draft = load_pair(tiny_dir, "gpt2", dtype=dtype)
    models = Models(Runner(oracle, capacity=256), Runner(draft, capacity=256), PromptLookup())
    assert models.oracle.exact_trees == branches
    runner, branched = models.oracle, []
    real = runner.forward

    def forward(*args, **kwargs):  # after each forward: is the scratch (the tree so far) still one chain?
        result = real(*args, **kwargs)
        chain = [runner.committed + j - 1 if j else -1 for j in range(len(runner.parents))]
        branched.append(runner.parents != chain)
        return result

    runner.forward = forward
    settings = Decoding(method="staged", max_new_tokens=40, tree_budget=16, tree_branching=4, tree_adaptive=False)
    list(decode(models, [5, 17, 33, 2, 91, 5, 17, 33], settings))
    assert branched and any(branched) == branches


@pytest.mark.skipif(not PYFAM.is_dir(), reason="needs ../shared")
def test_a_prompt_and_a_chain_in_one_forward_have_the_bits_of_a_prompt_then_one_token_steps():
    """Speculation's first forward reads the prompt and verifies a chain at once: its rows (past 32, past 64,
    past 192 and their padding) must give the bits of the prompt's own forward and one-token steps after it."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for length, k in ((40, 8), (60, 4), (86, 4), (200, 5), (300, 9)):
        prompt = torch.randint(0, 1000, (length,), generator=gen).tolist()
        chain = torch.randint(0, 1000, (k,), generator=gen).tolist()
        steps = Runner(oracle, capacity=512)
        expected = [steps.forward(prompt, commit=length, last=1).logits[-1]]
        expected += [steps.forward([t], commit=1).logits[-1] for t in chain]
        mixed = Runner(oracle, capacity=512).forward(prompt + chain, commit=length, last=k + 1).logits
        assert [i for i in range(k + 1) if not torch.equal(mixed[i], expected[i])] == [], (length, k)
