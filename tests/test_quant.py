"""Quantized weights: llama.cpp's blocks read value for value, GGUF files run natively (no float copy), products
that give a row the same bits whatever shares them, and every method identical to the quantized oracle alone."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICE
from helpers import assert_clean_error, spec
from tiny import make_gguf, make_model, make_noisy_copy, q4_k

from spec_cli import cachedir
from spec_cli.core.settings import Decoding, ModelRef
from spec_cli.exec import Runner, backends, native, quant
from spec_cli.models import gguf as spec_gguf
from spec_cli.models import gguf_blocks
from spec_cli.models.loading import load

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's kernels")
CPU = torch.device("cpu")
ARCHS = Path(__file__).resolve().parent / "gguf_archs"  # (files llama.cpp's converter wrote: tests/gguf_archs/make.py)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama oracle (width 256: inputs in 32s) and a noisy copy as its draft, as Hugging Face folders and
    as GGUF files in each 4-bit kind and Q8_0."""
    from tiny import make_tokenizer

    root = tmp_path_factory.mktemp("quant")
    tokenizer = make_tokenizer(root / "tokenizer")
    make_model(root / "oracle", "llama", len(tokenizer), layers=2, width=256, seed=1, init=0.1, tokenizer=tokenizer)
    make_noisy_copy(root / "oracle", root / "draft", noise=0.1, seed=2)
    for kind in KINDS:
        make_gguf(root / "oracle", root / f"oracle-{kind}.gguf", kind)
    make_gguf(root / "draft", root / "draft-Q4_0.gguf", "Q4_0")
    make_gguf(root / "oracle", root / "tied-Q4_0.gguf", "Q4_0", head=False, embedding="Q4_0")
    make_gguf(root / "oracle", root / "tied-Q5_0.gguf", "Q4_0", head=False, embedding="Q5_0")
    # Qwen2 (q, k and v with biases) in each kind, and in the mixes of the real pair's files
    make_model(root / "qwen2", "qwen2", len(tokenizer), layers=2, width=256, seed=3, init=0.1, tokenizer=tokenizer)
    make_noisy_copy(root / "qwen2", root / "qwen2-draft", noise=0.1, seed=4)
    for kind in KINDS:
        make_gguf(root / "qwen2", root / f"qwen2-{kind}.gguf", kind, embedding="Q5_0")
    for name, (source, kind, kinds) in MIXES.items():
        make_gguf(root / source, root / f"qwen2-{name}.gguf", kind, embedding=kind, kinds=kinds)
    return root


KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
# the real files' mixes: Qwen2.5-Coder-1.5B's Q4_K_M (v and down Q6_K in half its layers, a Q6_K head) and the
# 0.5B's (Q5_0, v Q8_0, down Q4_K and Q6_K, a Q8_0 head), as a tiny oracle and its draft
MIXES = {"mix-1.5b": ("qwen2", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}),
         "mix-0.5b": ("qwen2-draft", "Q5_0", {"attn_v": "Q8_0", "ffn_down": "Q4_K", "output": "Q8_0"})}


