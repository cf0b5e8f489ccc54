"""Row invariance, bitwise: a row's logits from a forward that verifies a chain of k tokens are the bits the
one-token steps give at the same positions, in bfloat16 on the CPU (what `dtype = auto` picks on a CPU with
AVX-512 BF16 or AMX), with either attention a lean loop runs there: spec's own (native/glue.cpp, where the CPU
has AVX-512) and torch's CPU kernel (elsewhere). What breaks torch's without care, measured: its single-row
path and its short tail chunk (an attended length not a multiple of the vector width) round differently."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import archs
import pytest
import torch
from conftest import DEVICE, PYFAM, load_pair

from spec_cli.core.hardware import cpu_flags
from spec_cli.exec import Runner, backends, native, packing
from spec_cli.exec.shapes import ALIGN, Shapes

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's kernels")


@pytest.fixture(params=["native", "torch"])
def attention(request, monkeypatch):
    """Which attention the lean loops run: spec's own, or torch's CPU kernel (as on a CPU without AVX-512)."""
    if request.param == "native":
        if native.int4() is None:
            pytest.skip(f"spec's kernels: {native.status()}")
    else:
        monkeypatch.setattr(backends, "native_glue", lambda device, dtype: None)
    return request.param


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
def test_a_verified_chain_has_the_bits_of_one_token_steps_in_bfloat16(tiny_dir, arch, pack, attention):
    oracle, _ = load_pair(tiny_dir, arch, dtype=torch.bfloat16)
    rng = random.Random(7)
    for length in (5, 37, 63, 64, 65, 150):
        prompt = [rng.randrange(300) for _ in range(length)]
        for k in (2, 3, 5, 9, 12, 20):
            chain = [rng.randrange(300) for _ in range(k)]
            assert chain_equals_steps(oracle, prompt, chain, pack=pack) == [], (length, k)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("pack", [None, True])
def test_a_verified_tree_has_the_bits_of_one_token_steps_with_spec_attention(tiny_dir, arch, pack):
    """A tree whose rows have cousins between them and their parents: each row the bits of the one-token steps
    along its path, where spec's attention runs (so staged's trees branch in bfloat16: `exact_trees`)."""
    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    oracle, _ = load_pair(tiny_dir, arch, dtype=torch.bfloat16)
    rng = random.Random(11)
    for length in (6, 70, 150):
        prompt = [rng.randrange(300) for _ in range(length)]
        tree = Runner(oracle, capacity=512, pack=pack)
        assert tree.exact_trees and tree.lean.glue is not None
        tree.forward(prompt, commit=length)
        tokens = [rng.randrange(300) for _ in range(9)]  # three branches, three deep, side by side
        parents = [-1, -1, -1] + [length + i for i in range(6)]
        rows = tree.forward(tokens, parents=parents).logits
        for path in ((0, 3, 6), (1, 4, 7), (2, 5, 8)):
            steps = Runner(oracle, capacity=512, pack=pack)
            steps.forward(prompt, commit=length)
            for i in path:
                assert torch.equal(rows[i], steps.forward([tokens[i]], commit=1).logits[-1]), (length, path, i)


# every family that runs its own forward (not a lean loop); in bfloat16, 512 wide, before spec attended and packed
# there, a verified chain's rows took other bits than one-token steps in OPT, Phi and GPT-NeoX (torch's attention
# rounding one row otherwise than several) and DeepSeek-V3 (its experts), and past 32 rows in all (torch's products)
OWN_FORWARDS = [(n, None) for n in archs.ARCHITECTURES if n.split("-")[0] not in backends.LEAN and "-" not in n] + [
    ("deepseek_v3", "int4")]


@pytest.fixture(scope="module")
def wide_dir(tiny_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("wide")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    width, archs.WIDTH = archs.WIDTH, 512
    try:
        for name in sorted({n for n, _ in OWN_FORWARDS}):
            archs.make(root / name, name, len(tokenizer), tokenizer=tokenizer)
    finally:
        archs.WIDTH = width
    return root


@pytest.mark.parametrize("name, quantize", OWN_FORWARDS)
def test_a_model_on_its_own_forward_verifies_chains_and_trees_with_the_bits_of_one_token_steps(wide_dir, name,
                                                                                                 quantize):
    """Loaded as spec loads it, in bfloat16: its float projections packed, its experts split, spec's attention
    in its own forward (`backends.model_attention`; Gemma 2's softcapped), so its trees are exact as a lean
    loop's."""
    from spec_cli.core.settings import ModelRef
    from spec_cli.models.loading import load

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    model = load(ModelRef(str(wide_dir / name), quantize=quantize), torch.device("cpu"), torch.bfloat16,
                 untested=True, say=lambda line: None).model
    runner = Runner(model, capacity=512)
    assert runner.lean is None and runner.exact_trees
    rng = random.Random(5)
    for _ in range(12):
        prompt = [rng.randrange(1, 300) for _ in range(rng.choice((5, 37, 70)))]
        chain = [rng.randrange(1, 300) for _ in range(rng.choice((2, 3, 5, 9, 40)))]  # (past 32 rows torch's
        assert chain_equals_steps(model, prompt, chain) == [], (len(prompt), len(chain))  # products round otherwise)
    for length in (6, 70):
        prompt = [rng.randrange(1, 300) for _ in range(length)]
        runner.reset()
        runner.forward(prompt, commit=length)
        tokens = [rng.randrange(1, 300) for _ in range(9)]  # three branches, three deep, side by side
        rows = runner.forward(tokens, parents=[-1, -1, -1] + [length + i for i in range(6)]).logits
        for path in ((0, 3, 6), (1, 4, 7), (2, 5, 8)):
            steps = Runner(model, capacity=512)
            steps.forward(prompt, commit=length)
            for i in path:
                assert torch.equal(rows[i], steps.forward([tokens[i]], commit=1).logits[-1]), (length, path, i)


@pytest.mark.parametrize("name", [n for n, quantize in OWN_FORWARDS if quantize is None])
def test_spec_attention_in_a_models_own_forward_computes_its_attention(wide_dir, name, monkeypatch):
    """In float32 (spec's attention there as for a quantized model): its own forward's logits to float32's
    rounding, DeepSeek's narrower values included (bfloat16 is too chaotic in tiny random mixtures to tell)."""
    from transformers import AutoModelForCausalLM

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    monkeypatch.setattr(backends, "own_attention", lambda device, dtype, quantized: native.int4())
    model = AutoModelForCausalLM.from_pretrained(wide_dir / name, dtype=torch.float32).eval()
    runner = Runner(model, capacity=256)
    assert runner.lean is None and runner._attends
    ids = [random.Random(5).randrange(1, 300) for _ in range(30)]
    with torch.no_grad():
        own = model(torch.tensor([ids])).logits[0]
    got = runner.forward(ids, commit=len(ids)).logits
    assert (got - own).norm() < 1e-5 * own.norm(), (got - own).norm() / own.norm()


def test_spec_attention_as_a_models_attention_function_softcaps_as_gemma_2s():
    """`attend_alone` as transformers calls it from Gemma 2's attention (softcap, grouped queries, a mask): its
    eager function's output to float32's rounding (the tiny model's values barely differ by position, so its
    logits would not show a dropped cap)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 5, 64, generator=generator) * 4  # (scores of tens: the cap of 2 bites)
    keys, values = (torch.randn(1, 2, 40, 64, generator=generator) for _ in range(2))
    mask = torch.where(torch.rand(5, 40, generator=generator) > 0.3, 0.0, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.training = 4, 64, False
    for cap in (None, 2.0):
        got, _ = backends.attend_alone(module, q, keys, values, mask, scaling=0.125, softcap=cap)
        expected, _ = eager_attention_forward(module, q, keys, values, mask, scaling=0.125, softcap=cap)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, backends.attend_alone(module, q, keys, values, mask, scaling=0.125)[0])


@pytest.mark.skipif(not PYFAM.is_dir(), reason="needs ../shared")
def test_pyfams_oracle_verifies_chains_with_the_bits_of_one_token_steps_in_bfloat16(attention):
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for length in (150, 201):
        prompt = torch.randint(0, 1000, (length,), generator=gen).tolist()
        for k in (3, 8, 12, 17):
            chain = torch.randint(0, 1000, (k,), generator=gen).tolist()
            assert chain_equals_steps(oracle, prompt, chain) == [], (length, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_staged_verifies_chains_where_tree_rows_are_not_bitwise(tiny_dir, dtype, attention):
    """On a CPU in bfloat16 torch's attention gives a tree row other bits when its ancestors lie between its
    cousins, so staged gives every node one child there (its trees are chains); spec's own attention sums a
    row's attended keys alone, and in float32 (not bitwise anyway) trees branch as configured."""
    branches = dtype == torch.float32 or attention == "native"
    from spec_cli.core.settings import Decoding
    from spec_cli.decoding.chain import Models
    from spec_cli.decoding.methods import decode
    from spec_cli.draft2.ngram import PromptLookup

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
def test_pyfams_oracle_verifies_trees_with_the_bits_of_one_token_steps_with_spec_attention():
    """As above on pyfam's oracle, whose shapes show what the tiny models' hide: with torch's attention one row
    of these 180 gets other bits (tried)."""
    from transformers import AutoModelForCausalLM

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).eval()
    rng, differing = random.Random(11), []
    for length in (6, 70, 150, 201, 260):
        prompt = [rng.randrange(1000) for _ in range(length)]
        steps = Runner(oracle, capacity=512)  # (one-token steps after the prompt, read once: each path drops the
        steps.forward(prompt, commit=length)  # one before, `reuse` keeping the prompt's entries)
        for _ in range(3):
            tree = Runner(oracle, capacity=512)
            assert tree.exact_trees
            tree.forward(prompt, commit=length)
            tokens = [rng.randrange(1000) for _ in range(12)]  # four branches, three deep, side by side
            rows = tree.forward(tokens, parents=[-1] * 4 + [length + i for i in range(8)]).logits
            for path in ((0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)):
                assert steps.reuse(prompt + [tokens[path[0]]]) == length
                differing += [(length, i) for i in path
                              if not torch.equal(rows[i], steps.forward([tokens[i]], commit=1).logits[-1])]
    assert differing == []