def dequantize(raw, kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    return reference(raw, GGMLQuantizationType[kind])


def as_float(nibbles, scales, zeros):
    values = torch.stack([nibbles >> 4, nibbles & 15], -1).reshape(nibbles.shape[0], -1).float()
    return ((values - 8).reshape(values.shape[0], -1, 32) * scales[..., None] + zeros[..., None]).reshape(values.shape)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4_bit_blocks_are_read_value_for_value(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = np.random.default_rng(0).standard_normal((48, 512)).astype(np.float32)
    raw = q4_k(weight) if kind == "Q4_K" else quantize(weight, GGMLQuantizationType[kind])
    expected = dequantize(raw, kind)
    assert np.abs(expected - weight).max() < 0.5  # (the test's own Q4_K writer is a Q4_K writer)
    read = as_float(*gguf_blocks.int4(kind, raw, 48, 512))
    assert torch.equal(read, torch.from_numpy(expected))  # in float32, before the kernel's bfloat16 scales


@pytest.mark.parametrize("kind", gguf_blocks.EIGHT_BIT)
def test_5_6_and_8_bit_blocks_are_read_value_for_value(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from tiny import K_QUANTS

    weight = np.random.default_rng(2).standard_normal((48, 512)).astype(np.float32)
    raw = K_QUANTS[kind](weight) if kind in K_QUANTS else quantize(weight, GGMLQuantizationType[kind])
    expected = dequantize(raw, kind)
    assert np.abs(expected - weight).max() < 0.25  # (the test's own K-quant writers are K-quant writers)
    values, scales, zeros, group = gguf_blocks.int8(kind, raw, 48, 512)
    assert group == (16 if kind == "Q6_K" else 32) and values.dtype == torch.int8
    read = (values.float().reshape(48, -1, group) * scales[..., None] + zeros[..., None]).reshape(48, 512)
    assert torch.equal(read, torch.from_numpy(expected))  # in float32, before the kernel's bfloat16 scales


@pytest.mark.parametrize("group", [32, 16])
def test_the_8_bit_kernel_computes_with_its_weights_a_row_alike_alone_or_not(group):
    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    gen = torch.Generator().manual_seed(group)
    values = torch.randint(-128, 128, (40, 256), generator=gen, dtype=torch.int8)
    scales, zeros = torch.rand(40, 256 // group, generator=gen) * 0.01, torch.randn(40, 256 // group, generator=gen) * 0.1
    module = quant.Quantized.int8_grouped(values, scales, zeros, CPU, torch.randn(40, generator=gen), group)
    weight = quant.dequantized(module)
    rounded = lambda t: t.to(torch.bfloat16).float()[..., None]  # noqa: E731 - the kernel's scales
    assert torch.equal(weight, (values.float().reshape(40, -1, group) * rounded(scales) + rounded(zeros)).reshape(40, 256))
    x = torch.randn(9, 256, generator=gen, dtype=torch.bfloat16)
    y, want = module(x).float(), x.float() @ weight.t() + module.bias.float()
    assert (y - want).norm() <= 0.02 * want.norm()  # (the activations are quantized to 8 bits a group)
    assert torch.equal(torch.cat([module(x[i:i + 1]) for i in range(9)]), module(x))
    narrower = module.as_int8(16) if group == 32 else module
    assert torch.equal(quant.dequantized(narrower), weight)


@pytest.mark.parametrize("kind,group", [("int8", 32), ("int8", 16), ("int4", 32)])
def test_symmetric_weights_hold_their_scales_alone_with_the_same_bits(kind, group):
    """Where every zero is 0 (Q8_0, Q5_0, Q6_K; Q4_0) the kernel reads a scale a group, not a pair: fewer bytes,
    and the same bits as the pairs with zeros of 0, for every row count, beside other projections or alone."""
    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    gen = torch.Generator().manual_seed(group + len(kind))
    scales = torch.rand(48, 256 // group, generator=gen) * 0.01
    if kind == "int8":
        values = torch.randint(-128, 128, (48, 256), generator=gen, dtype=torch.int8)
        make = lambda zeros: quant.Quantized.int8_grouped(values, scales, zeros, CPU, group=group)  # noqa: E731
    else:
        nibbles = quant.nibbles_of(torch.randint(0, 16, (48, 256), generator=gen))
        make = lambda zeros: quant.Quantized.int4(nibbles, scales, zeros, CPU, group=group)  # noqa: E731
    alone = make(torch.zeros_like(scales))
    pairs = torch.stack([alone.scales, torch.zeros_like(alone.scales)], -1)
    paired = quant.Quantized(kind, alone.values, pairs, 48, 256, None, group, "", "vnni")
    assert alone.scales.shape == (256 // group, 48) and alone.nbytes < paired.nbytes
    assert torch.equal(quant.dequantized(alone), quant.dequantized(paired))
    x = torch.randn(70, 256, generator=gen, dtype=torch.bfloat16)
    for rows in (1, 2, 3, 4, 7, 9, 70):
        assert torch.equal(alone(x[:rows]), paired(x[:rows])), rows
    with_zeros = make(torch.randn(48, 256 // group, generator=gen) * 0.01)
    assert with_zeros.scales.dim() == 3
    both = quant.product(alone, with_zeros)  # (one with its zeros: the other's become pairs of zeros)
    assert torch.equal(both(x), torch.cat([paired(x), with_zeros(x)], -1))
    assert torch.equal(alone.rows(torch.tensor([5, 0, 47]))(x), paired(x)[:, [5, 0, 47]])  # (a draft's words)


def _activations_quantized(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernels quantize it: int8 per row and group (the K-quants: per 256), amax / 127, rounded to the
    nearest even, float32."""
    v = x.float().reshape(x.shape[0], -1, group)
    scale = v.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((v * inverse).round() * scale).reshape(x.shape)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_run_at_the_files_own_scales_a_row_alike_alone_or_not(kind):
    """Q4_K (int4) and Q6_K (int6) with their super-block scales as the file holds them, 4.63 and 6.56 bits a
    weight: the file's weights exactly (not scales rounded to bfloat16), the product what they and the int8
    activations give (to bfloat16's rounding), a row's bits its own beside others, side by side with another
    projection, or a few rows alone."""
    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from tiny import K_QUANTS

    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 512, generator=gen) * torch.rand(40, 1, generator=gen)
    raw = K_QUANTS[kind](weight.numpy())
    bias = torch.randn(40, generator=gen)
    if kind == "Q6_K":
        parts, make, bits, group = gguf_blocks.q6_k(raw, 40, 512), quant.Quantized.int6, 6, 16
        nbytes = 48 * 512 * 6 // 8 + 48 * (512 // 16 + 2 * 512 // 256)
    else:
        parts, make, bits, group = gguf_blocks.q4_k(raw, 40, 512), quant.Quantized.int4_super, 4, 32
        nbytes = 48 * 512 // 2 + 48 * (2 * 512 // 32 + 4 * 512 // 256)
    module = make(*parts, CPU, bias)
    assert module.group == group and module.super_blocks and module.nbytes == nbytes  # (outputs padded to 48)
    file = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind]))
    assert torch.equal(quant.dequantized(module), file)
    assert torch.equal(quant.dequantized(module.rows(torch.tensor([7, 0, 39]))), file[[7, 0, 39]])
    x = torch.randn(9, 512, generator=gen, dtype=torch.bfloat16)
    # (the activations quantized per super-block of 256, as llama.cpp's Q8_K: per group of 32 misses by ~0.8%)
    want = (_activations_quantized(x, 256).double() @ file.double().t()).float().to(torch.bfloat16).float()
    got = module(x).float() - module.bias.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # (bfloat16 twice: the output, the bias)
    assert (got - want).norm() <= 0.005 * want.norm()
    assert torch.equal(torch.cat([module(x[i:i + 1]) for i in range(9)]), module(x))
    first = [t[:32] for t in parts]
    alone = make(*first, CPU)(x)
    both = quant.product(make(*first, CPU), make(*(t.flip(0) for t in first), CPU))
    assert both.native[3] == bits and torch.equal(both(x)[:, :32], alone)
    eight = module.as_int8(16)  # (what a fused q, k and v of mixed formats runs: its scales in bfloat16)
    assert (quant.dequantized(eight) - file).abs().max() <= 2 ** -7 * file.abs().max()


def _every_form(out_features: int, in_features: int, gen: torch.Generator) -> dict[str, quant.Quantized]:
    """One weight in each form spec's CPU kernels compute: 4 bits with bfloat16 pairs, a scale alone (Q4_0) or Q4_K's own scales, Q6_K's
    6 bits, 8 bits a scale alone (Q8_0, Q5_0) or with zeros, per 32 inputs or 16."""
    from tiny import K_QUANTS

    weight = torch.randn(out_features, in_features, generator=gen) * torch.rand(out_features, 1, generator=gen)
    values = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    nibbles, scales, _ = quant.int4_of(weight)
    forms = {"int4": quant.Quantized.int4(*quant.int4_of(weight), CPU),
             "Q4_0": quant.Quantized.int4(nibbles, scales, torch.zeros_like(scales), CPU),
             "Q4_K": quant.Quantized.int4_super(*gguf_blocks.q4_k(K_QUANTS["Q4_K"](weight.numpy()), out_features,
                                                                  in_features), CPU),
             "Q6_K": quant.Quantized.int6(*gguf_blocks.q6_k(K_QUANTS["Q6_K"](weight.numpy()), out_features,
                                                            in_features), CPU)}
    for group in (32, 16):
        scales = torch.rand(out_features, in_features // group, generator=gen) * 0.01
        forms[f"int8/{group}"] = quant.Quantized.int8_grouped(values, scales, torch.zeros_like(scales), CPU,
                                                              group=group)
        forms[f"int8/{group}+zeros"] = quant.Quantized.int8_grouped(
            values, scales, torch.randn(out_features, in_features // group, generator=gen) * 0.01, CPU, group=group)
    return forms


def test_every_kernel_form_gives_a_row_its_own_bits_in_passes_of_up_to_eight_rows():
    """The kernels take up to 8 rows a pass over the weights (1-4 rows over 1-4 blocks of 16 outputs at once, as
    `blocks_a_pass` says by the weights' bits and the CPU's vendor, 5-8 over one), and past 8 walk them a piece at a time, a pass for each
    8 rows: every row count from 1 to 19, in every form, gives each row the bits it has alone (a pass that computed
    a row otherwise, or skipped a block of a piece, fails here). 1,040 outputs: several pieces and a ragged one at
    every width of weight."""
    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    vendor = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""  # (the rule it runs here)
    assert native.int4().one_stream() == (native.variant() == "avx2" or "GenuineIntel" not in vendor)
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(19, 512, generator=gen, dtype=torch.bfloat16)
    for name, module in _every_form(1040, 512, gen).items():
        assert module.layout == "vnni", name
        alone = torch.cat([module(x[i:i + 1]) for i in range(19)])
        for rows in range(2, 20):
            assert torch.equal(module(x[:rows]), alone[:rows]), (name, rows)
        assert torch.equal(module(x[3:16]), alone[3:16]), name


def test_both_block_rules_give_every_form_the_same_bits(tmp_path):
    """4-bit products of 1-4 rows take one block of outputs at a time on AMD's CPUs and several on Intel's
    (`one_stream`): the other rule, in a process that asks for it, gives every form at 1-9 rows the same bits."""
    if native.int4() is None or native.variant() == "avx2":
        pytest.skip("spec's AVX-512 kernel (an AVX2 build has one rule)")
    gen = torch.Generator().manual_seed(29)
    x = torch.randn(9, 512, generator=gen, dtype=torch.bfloat16)
    forms = _every_form(1040, 512, gen)
    torch.save({"x": x, "forms": forms}, tmp_path / "forms.pt")
    other = "0" if native.int4().one_stream() else "1"
    root = Path(__file__).resolve().parents[1]
    script = (f"import sys, torch; sys.path[:0] = {[str(root), str(root / 'tests')]!r}\n"
              "from spec_cli.exec import native\n"
              f"assert native.int4().one_stream() == {other == '1'}\n"
              f"saved = torch.load({str(tmp_path / 'forms.pt')!r}, weights_only=False)\n"
              "out = {name: [m(saved['x'][:rows]) for rows in range(1, 10)] for name, m in saved['forms'].items()}\n"
              f"torch.save(out, {str(tmp_path / 'other.pt')!r})\n")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "SPEC_ONE_STREAM": other},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    theirs = torch.load(tmp_path / "other.pt", weights_only=False)
    for name, module in forms.items():
        for rows in range(1, 10):
            assert torch.equal(module(x[:rows]), theirs[name][rows - 1]), (name, rows)


def test_a_prompts_read_on_amx_tiles_gives_every_row_its_own_bits():
    """64 rows or more of a Q4_K product run on AMX's tiles where the CPU has them (16 rows a tile product, the
    rows past the last 16 on VNNI), and every form at such row counts gives each row the bits it has alone:
    a prompt's read, a server's batch, a verifying step and a lone token agree to the bit."""
    kernel = native.int4()
    if kernel is None:
        pytest.skip("spec's CPU kernel")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert kernel.tiles() == ("amx_int8" in flags and "amx_tile" in flags and os.environ.get("SPEC_AMX") != "0")
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(83, 2048, generator=gen, dtype=torch.bfloat16)  # (8 super-blocks: a float's order shows)
    for name, module in _every_form(1040, 2048, gen).items():  # (the kernels whole: a layer's call gives them every row)
        mm = {"int8": kernel.mm8, "int6": kernel.mm6}.get(module.kind, kernel.mm)
        alone = torch.cat([mm(x[i:i + 1], module.values, module.scales) for i in range(83)])
        for rows in (64, 70, 83):
            assert torch.equal(mm(x[:rows], module.values, module.scales), alone[:rows]), (name, rows)
        assert torch.equal(mm(x[5:80].contiguous(), module.values, module.scales), alone[5:80]), name


def test_q8_0_blocks_are_two_4_bit_halves_that_add_up_to_the_file():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    raw = quantize(weight, GGMLQuantizationType.Q8_0)
    halves = as_float(*gguf_blocks.q8_halves(raw, 16, 256))
    assert torch.equal(halves[:, :256] + halves[:, 256:], torch.from_numpy(dequantize(raw, "Q8_0")))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_row_has_the_same_bits_whatever_shares_its_product(kind):
    """Up to and past the 32-row pieces, fused (q, k, v side by side) or alone, an output not in 16s padded."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 256, generator=gen) * 0.1 for n in (256, 128, 128, 300)]
    if kind == "int4":
        modules = [quant.Quantized.int4(*quant.int4_of(w), CPU) for w in weights]
    else:
        modules = [quant.Quantized.int8(*quant.int8_of(w), CPU) for w in weights]
    for product in (quant.product(*modules[:3]), quant.product(modules[3])):
        x = torch.randn(1, 70, 256, generator=gen, dtype=torch.bfloat16)
        alone = torch.cat([product(x[:, i: i + 1]) for i in range(70)], 1)
        for n in (2, 3, 5, 8, 17, 32, 33, 70):
            assert torch.equal(product(x[:, :n]), alone[:, :n]), n


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantizing_a_float_weight_keeps_it_close(kind):
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    module = quant.Quantized.int4(*quant.int4_of(weight), CPU) if kind == "int4" else \
        quant.Quantized.int8(*quant.int8_of(weight), CPU)
    error = (quant.dequantized(module) - weight).abs().max().item()
    bound = 0.35 if kind == "int4" else 0.04  # half a 4-bit step of a group of 32 normals; of a row's 8-bit step
    assert 0 < error < bound


# every kind for Qwen2 (biases, q and k in order) and Llama (q and k rows permuted); Llama's 5- and 6-bit kinds,
# read by the same code as Qwen2's, in the slow run
FAMILY_KINDS = [pytest.param(kind, family, marks=[pytest.mark.slow] if family == "oracle" and kind[1] in "56" else [])
                for family in ("oracle", "qwen2") for kind in KINDS]


@pytest.mark.parametrize("kind, family", FAMILY_KINDS)
def test_a_gguf_file_runs_natively_with_the_weights_transformers_reads(files, kind, family):
    """Every tensor where transformers' own (dequantizing) GGUF loader puts it, query and key rows in the
    model's order, Qwen2's biases with their projections: the projections equal to within the kernel's bfloat16
    scales and output, and the logits close to the dequantized model's."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(files), gguf_file=f"{family}-{kind}.gguf",
                                                     dtype=torch.float32)
    said = []
    loaded = load(ModelRef(str(files / f"{family}-{kind}.gguf")), CPU, torch.bfloat16, untested=True,
                  say=said.append)
    assert "reading it at its own quantization once" in said[0]
    assert kind in said[-1]  # the summary line names each format read
    model = loaded.model
    ids = torch.tensor([[5, 17, 33, 2, 91, 120, 7, 250]])
    want, got = reference(ids).logits, model(ids).logits.float()
    assert (got - want).norm() <= 0.05 * want.norm()  # (a dropped bias or a row out of order: far off)
    expected = dict(reference.named_parameters())
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, (quant.Quantized, quant.Doubled)) and "inner" not in name:
            inner = module.inner if isinstance(module, quant.Doubled) else module
            weight = quant.dequantized(inner)
            if isinstance(module, quant.Doubled):
                weight = weight[:, : module.in_features] + weight[:, module.in_features:]
            want = expected[f"{name}.weight"]
            assert (weight - want).abs().max() <= 0.01 * want.abs().max(), name
            if f"{name}.bias" in expected:
                assert torch.equal(inner.bias, expected[f"{name}.bias"].to(inner.bias.dtype)), name
            checked += 1
    if native.int4() is None and kind in gguf_blocks.EIGHT_BIT and kind != "Q8_0":
        return  # (5- and 6-bit blocks run in the compute dtype without spec's kernel)
    assert checked == 2 * 7 + 1  # every projection and the head
    q8 = quant.Doubled if native.int4() is None else quant.Quantized  # (Q8_0 on spec's kernel: one 8-bit product)
    assert isinstance(model.lm_head, q8 if kind == "Q8_0" else quant.Quantized)
    if kind in gguf_blocks.EIGHT_BIT and q8 is quant.Quantized:
        assert (model.lm_head.kind, model.lm_head.layout) == ("int6" if kind == "Q6_K" else "int8", "vnni")
        assert model.lm_head.group == (16 if kind == "Q6_K" else 32)
    if kind in ("Q4_K", "Q6_K") and native.int4() is not None:  # (the file's own numbers, not rounded scales)
        assert model.lm_head.super_blocks
        assert torch.equal(quant.dequantized(model.lm_head), expected["lm_head.weight"])
    embedding = model.get_input_embeddings()
    for name, p in model.named_parameters():  # norms and the embedding, in the compute dtype
        if p is embedding.weight and p.numel() == 0:  # rows read from the file's blocks when looked up
            every = embedding(torch.arange(expected[name].shape[0]))
            assert torch.equal(every, expected[name].to(torch.bfloat16)), name
            continue
        assert p.dtype == torch.bfloat16 and torch.equal(p, expected[name].to(torch.bfloat16)), name
    assert loaded.tokenizer.encode("def fib(n):") == reference_tokens(files)


def test_projections_of_one_input_in_mixed_formats_run_side_by_side_at_their_own_sizes(files):
    """The 1.5B's mix: q and k Q4_K beside v Q6_K run as two products in one native layer call, each at its file's
    own size and values; formats that make more than two runs (or a gate and up that differ) become 8-bit in the
    finer group, one product."""
    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    from transformers import AutoModelForCausalLM

    reference = dict(AutoModelForCausalLM.from_pretrained(str(files), gguf_file="qwen2-mix-1.5b.gguf",
                                                          dtype=torch.float32).named_parameters())
    model = load(ModelRef(str(files / "qwen2-mix-1.5b.gguf")), CPU, torch.bfloat16, untested=True,
                 say=lambda line: None).model
    attention = model.model.layers[0].self_attn
    assert [(m.kind, m.group) for m in (attention.q_proj, attention.k_proj, attention.v_proj)] == [
        ("int4", 32), ("int4", 32), ("int6", 16)]
    mlp = model.model.layers[0].mlp
    assert (mlp.gate_proj.kind, mlp.gate_proj.group, mlp.down_proj.kind) == ("int4", 32, "int6")
    for name in ("q_proj", "v_proj"):
        want = reference[f"model.layers.0.self_attn.{name}.weight"]
        assert torch.equal(quant.dequantized(getattr(attention, name)), want), name  # (the file's own, exactly)
    runner = Runner(model, capacity=64)
    assert runner.lean is not None and [p[3] for p in runner.lean.layers[0].qkv.parts] == [4, 6]
    assert runner.lean.stack is not None and runner.lean.fused[0][1] == [4, 4, 4, 6, 6]  # (one call a forward)
    x = torch.randn(1, 5, 256, dtype=torch.bfloat16)
    assert torch.equal(runner.lean.layers[0].qkv(x), torch.cat([attention.q_proj(x), attention.k_proj(x),
                                                                attention.v_proj(x)], -1))
    three = [attention.q_proj, quant.Quantized.int4(*quant.int4_of(quant.dequantized(attention.k_proj)), CPU),
             attention.v_proj]  # (Q4_K's own scales, bfloat16 pairs, Q6_K: three runs)
    assert len(quant.runs(three)) == 3
    holder = torch.nn.Module()
    for name, m in zip(("q_proj", "k_proj", "v_proj"), three):
        setattr(holder, name, m)
    spec_gguf._alike(holder)
    assert {(m.kind, m.group) for m in (holder.q_proj, holder.k_proj, holder.v_proj)} == {("int8", 16)}


def reference_tokens(files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files / "tokenizer").encode("def fib(n):")


def test_a_tied_head_reads_the_embeddings_own_blocks_and_a_second_load_reads_the_cache(files, cache, monkeypatch):
    path = files / "tied-Q4_0.gguf"
    first = load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=lambda line: None)
    assert isinstance(first.model.lm_head, quant.Quantized) and first.model.lm_head.source == "Q4_0"
    folders = list((cache / "gguf").glob("*-bfloat16-file-v*"))
    assert len(folders) == 1
    stored = sum(f.stat().st_size for f in folders[0].iterdir())
    assert stored <= 1.5 * path.stat().st_size + 200_000  # (+ its tokenizer and configuration files)
    monkeypatch.setattr(spec_gguf, "build", lambda *a: pytest.fail("read the file twice"))
    again = load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=lambda line: None)
    ids = torch.tensor([[5, 17, 33, 2, 91]])
    assert torch.equal(first.model(ids).logits, again.model(ids).logits)
    # the cache keeps the embedding's blocks once: the head is made from them at load, the same values
    import json as _json
    header = (folders[0] / "weights.safetensors").read_bytes()
    names = _json.loads(header[8 : 8 + int.from_bytes(header[:8], "little")])
    assert "model.embed_tokens.weight.q4_0" in names and not any(n.startswith("lm_head.") for n in names)
    for part in ("values", "scales"):
        assert torch.equal(getattr(first.model.lm_head, part), getattr(again.model.lm_head, part))
    table = again.model.get_input_embeddings()  # (its rows read from the blocks when looked up)
    assert table.weight.numel() == 0 and table.blocks.dtype == torch.uint8
    embedding = table(torch.arange(again.model.lm_head.out_features)).float()
    assert (quant.dequantized(again.model.lm_head) - embedding).abs().max() <= 0.01 * embedding.abs().max()


def test_a_touched_file_keeps_its_read_and_a_replaced_one_says_its_old_read_can_go(files, cache, tmp_path,
                                                                                    monkeypatch):
    path = tmp_path / "model.gguf"
    shutil.copyfile(files / "tied-Q4_0.gguf", path)
    load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=lambda line: None)
    later = time.time() + 60
    os.utime(path, (later, later))  # (copied back, mounted again: the same bytes, another modification time)
    assert [e.stale for e in cachedir.entries() if e.kind == "gguf"] == [None]
    build = spec_gguf.build
    monkeypatch.setattr(spec_gguf, "build", lambda *a, **k: pytest.fail("read the same bytes twice"))
    load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=lambda line: None)
    monkeypatch.setattr(spec_gguf, "build", build)
    shutil.copyfile(files / "tied-Q5_0.gguf", path)  # (the file replaced by another version)
    said = []
    load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=said.append)
    assert any("1 earlier read of this path" in line and "--clear stale" in line for line in said), said
    stale = [e for e in cachedir.entries() if e.kind == "gguf" and e.stale]
    assert len(stale) == 1 and "gone or changed" in stale[0].stale
    cachedir.remove(stale[0])
    said.clear()
    load(ModelRef(str(path)), CPU, torch.float32, untested=True, say=said.append)  # (another dtype: not earlier)
    assert not any("earlier read" in line for line in said), said


def test_two_loads_of_a_new_file_at_once_read_it_once_and_get_the_same_model(files, cache, monkeypatch):
    import threading

    build, calls, said = spec_gguf.build, [], []

    def slow_build(*args, **kwargs):  # (long enough for the other load to arrive while this one writes)
        calls.append(args[1])
        time.sleep(1.0)
        return build(*args, **kwargs)

    monkeypatch.setattr(spec_gguf, "build", slow_build)
    cached, one_at_a_time = spec_gguf.from_cache, threading.Lock()

    def from_cache(*args):  # (two processes in life: in one, accelerate's empty-weights patch is process-wide)
        with one_at_a_time:
            return cached(*args)

    monkeypatch.setattr(spec_gguf, "from_cache", from_cache)
    path, models = files / "qwen2-Q4_K.gguf", [None, None]

    def one(k):
        models[k] = load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=said.append).model

    threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and all(m is not None for m in models)
    assert any("another spec process is reading it" in line for line in said), said
    ids = torch.tensor([[5, 17, 33, 2, 91]])
    assert torch.equal(models[0](ids).logits, models[1](ids).logits)
    assert [e.stale for e in cachedir.entries() if e.kind == "gguf"] == [None]


def test_a_tied_head_over_a_5_bit_embedding_is_its_blocks_on_the_8_bit_kernel(files, cache, monkeypatch):
    """A Q5_0 embedding's tied head: 8-bit from the embedding's own blocks (kept once in the cache, made at
    load), the embedding's values; a second load reads the cache."""
    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    path = files / "tied-Q5_0.gguf"
    first = load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=lambda line: None).model
    head = first.lm_head
    assert (head.kind, head.group, head.layout, head.source) == ("int8", 32, "vnni", "Q5_0")
    monkeypatch.setattr(spec_gguf, "build", lambda *a: pytest.fail("read the file twice"))
    again = load(ModelRef(str(path)), CPU, torch.bfloat16, untested=True, say=lambda line: None).model
    embedding = again.get_input_embeddings()(torch.arange(again.lm_head.out_features)).float()
    assert (quant.dequantized(again.lm_head) - embedding).abs().max() <= 0.01 * embedding.abs().max()
    ids = torch.tensor([[5, 17, 33, 2, 91]])
    assert torch.equal(first(ids).logits, again(ids).logits)


def run_methods(oracle, draft, prompt, methods=("baseline", "speculative", "staged", "self"), n=40):
    from spec_cli.core.events import Token
    from spec_cli.core.families import Skip
    from spec_cli.decoding.chain import Models
    from spec_cli.decoding.methods import decode
    from spec_cli.draft2.ngram import PromptLookup

    outputs = {}
    for method in methods:
        models = Models(Runner(oracle, capacity=256), Runner(draft, capacity=256) if draft is not None else None,
                        PromptLookup(), self_skip=Skip.of([1], [0]))
        events = decode(models, prompt, Decoding(method=method, max_new_tokens=n, tree_budget=12))
        outputs[method] = [e.token for e in events if isinstance(e, Token) and e.output]
    return outputs


@pytest.mark.parametrize("source", ["Q4_0", "Q4_K", "Q8_0", "int4", "int8", "mix"])
def test_every_method_is_identical_to_the_quantized_oracle_alone(files, source):
    """GGUF files at their own quantization, and a float checkpoint quantized at load, in bfloat16 (the kernels'
    activations): speculative, staged (with the draft, and with lookup guesses alone) and self-speculative give
    the baseline's tokens, on prompts where the draft and the oracle disagree. "mix": a Qwen2 pair in the real
    pair's mixes of formats (biases, 5-, 6- and 8-bit blocks, q, k and v of two formats as one product)."""
    if source == "mix":
        oracle, draft = (load(ModelRef(str(files / f"qwen2-{name}.gguf")), CPU, torch.bfloat16, untested=True,
                              say=lambda line: None).model for name in MIXES)
    elif source.startswith("Q"):
        oracle = load(ModelRef(str(files / f"oracle-{source}.gguf")), CPU, torch.bfloat16, untested=True,
                      say=lambda line: None).model
        draft = load(ModelRef(str(files / "draft-Q4_0.gguf")), CPU, torch.bfloat16, untested=True,
                     say=lambda line: None).model
    else:
        oracle = load(ModelRef(str(files / "oracle")), CPU, torch.bfloat16, untested=True, quantize=source).model
        draft = load(ModelRef(str(files / "draft")), CPU, torch.bfloat16, untested=True, quantize=source).model
        assert quant.summary(oracle)["quantized"] == 2 * 7 + 1
    rng = random.Random(5)
    corrected = 0
    for length in (6, 40):
        prompt = [rng.randrange(300) for _ in range(length)]
        outputs = run_methods(oracle, draft, prompt)
        outputs["staged, no draft"] = run_methods(oracle, None, prompt, methods=("staged",))["staged"]  # lookup
        assert len(outputs["baseline"]) == 40
        for method, tokens in outputs.items():
            assert tokens == outputs["baseline"], (source, method)
        corrected += 1
    assert corrected == 2


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory):
    """Tiny mixtures of experts (width 256: K-quants' inputs) as GGUF files: a Qwen3-MoE (six experts, three a
    token) in Q4_K_M's mix (Q4_K, down, v and the head Q6_K), Q8_0, Q5_0 and F32, a noisy copy of it in Q4_0 as its
    draft, one whose experts' up is Q8_0 beside a Q4_K gate, a Mixtral (written as llama with experts, as
    llama.cpp does) in Q4_K_M's mix, and a gpt-oss with its experts in MXFP4 and the rest Q8_0."""
    from tiny import make_tokenizer

    root = tmp_path_factory.mktemp("mixtures")
    tokenizer = make_tokenizer(root / "tokenizer")
    for arch, seed in (("qwen3_moe", 5), ("mixtral", 6)):
        make_model(root / arch, arch, len(tokenizer), layers=2, width=256, seed=seed, init=0.1, tokenizer=tokenizer)
        make_gguf(root / arch, root / f"{arch}-Q4_K_M.gguf", "Q4_K", kinds=MIXES["mix-1.5b"][2])
    for kind in ("Q8_0", "Q5_0", "F32"):
        make_gguf(root / "qwen3_moe", root / f"qwen3_moe-{kind}.gguf", kind)
    make_gguf(root / "qwen3_moe", root / "qwen3_moe-split.gguf", "Q4_K", kinds={"ffn_up": "Q8_0"})  # (not one kind)
    make_gguf(root / "qwen3_moe", root / "qwen3_moe-MXFP4_MOE.gguf", "Q8_0",  # (llama-quantize's MXFP4_MOE)
              kinds={"ffn_gate": "MXFP4", "ffn_up": "MXFP4", "ffn_down": "MXFP4"})
    make_noisy_copy(root / "qwen3_moe", root / "qwen3_moe-draft", noise=0.1, seed=7)
    make_gguf(root / "qwen3_moe-draft", root / "qwen3_moe-draft-Q4_0.gguf", "Q4_0")
    make_model(root / "gpt_oss", "gpt_oss", len(tokenizer), layers=2, width=256, seed=8, init=0.1, tokenizer=tokenizer)
    make_gguf(root / "gpt_oss", root / "gpt_oss-MXFP4.gguf", "Q8_0",  # (as ggml-org's gpt-oss files)
              kinds={"ffn_gate": "MXFP4", "ffn_up": "MXFP4", "ffn_down": "MXFP4"})
    return root


@pytest.mark.parametrize("name", ["qwen3_moe-Q4_K_M", "qwen3_moe-Q8_0", "qwen3_moe-Q5_0", "qwen3_moe-F32",
                                  "qwen3_moe-split", "qwen3_moe-MXFP4_MOE", "mixtral-Q4_K_M"])
def test_a_mixtures_experts_run_at_the_files_own_values(mixtures, name):
    """Each expert's gate, up and down read from the file's one tensor a kind as its own projection, at the
    file's values (Q4_K's and Q6_K's exactly, on spec's kernels), and the experts computing what transformers'
    own experts compute with those weights for the same routing (a gate and up swapped, a routing weight from the
    wrong slot, a row's expert skipped fail here)."""
    import gguf

    said = []
    model = load(ModelRef(str(mixtures / f"{name}.gguf")), CPU, torch.bfloat16, untested=True, say=said.append).model
    assert "experts" in said[-1]  # the summary line names the experts' formats
    reader = gguf.GGUFReader(str(mixtures / f"{name}.gguf"))
    stored = {t.name: torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)).float() for t in reader.tensors
              if "_exps" in t.name}
    layers = [m for m in model.modules() if isinstance(m, quant.Experts)]
    assert len(layers) == 2 and all(experts.fused == (name != "qwen3_moe-split") for experts in layers)
    torch.manual_seed(0)
    for i, experts in enumerate(layers):
        held = []
        for e in range(experts.num_experts):
            parts = [experts.gate_up[e]] if experts.fused else [experts.gate[e], experts.up[e]]
            for module in (*parts, experts.down[e]):
                if name.endswith("F32"):
                    assert type(module) is torch.nn.Linear
                else:
                    assert isinstance(module, quant.Quantized) and module.layout == "vnni"
            values = [m.weight.float() if name.endswith("F32") else quant.dequantized(m) for m in parts]
            both, down = torch.cat(values), experts.down[e]
            got = [both, down.weight.float() if name.endswith("F32") else quant.dequantized(down)]
            held.append(got)
            width = both.shape[0] // 2
            for part, value in (("gate", both[:width]), ("up", both[width:]), ("down", got[1])):
                want = stored[f"blk.{i}.ffn_{part}_exps.weight"][e]
                module = down if part == "down" else parts[0] if experts.fused or part == "gate" else parts[1]
                if name.endswith("F32"):
                    assert torch.equal(value, want.to(torch.bfloat16).float()), (part, e)
                elif module.super_blocks or module.kind == "fp4":  # (the file's own weights)
                    assert torch.equal(value, want), (part, e)
                else:
                    assert (value - want).abs().max() <= 0.01 * want.abs().max(), (part, e)
        weights = {"gate_up": torch.stack([h[0] for h in held]), "down": torch.stack([h[1] for h in held])}
        reference = hf_experts(model.config)
        with torch.no_grad():
            reference.gate_up_proj.copy_(weights["gate_up"])
            reference.down_proj.copy_(weights["down"])
        x = torch.randn(9, 256)
        k = model.config.num_experts_per_tok
        index = torch.stack([torch.randperm(experts.num_experts)[:k] for _ in range(9)])
        weight = torch.softmax(torch.randn(9, k), -1)
        got = experts(x.to(torch.bfloat16), index, weight.to(torch.bfloat16)).float()
        want = reference(x, index, weight)
        assert (got - want).norm() <= 0.02 * want.norm()


def test_gpt_oss_experts_run_at_the_files_own_values(mixtures):
    """gpt-oss's experts from an MXFP4 file: each expert's gate and up one product on spec's MXFP4 kernel at the
    file's values exactly, their biases the file's, and the experts computing what transformers' own (its gate and
    up interleaved, its clamped SwiGLU) compute with those weights for the same routing (a bias dropped, the gate
    and up swapped, SiLU for its activation fail here); its router `Routed` with its bias."""
    import gguf

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    said = []
    model = load(ModelRef(str(mixtures / "gpt_oss-MXFP4.gguf")), CPU, torch.bfloat16, untested=True,
                 say=said.append).model
    assert "6 4-bit floats (MXFP4), experts" in said[-1]
    reader = gguf.GGUFReader(str(mixtures / "gpt_oss-MXFP4.gguf"))
    stored = {t.name: torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)).float() for t in reader.tensors
              if "_exps" in t.name}
    layers = [m for m in model.modules() if isinstance(m, quant.Experts)]
    assert len(layers) == 2 and all(isinstance(m.router, quant.Routed) for m in model.modules()
                                    if type(m).__name__ == "GptOssMLP")
    torch.manual_seed(0)
    for i, experts in enumerate(layers):
        reference = hf_experts(model.config)
        for e in range(experts.num_experts):
            both, down = experts.gate_up[e], experts.down[e]
            assert both.kind == down.kind == "fp4"
            gate, up = quant.dequantized(both).chunk(2)
            assert torch.equal(gate, stored[f"blk.{i}.ffn_gate_exps.weight"][e])
            assert torch.equal(up, stored[f"blk.{i}.ffn_up_exps.weight"][e])
            assert torch.equal(quant.dequantized(down), stored[f"blk.{i}.ffn_down_exps.weight"][e])
            with torch.no_grad():
                reference.gate_up_proj[e, :, ::2] = gate.t()
                reference.gate_up_proj[e, :, 1::2] = up.t()
                reference.down_proj[e] = quant.dequantized(down).t()
                reference.gate_up_proj_bias[e, ::2] = stored[f"blk.{i}.ffn_gate_exps.bias"][e]
                reference.gate_up_proj_bias[e, 1::2] = stored[f"blk.{i}.ffn_up_exps.bias"][e]
                reference.down_proj_bias[e] = stored[f"blk.{i}.ffn_down_exps.bias"][e]
        assert torch.equal(experts.gate_bias.float(), stored[f"blk.{i}.ffn_gate_exps.bias"].to(torch.bfloat16).float())
        x = torch.randn(9, 256)
        index = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(9)])
        weight = torch.softmax(torch.randn(9, 2), -1)
        got = experts(x.to(torch.bfloat16), index, weight.to(torch.bfloat16)).float()
        want = reference(x, index, weight)
        assert (got - want).norm() <= 0.02 * want.norm()


def hf_experts(config) -> torch.nn.Module:
    """transformers' own experts of a mixture's configuration (float32, its eager forward)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    config._experts_implementation = "eager"
    return quant.experts_of(AutoModelForCausalLM.from_config(config, dtype=torch.float32))[0][2]


@pytest.mark.parametrize("one_call", [True, False], ids=["native", "loop"])
def test_experts_give_a_row_the_bits_it_has_alone(one_call, monkeypatch):
    """A row's output from the experts is the same bits whatever rows share the forward (each expert's product
    row-invariant, a row's experts added in the experts' order), as spec's native experts compute it (one call) and
    as its loop does: with three experts a token, the loop summing them in the order the batch met them fails here.
    The two agree to bfloat16's rounding (their SiLUs round alike but for an ulp here and there)."""
    if one_call and native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    experts = quant.Experts(6, 256, 256, torch.nn.SiLU(), torch.bfloat16)
    torch.manual_seed(1)
    for part, rows in (("gate_up", 512), ("down", 256)):
        for e in range(6):
            experts.get_submodule(part)[e] = quant.Quantized.int4(*quant.int4_of(torch.randn(rows, 256) * 0.1), CPU)
    x = torch.randn(12, 256).to(torch.bfloat16)
    index = torch.stack([torch.randperm(6)[:3] for _ in range(12)])
    weight = torch.softmax(torch.randn(12, 3), -1).to(torch.bfloat16)
    looped = experts(x.float(), index, weight).to(torch.bfloat16)  # (float32 rows: the loop, whatever is built)
    if not one_call:
        monkeypatch.setattr(quant.Experts, "_one_call", lambda self: False)
    together = experts(x, index, weight)
    assert bool(experts._kernel) == one_call
    for r in range(12):
        assert torch.equal(experts(x[r:r + 1], index[r:r + 1], weight[r:r + 1])[0], together[r]), r
    assert (together.float() - looped.float()).norm() <= 0.01 * looped.float().norm()


def test_gpt_oss_experts_in_one_native_call_have_the_loops_bits(monkeypatch):
    """gpt-oss's experts (biases, its clamped SwiGLU) as one native call: the loop's operations (its activation by
    torch's, its biases in the products' bias slots), the same bits row by row, and a row's bits its own (a bias
    left out, or the activation's clamps, fail here)."""
    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    experts = quant.Experts(4, 256, 128, quant.ClampedSwiGLU(1.702, 7.0), torch.bfloat16, biases=True)
    torch.manual_seed(2)
    for part, rows in (("gate_up", 256), ("down", 256)):
        for e in range(4):
            columns = 256 if part == "gate_up" else 128
            experts.get_submodule(part)[e] = quant.Quantized.int4(*quant.int4_of(torch.randn(rows, columns)), CPU)
    with torch.no_grad():
        experts.gate_bias = torch.nn.Parameter(torch.randn(4, 128).bfloat16(), requires_grad=False)
        experts.up_bias = torch.nn.Parameter(torch.randn(4, 128).bfloat16(), requires_grad=False)
        experts.down_bias = torch.nn.Parameter(torch.randn(4, 256).bfloat16(), requires_grad=False)
    x = torch.randn(10, 256).bfloat16()
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    weight = torch.softmax(torch.randn(10, 2), -1).to(torch.bfloat16)
    together = experts(x, index, weight)
    assert experts._kernel
    for r in range(10):
        assert torch.equal(experts(x[r:r + 1], index[r:r + 1], weight[r:r + 1])[0], together[r]), r
    monkeypatch.setattr(quant.Experts, "_one_call", lambda self: False)
    assert torch.equal(experts(x, index, weight), together)