@pytest.mark.skipif(not PYFAM.is_dir(), reason="needs ../shared")
def test_a_prompt_and_a_chain_in_one_forward_have_the_bits_of_a_prompt_then_one_token_steps(attention):
    """Speculation's first forward reads the prompt and verifies a chain at once: its rows (past 32, past 64,
    past 192 and their padding; a last piece of one row: 33 and 65 rows) must give the bits of the prompt's own
    forward and one-token steps after it."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for length, k in ((40, 8), (60, 4), (86, 4), (200, 5), (300, 9), (32, 1), (63, 2)):
        prompt = torch.randint(0, 1000, (length,), generator=gen).tolist()
        chain = torch.randint(0, 1000, (k,), generator=gen).tolist()
        steps = Runner(oracle, capacity=512)
        expected = [steps.forward(prompt, commit=length, last=1).logits[-1]]
        expected += [steps.forward([t], commit=1).logits[-1] for t in chain]
        mixed = Runner(oracle, capacity=512).forward(prompt + chain, commit=length, last=k + 1).logits
        assert [i for i in range(k + 1) if not torch.equal(mixed[i], expected[i])] == [], (length, k)


@pytest.mark.skipif(not PYFAM.is_dir(), reason="needs ../shared")
def test_a_last_piece_of_one_row_has_the_bits_of_a_one_token_step(attention):
    """A forward of 32n + 1 rows runs its bfloat16 products in pieces of 32 and a last one of one row, which must
    take the bits a one-token step gives that row (where oneDNN runs a one-row kernel that sums otherwise, as on a
    Zen 4 or an Ice Lake: one row runs as two); torch's attention takes queries in blocks of 32 and rounds a last
    block of one otherwise too (`backends.Q_BLOCK`). Forwards at exact token counts, as on a CPU without AVX-512
    BF16 or AMX (an Ice Lake; with them counts pad to powers of two). A row differs on a few in a hundred: many
    prompts."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).eval()
    exact = Shapes((), 1 if attention == "native" else ALIGN)  # (torch's attention: attended lengths in ALIGNs)
    gen = torch.Generator().manual_seed(1)
    differing = []
    for length in (33, 65):
        for trial in range(16):
            prompt = torch.randint(0, 1000, (length,), generator=gen).tolist()
            whole = Runner(oracle, capacity=128, shapes=exact).forward(prompt, commit=length, last=1).logits[-1]
            parts = Runner(oracle, capacity=128, shapes=exact)
            parts.forward(prompt[:-1], commit=length - 1, last=1)
            if not torch.equal(whole, parts.forward(prompt[-1:], commit=1).logits[-1]):
                differing.append((length, trial))
    assert differing == []