@pytest.mark.parametrize("family, kind", [("qwen3_moe", "int4"), ("mixtral", "int8")])
def test_a_mixtures_experts_are_quantized_at_load_and_stay_exact(mixtures, family, kind):
    """A mixture from a Hugging Face folder with `--quantize int4|int8`: its experts (transformers' 3-d weights)
    split into one projection each and quantized as any projection (before, they stayed in the model's dtype), its
    router `Routed`; every method gives the baseline's tokens."""
    model = load(ModelRef(str(mixtures / family)), CPU, torch.bfloat16, untested=True, quantize=kind).model
    experts = [m for m in model.modules() if isinstance(m, quant.Experts)]
    assert len(experts) == 2 and all(isinstance(p, quant.Quantized) for m in experts for p in (*m.gate_up, *m.down))
    assert sum(isinstance(m, quant.Routed) for m in model.modules()) == 2
    rng = random.Random(4)
    for length in (6, 40):
        prompt = [rng.randrange(300) for _ in range(length)]
        outputs = run_methods(model, None, prompt, methods=("baseline", "staged", "self"))
        assert len(outputs["baseline"]) == 40
        assert outputs["staged"] == outputs["baseline"] and outputs["self"] == outputs["baseline"], (family, kind)


@pytest.mark.parametrize("cohort", [False, True], ids=["threads", "cohort"])
@pytest.mark.parametrize("name", ["qwen3_moe-Q4_K_M", "gpt_oss-MXFP4"])
def test_a_mixtures_rows_in_a_servers_shared_forwards_have_the_bits_they_have_alone(mixtures, cohort, name):
    """`spec serve`'s slots over a quantized mixture (Qwen3-MoE in Q4_K_M's mix; gpt-oss in MXFP4, its attention
    sinks in each part's attention): sequences whose prompts, chains, trees and single tokens share forwards,
    their rows routed to the experts among each other's, get the bits each gets alone."""
    from test_lockstep import steps, together

    if name.startswith("gpt_oss") and native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    oracle = load(ModelRef(str(mixtures / f"{name}.gguf")), CPU, torch.bfloat16, untested=True,
                  say=lambda line: None).model
    rng = random.Random(6)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(2, 70))] for _ in range(4)]
    alone = [steps(Runner(oracle, capacity=256), p, 8 + 2 * k, seed=k) for k, p in enumerate(prompts)]
    found, lockstep = together(lambda k, ls: steps(Runner(oracle, capacity=256, lockstep=ls), prompts[k], 8 + 2 * k,
                                                   seed=k), len(prompts), cohort=cohort)
    assert lockstep.counts.widest >= 3  # (shared)
    for k, (mine, theirs) in enumerate(zip(found, alone)):
        assert len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs)), k


@pytest.mark.skipif(native.int4() is None, reason="spec's kernels")
def test_a_routers_product_gives_a_row_the_bits_it_has_alone():
    """A mixture's router (transformers' own: its product, then each row's softmax and top-k) as a GGUF mixture's
    load wraps it (`quant.Routed`: its product on spec's `mm16` in bfloat16), at Mixtral 8x7B's shape (4096 inputs, 8
    experts), where torch's bfloat16 product, packed by oneDNN or not, gives with two threads a row in a few hundred
    other bits than alone (a Xeon: these rows hold one for each): a verified row would be routed otherwise. Each
    row's logits, weights and experts are its own whatever rows share the call."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (the hazard shows with two threads here: each of a product's threads its rows)
    try:
        for seed in (2, 7, 60):  # (data where torch's unpacked product gives a row of 24 other bits on a Xeon)
            generator = torch.Generator().manual_seed(seed)
            router = MixtralTopKRouter(MixtralConfig(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2))
            with torch.no_grad():
                router.weight.copy_(torch.randn(8, 4096, generator=generator) * 0.02)
            router.to(torch.bfloat16)
            route = quant.Routed(router)
            x = torch.randn(24, 4096, generator=generator).to(torch.bfloat16)
            together = route(x)
            for r in range(24):
                alone = route(x[r:r + 1])
                assert all(torch.equal(a[0], t[r]) for a, t in zip(alone, together)), (seed, r)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("oracle, draft", [("qwen3_moe-Q4_K_M", "qwen3_moe-draft-Q4_0"), ("mixtral-Q4_K_M", None),
                                           ("qwen3_moe-MXFP4_MOE", None),
                                           ("qwen2_moe", None), ("granitemoe", None), ("olmoe", None),
                                           ("deepseek_v2_yarn", None), ("gpt_oss-MXFP4", None),
                                           ("ernie4_5_moe", None), ("deepseek_v3", None), ("glm4_moe_lite", None),
                                           ("glm4_moe", None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_every_method_is_identical_to_a_quantized_mixture_alone(mixtures, oracle, draft, dtype):
    """A mixture of experts from a GGUF file at its own quantization, in bfloat16: speculative, staged (with the
    draft, and with lookup guesses alone) and self-speculative give the baseline's tokens; a verified row routes
    to the experts, and gets from them, what it does alone. qwen2_moe (its shared expert and its gate), granitemoe
    (its model's own forward: no lean loop), olmoe and DeepSeek-V2 (a float32 router): the files llama.cpp's
    converter wrote (tests/gguf_archs), their experts float. In bfloat16 (what such files run in by default) and
    in float32."""
    where = {name: ARCHS for name in ("qwen2_moe", "granitemoe", "olmoe", "deepseek_v2_yarn", "ernie4_5_moe",
                                      "deepseek_v3", "glm4_moe_lite", "glm4_moe")}
    models = [load(ModelRef(str(where.get(name, mixtures) / f"{name}.gguf")), CPU, dtype, untested=True,
                   say=lambda line: None).model if name else None for name in (oracle, draft)]
    block = next(m for m in models[0].modules() if isinstance(getattr(m, "experts", None), quant.Experts))
    assert isinstance(getattr(block, "gate", getattr(block, "router", None)), quant.Routed)
    shared_gate = getattr(block, "shared_expert_gate", None)  # (Qwen2-MoE's)
    assert shared_gate is None or isinstance(shared_gate, quant.Routed)
    rng = random.Random(3)
    methods = ("baseline", "speculative", "staged", "self") if draft else ("baseline", "staged", "self")
    for length in (6, 40):
        prompt = [rng.randrange(300) for _ in range(length)]
        outputs = run_methods(*models, prompt, methods=methods)
        if draft:
            outputs["staged, no draft"] = run_methods(models[0], None, prompt, methods=("staged",))["staged"]
        assert len(outputs["baseline"]) == 40
        for method, tokens in outputs.items():
            assert tokens == outputs["baseline"], (oracle, method)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_k=20, seed=4)])
def test_a_windowed_quantized_draft_keeps_the_text_and_its_cache_is_bitwise_a_fresh_read(files, monkeypatch,
                                                                                      sampling):
    """The real pair's formats in bfloat16, each layer one native call: a chat whose turns outgrow the draft's
    reading (DRAFT_READS, 12 here) gives baseline's text, greedy and coupled, and the windowed draft's cache holds
    the bits a fresh read of its window gives (slots and rotary positions from the window's start), turn after
    turn: what it reads on from its window lands where a fresh read puts it."""
    from spec_cli.core.events import Token
    from spec_cli.decoding import chain
    from spec_cli.decoding.chain import Models
    from spec_cli.decoding.methods import decode
    from spec_cli.draft2.ngram import PromptLookup

    monkeypatch.setattr(chain, "DRAFT_READS", 12)
    oracle, draft = (load(ModelRef(str(files / f"qwen2-{name}.gguf")), CPU, torch.bfloat16, untested=True,
                          say=lambda line: None).model for name in MIXES)
    rng = random.Random(9)
    for method in ("speculative", "staged"):
        pair = Models(Runner(oracle, capacity=256), Runner(draft, capacity=256), PromptLookup())
        assert pair.draft.lean is not None and pair.draft.lean.stack is not None  # (the layers as one call)
        history, bases = [rng.randrange(300) for _ in range(30)], []
        for added in (0, 3, 40):
            history = history + [rng.randrange(300) for _ in range(added)]
            settings = dict(method=method, max_new_tokens=20, tree_adaptive=False, **sampling)
            alone = Models(Runner(oracle, capacity=256))
            fresh = [e.token for e in decode(alone, history, Decoding(**{**settings, "method": "baseline"}))
                     if isinstance(e, Token) and e.output]
            got = [e.token for e in decode(pair, history, Decoding(**settings), reuse=True)
                   if isinstance(e, Token) and e.output]
            assert got == fresh, (method, added)
            runner, n = pair.draft, pair.draft.committed
            assert runner.base > 0 and runner.tokens == (history + got)[runner.base : runner.base + n]
            clean = Runner(draft, capacity=256)
            clean.window((history + got)[: runner.base + n], n)  # (a fresh runner's window at the same place)
            assert clean.base == runner.base
            clean.forward(runner.tokens, commit=n)
            for mine, theirs in ((runner.keys, clean.keys), (runner.values, clean.values)):
                assert torch.equal(torch.stack(mine)[..., :n, :], torch.stack(theirs)[..., :n, :]), (method, added)
            bases.append(runner.base)
            history = history + got
        assert bases[0] == bases[1] < bases[2], bases


def test_a_gguf_draft_whose_weights_nobody_chose_runs_int4_and_changes_no_output(files, tmp_path):
    """The real pair's draft is mostly Q5_0: as a draft (its precision changes no output) it runs int4 on a CPU
    with spec's kernel, its 4-bit blocks as they are and the rest requantized; chosen weights are kept."""
    from spec_cli.completion import complete
    from spec_cli.engine import Engine, Plan
    from spec_cli.models import profiles

    if native.int4() is None:
        pytest.skip("spec's CPU kernel")
    path = tmp_path / "pair.toml"

    def engine(draft: str) -> Engine:
        path.write_text(f'oracle = "{files / "qwen2-mix-1.5b.gguf"}"\ndraft = {draft}\n')
        return Engine(profiles.load(str(path)))

    chosen = engine(f'"{files / "qwen2-mix-0.5b.gguf"}"')
    draft = chosen.load_draft().model
    assert chosen.draft.ref.quantize == "int4"
    kinds = {(m.kind, m.source) for m in draft.modules() if isinstance(m, quant.Quantized)}
    assert kinds == {("int4", "int4 (from Q5_0)"), ("int4", "int4 (from Q8_0)"), ("int4", "Q4_K")}, kinds
    ids = [5, 17, 33, 2, 9]
    base = complete(chosen, ids, Plan(Decoding(method="baseline", max_new_tokens=30))).tokens
    for method in ("speculative", "staged"):
        assert complete(chosen, ids, Plan(Decoding(method=method, max_new_tokens=30))).tokens == base, method
    kept = engine(f'{{ model = "{files / "qwen2-mix-0.5b.gguf"}", quantize = "auto" }}').load_draft().model
    assert any(m.kind == "int8" for m in kept.modules() if isinstance(m, quant.Quantized))


def test_a_quantized_model_in_float32_attends_with_spec_s_own_and_passes_its_check(files):
    """Quantized projections compute in bfloat16 whatever the model's dtype, so in float32 on a CPU torch's
    attention, which groups a row's sums by the rows and slots a forward has, would flip a rounding there that
    grows through the layers (a Qwen2.5 GGUF: a fifth of a logit): such a model attends with spec's own, whose
    rows are their own bits, so its trees are exact and `spec check` holds them to their paths bitwise (and the
    model's own forward at bfloat16's tolerance); a float32 model keeps torch's attention and float32's."""
    from spec_cli.models.conformance import compute_dtype, conformance

    loaded = load(ModelRef(str(files / "qwen2-Q4_K.gguf")), CPU, torch.float32, untested=True, say=lambda line: None)
    runner = Runner(loaded.model)
    assert compute_dtype(loaded.model) == torch.bfloat16 and runner.exact_trees
    assert runner.lean.attention is not None and runner.lean.glue is None
    results = list(conformance(loaded.model, loaded.tokenizer, 8))
    assert all(r.ok for r in results), results
    assert "verified as chains" not in results[1].detail
    plain = load(ModelRef(str(files / "qwen2")), CPU, torch.float32, untested=True).model
    assert compute_dtype(plain) == torch.float32 and Runner(plain).exact_trees and Runner(plain).lean.attention is None


def test_a_quantized_model_in_float32_gives_a_chain_s_rows_the_attention_they_get_alone(files):
    """What each row of a verified chain hands the output projection is what it hands it in a one-token step, bit
    for bit (the bfloat16 products round from it): after 200 tokens torch's float32 attention gives most rows of
    an 8-row chain other bits than alone."""
    loaded = load(ModelRef(str(files / "qwen2-Q4_K.gguf")), CPU, torch.float32, untested=True, say=lambda line: None)
    prompt = [(5 * i + 1) % 200 + 3 for i in range(200)]
    chain = [11, 12, 13, 14, 15, 16, 17, 18]

    def recorded(runner):
        seen = []
        out = runner.lean.out
        runner.lean.out = lambda layer, a: seen.append(a[0].clone()) or out(layer, a)
        return seen

    together = Runner(loaded.model, capacity=256)
    together.forward(prompt, commit=len(prompt))
    seen = recorded(together)
    together.forward(chain)
    layers = len(seen)
    alone = Runner(loaded.model, capacity=256)
    alone.forward(prompt, commit=len(prompt))
    steps = recorded(alone)
    for token in chain:
        alone.forward([token], commit=1)
    for i in range(layers):
        for r in range(len(chain)):
            assert torch.equal(seen[i][r], steps[r * layers + i][0]), (i, r)


def test_the_quantize_switch_names_the_weights_format_and_refuses_what_it_does_not_know(files, tmp_path):
    run = spec("generate", "--oracle", str(files / "oracle-Q4_1.gguf"), "-m", "baseline", "-n", "8", "--json",
               "--quantize", "int8", "def", env={"SPEC_CACHE_DIR": str(tmp_path / "c"), "SPEC_ALLOW_UNTESTED": "1"})
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["weights"]["format"].startswith("int8") and record["weights"]["bytes"] > 0
    assert record["draft_weights"] is None  # (no draft: none loaded)
    assert_clean_error(spec("generate", "--oracle", str(files / "oracle-Q4_1.gguf"), "--quantize", "int3", "hi"),
                       "--quantize must be one of auto, none, int8, int4, not 'int3'")


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "olmo2", "gpt2"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_other_families_quantize_every_linear_and_stay_exact(tmp_path, family, kind):
    """OLMo 2 runs its own forward (every nn.Linear replaced), Gemma 3 the lean loop (q, k and v as one quantized
    product, gate and up as another), Phi-3 the lean loop (its own fused q, k and v, and gate and up), GPT-2 the
    lean loop (Conv1D too)."""
    from archs import make
    from transformers import AutoModelForCausalLM

    make(tmp_path / "oracle", family, 300, seed=1)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / "oracle", dtype=torch.bfloat16).eval()
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "oracle", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1 * (p.float().std() if p.numel() > 1 else 0))
    layers = sum(1 for _ in quant.linear_layers(oracle))
    assert quant.quantize_model(oracle, kind) == layers > 0 and quant.quantize_model(draft, kind) == layers
    assert not list(quant.linear_layers(oracle))
    lean = Runner(oracle).lean
    assert (lean is None) == (family == "olmo2")
    if family in ("gemma3_text", "phi3"):
        assert all(hasattr(layer.qkv, "packed") and hasattr(layer.mlp, "packed") for layer in lean.layers)
    prompt = [random.Random(1).randrange(300) for _ in range(12)]
    outputs = run_methods(oracle, draft, prompt, n=24)
    assert len(outputs["baseline"]) == 24
    for method, tokens in outputs.items():
        assert tokens == outputs["baseline"], (family, kind, method)