def test_a_packed_bfloat16_product_gives_each_row_the_bits_it_has_alone():
    """`packing.linear` (the Llama family's products, and every head): 2 to 70 rows, in pieces of 32 and a last
    piece of one row run as two, each row the bits it has alone (the shapes whose one-row kernels sum otherwise
    where oneDNN runs a Zen 4's or an Ice Lake's kernels)."""
    if not packing.onednn_bfloat16():
        pytest.skip("oneDNN runs no bfloat16 products here")
    torch.manual_seed(0)
    differing = []
    for inputs, outputs in ((384, 1536), (1536, 384), (896, 4864), (4864, 896), (384, 8192)):
        product = packing.linear([torch.nn.Linear(inputs, outputs).to(torch.bfloat16)])
        for _ in range(3):
            x = torch.randn(1, 70, inputs).to(torch.bfloat16)
            alone = torch.cat([product(x[:, i : i + 1]) for i in range(70)], 1)
            differing += [(inputs, outputs, rows) for rows in (2, 31, 32, 33, 34, 64, 65, 70)
                          if not torch.equal(product(x[:, :rows]), alone[:, :rows])]
    assert differing == []


# oneDNN's cap on the instructions its kernels use -> flags of which one a CPU needs for the cap to change them
CAPS = {"AVX512_CORE_BF16": {"amx_bf16"}, "AVX512_CORE": {"amx_bf16", "avx512_bf16"}}


@pytest.mark.parametrize("isa", list(CAPS))
def test_rows_keep_their_bits_on_the_kernels_onednn_runs_on_other_cpus(isa):
    """oneDNN picks its bfloat16 products' kernels by what the CPU has: capped at AVX-512 BF16 it runs a Zen 4's
    (or a Cooper Lake's), at AVX-512 an Ice Lake's or a Cascade Lake's, each with its own one-row kernel. The
    tests above, again under each cap below this CPU's own, in a process of their own (the cap is read once)."""
    if not CAPS[isa] & cpu_flags():
        pytest.skip(f"this CPU runs no kernel above {isa}'s")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          __file__, "-k", "pyfams or prompt_and_a_chain or last_piece or packed_bfloat16"],
                         env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