GEMMA3_KINDS = ("Q4_0", "Q4_1", "Q8_0")
GEMMA3_TEXTS = ("Once upon a time there was a function that made the first list of people, and the first list",
                "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n")


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory):
    """Tiny random Gemma 3 GGUF files (tests/tiny.py's shape), written by benchmarks/scripts/random_gguf.py."""
    from tiny import make_gemma3_gguf

    root = tmp_path_factory.mktemp("gemma3")
    for kind in GEMMA3_KINDS:
        make_gemma3_gguf(root / f"gemma3-{kind}.gguf", kind)
    return root


def gemma3(files, kind="Q4_0"):
    return load(ModelRef(str(files / f"gemma3-{kind}.gguf")), CPU, torch.bfloat16, say=lambda line: None)


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_a_gemma3_gguf_runs_natively_on_the_lean_loop(gemma3_files, kind):
    """Every projection from the file's own blocks (no float copy), fused on the lean loop."""
    from tiny import TINY_GEMMA3

    model = gemma3(gemma3_files, kind).model
    projections = {name: m for name, m in model.named_modules()
                   if isinstance(m, (quant.Quantized, quant.Doubled)) and not name.endswith(".inner")}
    assert len(projections) == 7 * TINY_GEMMA3["layers"] + 1  # q, k, v, o, gate, up, down; the head
    assert all(m.source == kind for m in projections.values())
    if kind == "Q8_0":
        assert all(isinstance(m, quant.Doubled) if native.int4() is None else (m.kind, m.layout) == ("int8", "vnni")
                   for m in projections.values())
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    width, layers = TINY_GEMMA3["hidden"], TINY_GEMMA3["layers"]
    floats = sum(p.numel() for p in model.parameters())  # the norms alone: the embedding's rows come from its
    assert floats == layers * (4 * width + 2 * TINY_GEMMA3["head_dim"]) + width  # blocks, scaled as Gemma's are
    embedding, ids = model.get_input_embeddings(), torch.tensor([[3, 77, 500]])
    assert embedding.blocks.dtype == torch.uint8 and embedding.weight.numel() == 0
    from gguf.quants import dequantize
    table = torch.from_numpy(dequantize(embedding.blocks.numpy(), embedding.block_kind)).to(torch.bfloat16)
    assert torch.equal(embedding(ids), table[ids] * torch.tensor(width**0.5, dtype=torch.bfloat16))
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 6 * layers + 1 and max(p.float().abs().mean() for p in norms) < 0.2  # the
    # file holds 1 + weight, as llama.cpp's converter writes Gemma's norms: near-neutral ones read back near 0
    lean = Runner(model).lean
    assert isinstance(lean, backends.Gemma3)
    fused = kind != "Q8_0" or native.int4() is not None  # (Q8_0's two int4 halves run as separate products)
    assert all(hasattr(layer.qkv, "packed") == hasattr(layer.mlp, "packed") == fused for layer in lean.layers)
    assert [layer.kind for layer in lean.layers] == ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_spec_on_a_gemma3_gguf_gives_the_logits_of_transformers_own_load(gemma3_files, kind):
    """spec (int4 blocks, int8 activations, bfloat16) against transformers' dequantized float32 forward of the
    same file, on prompts longer than the sliding window: close enough that a norm without its 1 +, the local
    rope on global layers or the global on local ones, or swapped layer types fail it (each tried)."""
    from tiny import TINY_GEMMA3
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(gemma3_files), gguf_file=f"gemma3-{kind}.gguf",
                                                     dtype=torch.float32).eval()
    loaded = gemma3(gemma3_files, kind)
    runner = Runner(loaded.model)
    for text in GEMMA3_TEXTS:
        ids = loaded.tokenizer.encode(text)
        assert ids[0] == 2 and len(ids) > 2 * TINY_GEMMA3["window"]  # <bos>; the windows cut
        runner.reset()
        got = runner.forward(ids, commit=len(ids)).logits.float()
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].float()
        error, scale = (got - want).abs(), want.std()
        assert error.mean() < 0.025 * scale and error.max() < 0.2 * scale, (text, error.mean() / scale,
                                                                           error.max() / scale)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_every_method_is_identical_to_the_quantized_gemma3_alone(gemma3_files):
    """Speculative and staged with a self-draft, staged on lookup guesses alone, and self-speculative give the
    baseline's tokens on the Q4_0 file."""
    from spec_cli.core.events import Token
    from spec_cli.core.families import Skip
    from spec_cli.decoding.chain import Models
    from spec_cli.decoding.methods import decode
    from spec_cli.draft2.ngram import PromptLookup

    loaded = gemma3(gemma3_files)
    model, skip = loaded.model, Skip.of([1, 3], [2, 4])
    prompts = [loaded.tokenizer.encode(text) for text in GEMMA3_TEXTS]
    prompts.append([2] + [random.Random(3).randrange(263, 512) for _ in range(12)])
    rejected = 0
    for prompt in prompts:
        outputs = {}
        for name, method, drafted in (("baseline", "baseline", False), ("speculative", "speculative", True),
                                      ("staged", "staged", True), ("staged, lookup alone", "staged", False),
                                      ("self", "self", False)):
            models = Models(Runner(model, capacity=256), Runner(model, capacity=256, skip=skip) if drafted else None,
                            PromptLookup(), self_skip=skip)
            events = list(decode(models, prompt, Decoding(method=method, max_new_tokens=32, tree_budget=12)))
            outputs[name] = [e.token for e in events if isinstance(e, Token) and e.output]
            rejected += sum(isinstance(e, Token) and not e.output for e in events)
        assert len(outputs["baseline"]) == 32
        for name, tokens in outputs.items():
            assert tokens == outputs["baseline"], name
    assert rejected > 0


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_llama_cpp_reads_the_gemma3_file_as_spec_does(gemma3_files, kind, monkeypatch):
    """The writer's file is a real Gemma 3 GGUF: llama.cpp tokenizes as spec does and picks the same next token
    at (nearly) every position."""
    llama_cpp = pytest.importorskip("llama_cpp")
    defaults = llama_cpp.llama_model_default_params

    def no_repack():  # (llama-cpp-python 0.3.36's weight repacking crashed on a Xeon with AMX)
        params = defaults()
        params.use_extra_bufts = False
        return params

    monkeypatch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", no_repack)
    peer = llama_cpp.Llama(model_path=str(gemma3_files / f"gemma3-{kind}.gguf"), n_threads=1, n_ctx=256,
                           logits_all=True, verbose=False)
    loaded = gemma3(gemma3_files, kind)
    runner = Runner(loaded.model)
    agree = total = 0
    for text in GEMMA3_TEXTS + ("hello world, the data", "the first people made water in the way"):
        ids = loaded.tokenizer.encode(text)
        assert peer.tokenize(text.encode(), add_bos=True) == ids
        peer.reset()
        peer.eval(ids)
        theirs = torch.from_numpy(np.array(peer.scores[: len(ids)])).argmax(-1)
        runner.reset()
        agree += int((runner.forward(ids, commit=len(ids)).logits.argmax(-1) == theirs).sum())
        total += len(ids)
    assert agree >= 0.9 * total


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_quantized_copy_is_read_back_for_the_same_weights_only(tmp_path, monkeypatch, kind):
    from transformers import AutoModelForCausalLM

    make_model(tmp_path / "model", "llama", 300, 2, 64, seed=3)
    copies = tmp_path / "copies"
    calls = []
    real = {"int4": quant.int4_of, "int8": quant.int8_of}[kind]
    monkeypatch.setattr(quant, f"{kind}_of", lambda weight: calls.append(1) or real(weight))

    def loaded(change=None):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16).eval()
        if change is not None:
            with torch.no_grad():
                change(model)
        calls.clear()
        count = quant.quantize_model(model, kind, copies=copies)
        with torch.inference_mode():
            return model, count, model(torch.tensor([[5, 17, 33, 2, 91]])).logits

    first, count, logits = loaded()
    assert count > 0 and len(calls) == count and len(list(copies.glob("*.pt"))) == 1
    [copy] = copies.glob("*.pt")
    os.utime(copy, (1e9, 1e9))
    again, count_again, logits_again = loaded()
    assert calls == [] and count_again == count  # read back, not quantized again
    assert copy.stat().st_mtime > 1e9  # and marked used (what `spec cache` shows)
    assert torch.equal(logits_again, logits)
    for (name, a), (_, b) in zip(first.named_buffers(), again.named_buffers()):
        assert torch.equal(a, b), name
    other, _, logits_other = loaded(lambda m: m.model.layers[1].mlp.down_proj.weight.mul_(1.01))  # fine-tuned
    assert len(calls) == count and len(list(copies.glob("*.pt"))) == 2
    assert not torch.equal(logits_other, logits)
    for path in copies.glob("*.pt"):
        path.write_bytes(b"not a copy")  # unreadable: quantized again, and written anew
    _, _, logits_mended = loaded()
    assert len(calls) == count and torch.equal(logits_mended, logits)
    loaded()
    assert calls == []


@pytest.mark.parametrize("reserve", [1 << 12, 8])  # the header in its room; longer than its room (copied after)
def test_a_streamed_safetensors_file_reads_back_whole_by_spec_and_by_safetensors(tmp_path, reserve):
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(5)
    written = {"a.weight": torch.randn(33, 7, generator=gen), "b.nibbles": torch.randint(0, 255, (5, 3),
               dtype=torch.uint8, generator=gen), "c": torch.randn(4, generator=gen).to(torch.bfloat16)}
    stream = spec_gguf.Stream(tmp_path / "w.safetensors", reserve=reserve)
    for name, tensor in written.items():
        stream[name] = tensor
    stream.close()
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    with spec_gguf.Stored(tmp_path / "w.safetensors") as ours, safe_open(str(tmp_path / "w.safetensors"), "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys()) == sorted(written)
        for name, tensor in written.items():
            assert torch.equal(ours.get_tensor(name), tensor) and torch.equal(theirs.get_tensor(name), tensor)
    size = (tmp_path / "w.safetensors").stat().st_size
    data = sum(t.numel() * t.element_size() for t in written.values())
    assert size == 8 + max(reserve, size - 8 - data) + data and (size - data) % 8 == 0


@pytest.mark.parametrize("failure", ["full", "interrupted"])
def test_a_first_read_that_fails_leaves_no_half_copy_and_says_what_to_do(files, cache, monkeypatch, failure):
    import errno

    real, written = spec_gguf.Stream.__setitem__, []

    def write(self, name, tensor):
        if len(written) == 6:
            if failure == "full":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise KeyboardInterrupt
        written.append(name)
        real(self, name, tensor)

    monkeypatch.setattr(spec_gguf.Stream, "__setitem__", write)
    result = spec("generate", "--oracle", str(files / "qwen2-Q4_K.gguf"), "-n", "4", "def f(x):")
    said = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and "reading it at its own quantization once" in said[0]
    if failure == "full":
        assert result.returncode == 2 and len(said) == 2 and said[1].startswith("error: cannot write the packed")
        assert "No space left on device" in said[1] and "spec cache" in said[1]
    else:
        assert result.returncode == 130 and said[-1] == "interrupted"
    assert len(written) == 6 and sorted(p.name for p in (cache / "gguf").iterdir()) == [".locks", "hashes.json"]
    assert all(lock.stat().st_size == 0 for lock in (cache / "gguf" / ".locks").iterdir())  # (no half copy)
    monkeypatch.setattr(spec_gguf.Stream, "__setitem__", real)
    assert spec("generate", "--oracle", str(files / "qwen2-Q4_K.gguf"), "-n", "4", "def f(x):").returncode == 0
