"""spec's own CPU int4 kernel (spec_cli/exec/native): its layout, its arithmetic, and a row's bits whatever shares
the product."""

import math

import pytest
import torch

from spec_cli.exec import native, quant


@pytest.fixture(autouse=True, scope="module")
def built():
    """The kernels, built (once, into the cache) when the first test here runs, not when tests are collected."""
    if native.int4() is None:
        pytest.skip(f"spec's int4 kernel: {native.status()}")


def weight(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return quant.int4_of(torch.randn(out_features, in_features, generator=generator))


def reference(x, nibbles, scales, zeros):
    """The kernel's arithmetic in float64: each row's activations as int8 per group of 32 (scale max/127, rounded
    half to even), integer sums, then the group's scale and zero."""
    rows, inputs = x.shape
    values = torch.stack([nibbles >> 4, nibbles & 15], -1).reshape(nibbles.shape[0], inputs).double()
    xf = x.float().reshape(rows, -1, 32)
    d = xf.abs().amax(-1) / 127
    xq = torch.round(xf * torch.where(d > 0, 1 / d, torch.zeros_like(d))[..., None]).double()
    sums = torch.einsum("rgj,ngj->rng", xq, values.reshape(values.shape[0], -1, 32))
    s, z = scales.double(), zeros.double()  # [out, groups]
    return (sums * s[None] * d.double()[:, None] + (z - 8 * s)[None] * (d.double() * xq.sum(-1))[:, None]).sum(-1)


def test_pack_and_unpack_are_inverse():
    nibbles, _, _ = weight(48, 96)
    values = torch.stack([nibbles >> 4, nibbles & 15], -1).reshape(48, 96)
    packed = native.pack(nibbles)
    assert packed.shape == nibbles.shape and not torch.equal(packed, nibbles)
    assert torch.equal(native.unpack(packed), values)


@pytest.mark.parametrize("shape", [(16, 32), (48, 256), (896, 160), (160, 4864)])
def test_the_compiled_packers_give_their_torch_forms_bytes(shape):
    """The loader packs weights by the compiled module (`pack4`, `pack6`, `pack8`): the same bytes as the layouts'
    torch forms, which the kernels are tested against, for every value at every place."""
    out, inputs = shape
    gen = torch.Generator().manual_seed(out + inputs)
    nibbles = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8, generator=gen)
    assert torch.equal(native.int4().pack4(nibbles), native.torch_pack(nibbles))
    values = torch.randint(-128, 128, (out, inputs), dtype=torch.int8, generator=gen)
    for group in (32, 16):
        assert torch.equal(native.int4().pack8(values, group), native.torch_pack8(values, group))
    sixes = torch.randint(-32, 32, (out, inputs), dtype=torch.int8, generator=gen)
    assert torch.equal(native.int4().pack6(sixes), native.torch_pack6(sixes))
    assert torch.equal(native.pack(nibbles), native.torch_pack(nibbles))  # (what the loader calls: the module's)


@pytest.mark.parametrize("shape", [(80, 64), (960, 576), (16, 1536)])
def test_the_kernel_computes_its_arithmetic(shape):
    nibbles, scales, zeros = weight(*shape)
    module = quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu"))
    assert module.layout == "vnni"
    x = torch.randn(7, shape[1]).bfloat16()
    expected = reference(x, nibbles, scales.bfloat16(), zeros.bfloat16())
    got = module(x).double()
    assert torch.allclose(got, expected, rtol=1 / 64, atol=1e-3 * expected.abs().max().item())
    # and it is the weight's product, to int8 activations' error
    exact = x.double() @ quant.dequantized(module).double().t()
    assert (got - exact).norm() / exact.norm() < 0.02


def test_a_row_gets_the_same_bits_whatever_shares_the_product():
    # 80 outputs: blocks of four and a lone one; 1..13 rows: the kernel's 4-, 2- and 1-row paths
    nibbles, scales, zeros = weight(80, 128, seed=1)
    product = quant.product(quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu")))
    x = torch.randn(13, 128).bfloat16()
    alone = torch.cat([product(x[i : i + 1]) for i in range(13)])
    for rows in range(1, 14):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows
    assert torch.equal(product(x[5:11]), alone[5:11])


def test_rows_past_one_pass_take_the_weights_a_piece_at_a_time_and_miss_no_block():
    """Past four rows the kernel walks the weights in L2-sized pieces (128 blocks of 16 outputs at 256 inputs),
    every row over each; up to four, a thread's share at once. 263 blocks: two whole pieces and a ragged one."""
    nibbles, scales, zeros = weight(16 * 263, 256, seed=2)
    module = quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu"))
    x = torch.randn(9, 256).bfloat16()
    alone = torch.cat([module(x[i : i + 1]) for i in range(9)])
    assert torch.equal(module(x), alone)
    expected = reference(x, nibbles, scales.bfloat16(), zeros.bfloat16())
    assert torch.allclose(module(x).double(), expected, rtol=1 / 64, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("shape", [(21, 8), (384, 1536), (1157, 384)])  # (tiles of 8, 6, 4 outputs and a lone one)
def test_bfloat16_products_are_float_sums_rounded_once_and_a_rows_bits_are_its_own(shape):
    """`mm16` (bfloat16 products where oneDNN has none): each output the float sum of its products, rounded to
    bfloat16 once; a row's bits the same alone, in every pass (1 to 6 rows: 13 = 6 + 4 + 3) and across L2 pieces
    (1157 outputs of 384: several pieces, a ragged tail)."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(14, in_features, generator=generator).bfloat16()
    got = native.int4().mm16(x, w)
    exact = x.double() @ w.double().t()
    assert (got.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max() + 1e-6 * exact.abs().max()
    assert (got == exact.bfloat16()).float().mean() > 0.99  # (float sums round otherwise only at a tie's edge)
    alone = torch.cat([native.int4().mm16(x[i : i + 1], w) for i in range(14)])
    for rows in range(1, 15):
        assert torch.equal(native.int4().mm16(x[:rows], w), alone[:rows]), rows
    assert torch.equal(native.int4().mm16(x[4:9], w), alone[4:9])


def test_bfloat16_projections_run_on_spec_products_where_onednn_has_no_bfloat16(monkeypatch):
    """Where oneDNN has no bfloat16 (an AVX2 CPU; played here on any), a bfloat16 projection laid out once runs
    on `mm16`, its bias added: a Linear's [out, in] weight and GPT-2's Conv1D ([in, out]) alike; the modules'
    weights become views of that one layout (held once), their own forwards unchanged."""
    from transformers.pytorch_utils import Conv1D

    from spec_cli.exec import packing

    monkeypatch.setattr(packing, "onednn_bfloat16", lambda: False)
    assert packing.available(torch.device("cpu"), torch.bfloat16)
    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 40).bfloat16()
    conv = Conv1D(24, 64).bfloat16()
    conv.bias.data.normal_()
    x = torch.randn(1, 5, 64).bfloat16()
    own = (linear(x), conv(x))
    call = packing.linear([linear, conv])
    assert call.native[3] == 16
    storage = call.native[0].untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == storage for m in (linear, conv))
    assert all(torch.equal(got, before) for got, before in zip((linear(x), conv(x)), own))
    got = call(x)
    assert got.shape == (1, 5, 64)
    w = torch.cat([linear.weight, conv.weight.t()]).double()
    b = torch.cat([linear.bias, conv.bias]).double()
    expected = x.double() @ w.t() + b
    assert (got.double() - expected).abs().max() < 0.02 * expected.abs().max()
    assert torch.equal(got[0, 2:3], call(x[:, 2:3])[0])
    torch._dynamo.reset()  # (and a compiled step traces it whole: called directly, dynamo breaks the graph there)
    assert torch.equal(torch.compile(call, backend="eager", fullgraph=True)(x), got)


def test_activations_round_half_to_even_on_rows_spread_over_threads():
    """Each row's activations become int8 by the reference's rule, ties to even: every value here is a tie but
    each group's largest (d = 1/8 in every group), integer weights and unit scales make the product exact, so its
    bits are the reference's; 40 rows of 2,048 inputs are spread over threads, and each row's bits are its own."""
    rows, inputs, outputs = 40, 2048, 48
    generator = torch.Generator().manual_seed(3)
    x = (2 * torch.randint(-126, 126, (rows, inputs), generator=generator) + 1).float() / 16
    sign = torch.randint(0, 2, (rows, inputs // 32), generator=generator).float() * 2 - 1
    x.view(rows, -1, 32)[:, :, 5] = 15.875 * sign  # 127 / 8: the group's largest
    x = x.bfloat16()
    nibbles = torch.randint(0, 256, (outputs, inputs // 2), dtype=torch.uint8, generator=generator)
    scales, zeros = torch.ones(outputs, inputs // 32), torch.zeros(outputs, inputs // 32)
    module = quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu"))
    got = module(x)
    assert torch.equal(got, reference(x, nibbles, scales, zeros).bfloat16())
    assert torch.equal(got, torch.cat([module(x[i : i + 1]) for i in range(rows)]))


def q8_0(out_features, in_features, seed=0):
    """A Q8_0 projection as the GGUF loader makes it ((w8, scales) and the module on spec's 8-bit kernel)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from spec_cli.models import gguf_blocks

    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = quantize(weight, GGMLQuantizationType.Q8_0)
    halves = quant.Quantized.int4(*gguf_blocks.q8_halves(raw, out_features, in_features), torch.device("cpu"))
    blocks = torch.from_numpy(raw.reshape(out_features, -1, 34).copy())
    scales = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]  # [out, groups]
    values = blocks[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
    return values, scales, halves


def test_q8_0_runs_as_one_8_bit_product_of_the_files_values():
    """llama.cpp's Q8_0 (loaded as two int4 halves) on the 8-bit kernel: the file's values and (bfloat16) scales,
    its integer arithmetic in float64, close to the halves' product, a row's bits whatever shares it."""
    values, scales, halves = q8_0(80, 256)  # 80 outputs: padded to 16s
    module = quant.q8(halves)
    assert (module.kind, module.layout, module.out_features, module.in_features) == ("int8", "vnni", 80, 256)
    assert torch.equal(quant.dequantized(module), values.float() * scales.bfloat16().float().repeat_interleave(32, 1))
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    xf = x.float().reshape(13, -1, 32)
    d = xf.abs().amax(-1) / 127
    xq = torch.round(xf * torch.where(d > 0, 1 / d, torch.zeros_like(d))[..., None]).double()
    sums = torch.einsum("rgj,ngj->rng", xq, values.double().reshape(80, -1, 32))
    expected = (sums * scales.bfloat16().double()[None] * d.double()[:, None]).sum(-1)
    got = quant.product(module)(x)
    assert torch.allclose(got.double(), expected, rtol=1 / 64, atol=1e-3 * expected.abs().max().item())
    doubled = quant.Doubled(halves)(x).float()
    assert (got.float() - doubled).norm() / doubled.norm() < 0.01
    alone = torch.cat([quant.product(module)(x[i : i + 1]) for i in range(13)])
    for rows in range(1, 14):
        assert torch.equal(quant.product(module)(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("zeros", (False, True), ids=("scales", "pairs"))
def test_8_bit_products_are_exact_for_every_byte_and_the_largest_activations(zeros):
    """Every 8-bit value (-128 too) times activations at +-127 (each group's largest, ties of sign): the kernel's
    integer sums whole, on AVX-512 (vpdpbusd) as on AVX2 (where a pair of products of 8-bit weights passes
    vpmaddubsw's 16-bit range, unless summed another way)."""
    generator = torch.Generator().manual_seed(9)
    values = torch.arange(-128, 128, dtype=torch.int16).repeat(32, 1)  # [32, 256], each row every byte
    values = values[:, torch.randperm(256, generator=generator)].to(torch.int8)
    values[:, :8] = torch.tensor([-128, -128, 127, 127, -128, 127, -128, 127], dtype=torch.int8)
    scales = torch.full((32, 8), 2.0 ** -10)
    module = quant.Quantized.int8_grouped(values, scales, torch.full_like(scales, 0.5) if zeros else
                                          torch.zeros_like(scales), torch.device("cpu"), group=32)
    signs = torch.randint(0, 2, (5, 256), generator=generator) * 2 - 1
    x = (signs * 8.0).bfloat16()  # every activation at its group's largest: quantized to +-127
    x[1, :8] = torch.tensor([8.0, 8.0, 8.0, 8.0, -8.0, -8.0, -8.0, -8.0])
    xq = (signs * 127).double()
    xq[1, :8] = torch.tensor([127.0, 127, 127, 127, -127, -127, -127, -127])
    expected = (xq @ values.double().t()) * 2.0 ** -10 * (8 / 127) + (0.5 * xq.sum(-1, keepdim=True) * 8 / 127
                                                                       if zeros else 0)
    got = quant.product(module)(x).double()
    assert torch.allclose(got, expected, rtol=1 / 128, atol=1e-6), (got - expected).abs().max()


def test_mxfp4_products_are_exact_for_every_value_and_the_largest_activations():
    """MXFP4 (gpt-oss's experts) on its own kernel (`mmfp4`: int4's nibbles through a table of its 4-bit floats):
    every index in every group, exponents from tiny to large, activations at +-127 (each group's largest): the
    kernel's integer sums whole (E2M1's bytes reach 24: AVX2's 16-bit pair sums widened sooner), its weights the
    file's exactly, a row's bits whatever shares the product, traced whole by a compiled step."""
    from spec_cli.models import gguf_blocks

    generator = torch.Generator().manual_seed(11)
    out, inputs = 40, 256  # (40 outputs: padded to 16s)
    index = torch.randint(0, 16, (out, inputs), generator=generator)
    index[:, :16] = torch.arange(16)  # (every value in every row)
    exponents = torch.randint(100, 140, (out, inputs // 32), generator=generator)
    exponents[0, 0], exponents[1, 0], exponents[2, 0] = 0, 1, 200  # (0 and 1: subnormal scales)
    exponents[3], exponents[4] = 0, 1  # (outputs of subnormal scales alone)
    qs = index.reshape(out, -1, 2, 16)
    raw = torch.cat([exponents[..., None], qs[:, :, 0] | (qs[:, :, 1] << 4)], -1).to(torch.uint8).numpy()
    nibbles, exponents = gguf_blocks.mxfp4(raw, out, inputs)
    module = quant.Quantized.fp4(nibbles, exponents, torch.device("cpu"))
    weights = quant.E2M1[index].double() * torch.pow(2.0, exponents.double() - 128).repeat_interleave(32, 1)
    assert (module.kind, module.layout) == ("fp4", "vnni")
    assert torch.equal(quant.dequantized(module).double(), weights)
    signs = torch.randint(0, 2, (13, inputs), generator=generator) * 2 - 1
    x = (signs * 8.0).bfloat16()
    expected = (signs * 127).double() @ weights.t() * (8 / 127)
    product = quant.product(module)
    got = product(x).double()
    assert torch.allclose(got, expected, rtol=1 / 128, atol=1e-30), (got - expected).abs().max()
    for row in (3, 4):
        assert torch.allclose(got[:, row], expected[:, row], rtol=1 / 64, atol=0) and expected[:, row].abs().min() > 0
    x = torch.randn(13, inputs, generator=generator).bfloat16()
    alone = torch.cat([product(x[i : i + 1]) for i in range(13)])
    for rows in range(1, 14):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows
    exact = x.double() @ weights.t()
    assert (product(x).double() - exact).norm() / exact.norm() < 0.02
    torch._dynamo.reset()
    assert torch.equal(torch.compile(product, backend="eager", fullgraph=True)(x), product(x))
    eight = module.as_int8(32)  # (beside projections of another format: one 8-bit product)
    assert torch.equal(quant.dequantized(eight).double(), weights)


def test_dequantized_agrees_across_layouts(monkeypatch):
    nibbles, scales, zeros = weight(32, 64, seed=2)
    ours = quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu"))
    monkeypatch.setenv("SPEC_NATIVE", "0")
    theirs = quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu"))
    assert (ours.layout, theirs.layout) == ("vnni", "torch")
    assert torch.allclose(quant.dequantized(ours), quant.dequantized(theirs), rtol=1e-2, atol=1e-2)
    x = torch.randn(3, 64).bfloat16()
    assert (ours(x).float() - theirs(x).float()).norm() / theirs(x).float().norm() < 0.02


def test_fused_projections_keep_their_outputs_apart():
    parts = [quant.Quantized.int4(*weight(n, 64, seed=n), torch.device("cpu")) for n in (32, 48)]
    x = torch.randn(2, 64).bfloat16()
    fused = quant.product(*parts)(x)
    assert torch.equal(fused, torch.cat([p(x) for p in parts], -1))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_compiled_step_traces_the_kernel_whole(bits):
    # (called directly, the kernel is a pybind function dynamo cannot trace: a compiled step fell back to eager)
    module = quant.Quantized.int4(*weight(32, 64, seed=3), torch.device("cpu")) if bits == 4 else \
        quant.q8(q8_0(32, 64, seed=3)[2])
    product = quant.product(module)
    x = torch.randn(3, 64).bfloat16()
    torch._dynamo.reset()
    traced = torch.compile(product, backend="eager", fullgraph=True)
    assert torch.equal(traced(x), product(x))


# the glue between a layer's products (glue.cpp): torch's own arithmetic, a row alone whatever shares the call

def ulps(a, b):
    """Largest distance in bfloat16 steps between two bfloat16 tensors of one sign pattern."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


@pytest.mark.parametrize("width", [576, 72])  # (72: a masked tail)
def test_rms_norm_is_torchs_to_a_step_and_a_row_alone(width):
    glue = native.int4()
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(13, width, generator=generator) * 3).bfloat16()
    weight = (torch.rand(width, generator=generator) + 0.5).bfloat16()
    expected = weight * torch.rms_norm(x.float(), (width,), None, 1e-5).to(torch.bfloat16)
    got = glue.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and ulps(got, expected) <= 1
    for rows in (1, 2, 5, 13):
        assert torch.equal(glue.rms_norm(x[:rows], weight, 1e-5), got[:rows]), rows
    assert not torch.equal(glue.rms_norm(x, weight, 1e-2), got)  # (eps is used)


@pytest.mark.parametrize("width", [1536, 40])
def test_silu_times_up_is_torchs_to_a_step_and_a_row_alone(width):
    glue = native.int4()
    gate_up = (torch.randn(1, 9, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).bfloat16()
    gate, up = gate_up.split(width, -1)
    expected = torch.nn.functional.silu(gate) * up
    got = glue.silu_mul(gate_up)
    assert got.shape == (1, 9, width) and ulps(got, expected) <= 1
    assert torch.equal(glue.silu_mul(gate_up[:, :1]), got[:, :1])


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 24)])
def test_rope_has_torchs_bits_and_splits_q_k_and_v(heads, kv_heads, d):
    from spec_cli.exec.backends import rotate_half

    glue = native.int4()
    generator = torch.Generator().manual_seed(d)
    n = 5
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * d, generator=generator).bfloat16()
    cos, sin = (torch.randn(1, n, d, generator=generator).bfloat16() for _ in range(2))
    qk = qkv[..., : (heads + kv_heads) * d].view(1, n, heads + kv_heads, d).transpose(1, 2)
    qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]  # the lean loop's torch arithmetic
    q, k = qk.split((heads, kv_heads), dim=1)
    v = qkv[..., (heads + kv_heads) * d:].view(1, n, kv_heads, d).transpose(1, 2)
    got = glue.rope(qkv, cos[0], sin[0], heads, kv_heads)
    for mine, theirs in zip(got, (q, k, v)):
        assert mine.is_contiguous() and torch.equal(mine, theirs)


def test_a_quantized_llama_runs_the_glue_and_chains_and_trees_have_the_bits_of_one_token_steps(tiny_dir):
    """A bfloat16 Llama quantized to int4 on this kernel runs its norms, rotary positions, MLP activation and
    attention as the glue (each a single call), close to torch's operations, and a verified chain or tree of
    rows gives each row the bits of its one-token step (so its trees branch: `exact_trees`)."""
    from transformers import AutoModelForCausalLM

    from spec_cli.exec import Runner, backends

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "llama-oracle", dtype=torch.bfloat16)
    assert quant.quantize_model(model, "int4") > 0
    runner = Runner(model, capacity=64)
    assert runner.lean.glue is not None
    prompt, chain = [3, 14, 15, 9, 2, 6], [5, 3, 5, 8]
    runner.forward(prompt, commit=len(prompt))
    together = runner.forward(chain).logits
    runner.keep([])
    alone = []
    for i in range(len(chain)):
        alone.append(runner.forward(chain[i : i + 1], commit=1).logits[0])
    assert torch.equal(together, torch.stack(alone))

    assert runner.exact_trees
    long_prompt = [(7 * i + 3) % 250 + 1 for i in range(90)]  # (past the torch kernel's chunk of keys)

    def steps(path):
        fresh = Runner(model, capacity=128)
        fresh.forward(long_prompt, commit=len(long_prompt))
        return [fresh.forward([token], commit=1).logits[0] for token in path]

    tree = Runner(model, capacity=128)
    tree.forward(long_prompt, commit=len(long_prompt))
    first = len(long_prompt)
    # two branches, three deep, siblings side by side: each deeper row has a cousin between it and its parent
    tokens = [5, 7, 3, 9, 4, 8, 6, 2]
    parents = [-1, -1, first, first + 1, first + 2, first + 3, first + 4, first + 5]
    rows = tree.forward(tokens, parents=parents).logits
    for path_rows in ((0, 2, 4, 6), (1, 3, 5, 7)):
        expected = steps([tokens[i] for i in path_rows])
        assert all(torch.equal(rows[i], e) for i, e in zip(path_rows, expected)), path_rows
    without = Runner(model, capacity=64)
    without.lean = backends.Llama(model)  # torch's operations
    without.forward(prompt, commit=len(prompt))
    torch_logits = without.forward(chain).logits
    assert (torch_logits - together).abs().max() <= 0.05 * torch_logits.abs().max()


@pytest.fixture(params=["dots", "float sums"])
def attention_sums(request):
    """spec's bfloat16 attention both ways: by AVX-512 BF16 dot products (where the CPU has them) and in float."""
    glue = native.int4()
    if request.param == "dots" and not glue.attention_dots(-1):
        pytest.skip("this CPU has no AVX-512 BF16")
    before = glue.attention_dots(int(request.param == "dots"))
    yield request.param
    glue.attention_dots(int(before))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 24, 80, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(16, 4), (14, 2)])
def test_attention_gives_a_row_the_bits_of_its_attended_keys_alone(d, dtype, heads, kv_heads, attention_sums):
    """spec's attention (glue.cpp): close to SDPA; a row's bits depend only on its query and the keys it attends
    to, in slot order: not on other rows, nor on unattended keys between them (a tree's cousins), nor on where
    the keys lie in the cache (a one-token step has them side by side), nor on how many slots the forward
    attends. In float32 too (a quantized model's: its bfloat16 products would grow a regrouped sum's rounding);
    in bfloat16 by its dot products and by float sums, 4 and 7 heads a kv head (7: more than a call holds)."""
    if dtype == torch.float32 and attention_sums == "dots":
        pytest.skip("float32 sums in float alone")
    glue = native.int4()
    generator = torch.Generator().manual_seed(d)
    rows, span = 24, 300  # (enough outputs that an order of sums shows in bfloat16)
    q = torch.randn(1, heads, rows, d, generator=generator).to(dtype)
    cache = torch.randn(2, 1, kv_heads, 320, d, generator=generator).to(dtype)  # keys, values; 320 slots
    keys, values = cache[0][:, :, :span], cache[1][:, :, :span]
    allowed = torch.rand(rows, span, generator=generator) > 0.4
    mask = torch.where(allowed, 0.0, float("-inf")).to(dtype)
    scale = d**-0.5
    got = glue.attend(q, keys, values, mask, scale)
    assert got.dtype == dtype
    longer = torch.cat([mask, mask.new_full((rows, 20), float("-inf"))], dim=1)  # 20 more slots, none attended
    assert torch.equal(glue.attend(q, cache[0], cache[1], longer, scale), got)
    group = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1),
        attn_mask=mask.float(), scale=scale).transpose(1, 2).reshape(1, rows, heads * d)
    assert got.shape == (1, rows, heads * d)
    assert (got.float() - expected).abs().max() < (0.02 if dtype == torch.bfloat16 else 1e-5) * expected.abs().max()
    for r in range(rows):
        alone = glue.attend(q[:, :, r : r + 1], keys, values, mask[r : r + 1], scale)
        assert torch.equal(alone[0, 0], got[0, r]), r
        kept = allowed[r].nonzero()[:, 0]  # the same keys side by side, nothing masked
        packed = glue.attend(q[:, :, r : r + 1], keys[:, :, kept].contiguous(), values[:, :, kept].contiguous(),
                             None, scale)
        assert torch.equal(packed[0, 0], got[0, r]), r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [128, 256])  # (Gemma 2 27B's heads, 2B's and 9B's)
def test_softcapped_attention_is_gemma_2s_and_gives_a_row_the_bits_of_its_attended_keys_alone(d, dtype,
                                                                                             attention_sums):
    """Gemma 2's softcap (each score as cap x tanh(score / cap) before the softmax): close to its formula in
    float, and a row's bits its own as without it (alone, among other rows, with more slots unattended)."""
    if dtype == torch.float32 and attention_sums == "dots":
        pytest.skip("float32 sums in float alone")
    glue = native.int4()
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, rows, span, cap = 8, 4, 12, 200, 5.0  # (Gemma 2 2B's heads; 50 its cap, scores here
    q = torch.randn(1, heads, rows, d, generator=generator).to(dtype) * 3  # smaller: the cap bites)
    keys, values = (torch.randn(1, kv_heads, span, d, generator=generator).to(dtype) for _ in range(2))
    allowed = torch.rand(rows, span, generator=generator) > 0.3
    mask = torch.where(allowed, 0.0, float("-inf")).to(dtype)
    got = glue.attend(q, keys, values, mask, d**-0.5, None, cap)
    scores = q.float() @ keys.float().repeat_interleave(2, 1).transpose(-1, -2) * d**-0.5
    weights = torch.softmax(torch.tanh(scores / cap) * cap + mask.float(), -1)
    expected = (weights @ values.float().repeat_interleave(2, 1)).transpose(1, 2).reshape(1, rows, heads * d)
    plain = glue.attend(q, keys, values, mask, d**-0.5)
    error = (got.float() - expected).abs().max()
    assert error < (0.02 if dtype == torch.bfloat16 else 1e-5) * expected.abs().max()
    assert error < 0.1 * (plain.float() - expected).abs().max()  # (the cap changes the result, and it is applied)
    longer = torch.cat([mask, mask.new_full((rows, 20), float("-inf"))], dim=1)
    wider = [torch.cat([t, torch.randn(1, kv_heads, 20, d, generator=generator).to(dtype)], 2) for t in (keys, values)]
    assert torch.equal(glue.attend(q, *wider, longer, d**-0.5, None, cap), got)
    for r in range(rows):
        assert torch.equal(glue.attend(q[:, :, r : r + 1], keys, values, mask[r : r + 1], d**-0.5, None, cap)[0, 0],
                           got[0, r]), r


def test_bfloat16_attention_by_dot_products_is_nearly_as_close_as_float_sums():
    """The dot products round the softmax's weights to bfloat16 (as FlashAttention does on a GPU): a result
    other than the float sums', within a few tenths of what rounding the exact one to bfloat16 misses."""
    glue = native.int4()
    if not glue.attention_dots(-1):
        pytest.skip("this CPU has no AVX-512 BF16")
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, rows, span, d = 12, 2, 8, 400, 128  # (Qwen2.5-1.5B's heads)
    q = torch.randn(1, heads, rows, d, generator=generator).bfloat16() * 2
    keys, values = (torch.randn(1, kv_heads, span, d, generator=generator).bfloat16() for _ in range(2))
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float().repeat_interleave(6, 1), values.float().repeat_interleave(6, 1),
        scale=d**-0.5).transpose(1, 2).reshape(1, rows, heads * d)
    dots, sums = on_and_off(glue.attention_dots, q, keys, values, None, d**-0.5)
    assert not torch.equal(dots, sums)

    def rms(x):
        return (x.float() - exact).pow(2).mean().sqrt().item()

    assert rms(sums) <= 1.01 * rms(exact.bfloat16())
    assert rms(exact.bfloat16()) < rms(dots) <= 1.25 * rms(exact.bfloat16())


def on_and_off(switch, *attend):
    """`glue.attend(*attend)` with a kernel's `switch` on, then off (left on after)."""
    glue = native.int4()
    try:
        on = glue.attend(*attend)
        switch(0)
        off = glue.attend(*attend)
    finally:
        switch(1)
    return on, off


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(6, 6), (16, 4), (14, 2), (12, 2)])
def test_attention_in_avx2_registers_has_the_emulated_kernels_bits(d, heads, kv_heads):
    """On AVX2, bfloat16 heads of 64 and 128 take their own kernel (keys and values widened by unpacking, the
    scores' fold and the outputs' order undone to match): every output the bits of the general kernel, which the
    test above holds to torch's and to each row alone. Groups of 1, 4, 7 and 6 heads (two at a time, and one)."""
    glue = native.int4()
    if not glue.attention_avx2(-1):
        pytest.skip("spec's kernels are not the AVX2 build here")
    generator = torch.Generator().manual_seed(heads * d)
    rows, span = 9, 333
    q = torch.randn(1, heads, rows, d, generator=generator).bfloat16()
    keys, values = (torch.randn(1, kv_heads, span, d, generator=generator).bfloat16() for _ in range(2))
    mask = torch.where(torch.rand(rows, span, generator=generator) > 0.3, 0.0, float("-inf")).bfloat16()
    own, emulated = on_and_off(glue.attention_avx2, q, keys, values, mask, d**-0.5)
    assert torch.equal(own, emulated)


def test_gpt2s_activation_in_one_pass_has_torchs_bits():
    """GPT-2's activation in one pass on AVX2 (`gelu_new`, what gpt2_layer runs there): the bits of transformers'
    NewGELUActivation as torch's eight bfloat16 operations give them, for every finite bfloat16 value and for
    rows of every count (one pass over them, in pieces over the threads)."""
    glue = native.int4()
    if not glue.fused_gelu(-1):
        pytest.skip("spec's kernels are not the AVX2 build here")

    def operations(x):
        inner = torch.mul(torch.add(x, torch.mul(torch.pow(x, 3.0), 0.044715)), math.sqrt(2.0 / math.pi))
        return torch.mul(torch.mul(x, 0.5), torch.add(torch.tanh(inner), 1.0))

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())].reshape(1, 1, -1)
    assert torch.equal(glue.gelu_new(every), operations(every))
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 7, 16, 33, 48):
        x = (torch.randn(1, rows, 1536, generator=generator) * 3).bfloat16()
        assert torch.equal(glue.gelu_new(x), operations(x)), rows


def fused_against_parts(model):
    """A runner's forwards with every layer as one call (and all of them as one call, where one mask serves every
    layer) against
    the part-by-part loop: a prompt, a chain, a tree, a kept branch moved in the cache, a self-draft's skipped
    sublayers, and the steps after them; every row's logits the same bits."""
    from spec_cli.core.families import Skip
    from spec_cli.exec import Runner

    stacked = []  # forwards the whole stack of layers ran as one call

    class Counted:
        def __init__(self, stack):
            self.stack = stack

        def run(self, *args):
            stacked.append(1)
            return self.stack.run(*args)

    def run(fused: str):
        runner = Runner(model, capacity=128)
        assert all(f is not None for f in runner.lean.fused)
        if runner.lean.stack is not None:
            runner.lean.stack = Counted(runner.lean.stack)
        if fused != "forward":  # each layer one call
            runner.lean.stack = None
        if fused == "parts":
            runner.lean.fused = None
        prompt = [(5 * i + 2) % 250 + 1 for i in range(40)]
        out = [runner.forward(prompt, commit=len(prompt)).logits]
        out.append(runner.forward([5, 3, 5, 8]).logits)  # a chain
        runner.keep([])
        first = runner.committed
        tokens, parents = [5, 7, 3, 9, 4, 8], [-1, -1, first, first + 1, first + 2, first + 3]
        out.append(runner.forward(tokens, parents=parents).logits)  # a tree, branches side by side
        runner.keep([first + 1, first + 3, first + 5])  # the second branch: moved to the prefix's end
        out.append(runner.forward([11, 12], skip=Skip.of((1,), (0, 2))).logits)  # a self-draft's forward
        runner.keep([])
        out.append(runner.forward([13], commit=1).logits)
        out.append(runner.forward([14, 15, 16], commit=3).logits)
        return out

    apart = run("parts")
    for fused in ("forward", "layers"):
        for together, alone in zip(run(fused), apart, strict=True):
            assert torch.equal(together, alone), fused
    return len(stacked)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K_M"])
def test_a_layer_runs_as_one_call_with_the_bits_of_its_parts(tmp_path, kind):
    """native/layer.cpp: each layer of a Llama GGUF on spec's kernels (4-bit or 8-bit; Q4_K_M's mix: Q4_K with
    v and down in Q6_K, so q and k one product and v another) runs as one call (and all of them as one call a
    forward), with the bits of the part-by-part loop."""
    from tiny import make_gguf, make_model, make_tokenizer

    from spec_cli.core.settings import ModelRef
    from spec_cli.exec import Runner
    from spec_cli.models.loading import load

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    make_model(tmp_path / "llama", "llama", len(tokenizer), layers=3, width=256, seed=4, init=0.1,
               tokenizer=tokenizer)
    mix = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"} if kind == "Q4_K_M" else None
    path = make_gguf(tmp_path / "llama", tmp_path / f"llama-{kind}.gguf", kind.removesuffix("_M"), kinds=mix)
    model = load(ModelRef(str(path)), torch.device("cpu"), torch.bfloat16, untested=True).model
    if mix:
        assert [p[3] for p in Runner(model, capacity=8).lean.layers[0].qkv.parts] == [4, 6]
    assert fused_against_parts(model) == 6  # every forward of the "forward" run: the stack, not a call a layer


def test_a_qwen2_layer_adds_its_biases_in_one_call(tmp_path):
    """Qwen2's q, k and v biases are added in the layer's one call as torch adds them; its sliding windows (layer
    0 attends in full, the others slide) give each layer its window's mask, in the whole forward's one call too."""
    from archs import make
    from transformers import AutoModelForCausalLM

    make(tmp_path / "qwen2", "qwen2", 300)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    assert quant.quantize_model(model, "int4") > 0
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert fused_against_parts(model) == 6


def test_a_qwen3_layer_norms_its_q_and_k_heads_in_one_call(tmp_path):
    """Qwen3's q_norm and k_norm run inside the layer's one call (and the whole stack's), with the bits of the
    part-by-part loop; and that loop's head norms stay close to Hugging Face's own forward."""
    from archs import make
    from transformers import AutoModelForCausalLM

    from spec_cli.exec import Runner

    make(tmp_path / "qwen3", "qwen3", 300)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3", dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:  # norms far from ones, so a head norm left out or misplaced shows
            layer.self_attn.q_norm.weight.normal_(1, 0.5)
            layer.self_attn.k_norm.weight.normal_(0, 2)
    assert quant.quantize_model(model, "int4") > 0
    runner = Runner(model, capacity=64)
    assert runner.lean.fused[0][0][14] is model.model.layers[0].self_attn.q_norm.weight
    prompt = [(7 * i + 3) % 250 + 1 for i in range(20)]
    ours = runner.forward(prompt, commit=len(prompt)).logits.float()
    theirs = model(torch.tensor([prompt])).logits[0].float()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.8
    assert (ours - theirs).abs().max() < 0.2 * theirs.abs().max()
    assert fused_against_parts(model) == 6


@pytest.mark.parametrize("dtype,quantize", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, "int4")])
@pytest.mark.parametrize("layers,width", [(3, 64), (1, 384)])
def test_a_gpt2_block_runs_as_one_call_with_the_bits_of_its_parts(tmp_path, layers, width, dtype, quantize):
    """native/layer.cpp's gpt2_layer: a GPT-2 block as one call, with the bits of the part-by-part loop: layer
    norms, GELU and residuals as torch runs them, products packed for oneDNN (every bfloat16 one, float32 ones of
    384 wide), the model's own Conv1Ds (float32 ones of 64 wide) or spec's int4 ones (a draft's weights on a
    CPU), spec's attention in bfloat16 and torch's flash kernel in float32; and a prompt longer than the 32
    rows a packed product takes at once."""
    from tiny import make_model, make_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    make_model(tmp_path / "gpt2", "gpt2", len(tokenizer), layers=layers, width=width, seed=3, init=0.2,
               tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.normal_(0, 0.5)  # biases and norms far from their defaults, so one left out shows
    if quantize:
        from spec_cli.exec import quant

        assert quant.quantize_model(model, quantize) == 4 * layers + 1  # (its 4 products a block, and the head)
    assert fused_against_parts(model) == 0  # (a call a block: no whole-forward stack for GPT-2)


@pytest.mark.parametrize("width", [8192, 49152, 100, 7])
def test_argmax_is_torchs_on_ties_nans_and_any_shape(width):
    kernels = native.int4()
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(11, width, generator=generator)
    x[1] = torch.randint(0, 3, (width,), generator=generator).float()  # ties: the first maximum
    x[2, width // 2] = x[2, width - 1] = float("nan")  # a NaN above everything: the first NaN
    x[3] = float("-inf")
    x[4, -1] = 1e30  # the last lane of a tail
    x[5] = -1e-30
    expected = x.max(-1).indices
    assert torch.equal(kernels.argmax_rows(x), expected)
    assert torch.equal(kernels.argmax_rows(x.view(1, 11, width)), expected.view(1, 11))
    assert int(kernels.argmax_rows(x[4])) == int(expected[4])  # one row: a 0-dim index, as torch's
    assert torch.equal(kernels.argmax_rows(x[:, ::2].contiguous()), x[:, ::2].max(-1).indices)


@pytest.mark.parametrize("width", [8192, 49152, 21])
def test_top_probs_are_torchs_topk_of_softmax(width):
    kernels = native.int4()
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=generator) * 4
    x[2, 5:] = float("-inf")  # fewer values than asked for: probability 0 after them
    for k in (1, 4, 7):
        got = kernels.top_probs(x, k)
        probs, tokens = torch.topk(x.softmax(-1), k)
        real = probs > 0
        assert got.shape == (9, 2 * k)
        assert torch.equal(got[:, k:].long()[real], tokens[real])
        assert torch.allclose(got[:, :k], probs, rtol=1e-5, atol=0)
        assert torch.all(got[:, :k][~real] == 0)
    assert torch.allclose(kernels.top_probs(x[:, :3].contiguous(), 5)[:, :3], x[:, :3].softmax(-1).sort(-1, True)[0])
    ties = torch.zeros(1, width)
    assert kernels.top_probs(ties, 3)[0, 3:].tolist() == [0.0, 1.0, 2.0]  # of equal logits, the lower token first


def test_sampling_and_greedy_trees_read_logits_by_the_kernel(monkeypatch):
    from spec_cli.decoding import sampling
    from spec_cli.decoding import staged as tree

    kernels = native.int4()
    calls = []
    spy = type("Spy", (), {"argmax_rows": lambda self, x: calls.append("argmax") or kernels.argmax_rows(x),
                           "top_probs": lambda self, x, k: calls.append("top") or kernels.top_probs(x, k)})()
    monkeypatch.setattr(native, "loaded", lambda: spy)
    logits = torch.randn(6, 8192, generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(sampling.argmax(logits), logits.argmax(-1))
    assert torch.equal(sampling.argmax(logits[0], keepdim=True), logits[0].argmax(-1, keepdim=True))
    assert torch.equal(sampling.argmax(logits.bfloat16()), logits.bfloat16().argmax(-1))  # (not float32: torch's)
    assert calls == ["argmax", "argmax"]
    greedy = sampling.Sampler()
    q, rows = tree._summaries(logits, greedy, 4, "greedy", None, sampling.Draws.seeded(0))
    assert q is None and calls[-1] == "top"
    hot = sampling.Sampler(temperature=1.0)
    q_one_hot, _ = tree._summaries(logits, hot, 4, "one-hot", None, sampling.Draws.seeded(0))
    assert q_one_hot is not None and len(calls) == 3  # a sampled tree keeps q: torch's
    monkeypatch.setattr(native, "loaded", lambda: None)
    q_torch, expected = tree._summaries(logits, greedy, 4, "greedy", None, sampling.Draws.seeded(0))
    assert q_torch is not None
    assert [r.tokens for r in rows] == [r.tokens for r in expected]
    assert all(torch.allclose(torch.tensor(a.top), torch.tensor(b.top), rtol=1e-5) for a, b in zip(rows, expected))


@pytest.mark.parametrize("width", [7, 16, 1000, 50_257])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.6, 0.5)])
def test_coupled_top_k_is_the_torch_way_row_by_row(width, temperature, top_p):
    """The kernel's coupled scores keep the words torch's top-k and top-p keep (ties at the k-th included), add the
    same noise (the same integers, the C library's log: within a float32 step of torch's), and are each row's own."""
    from spec_cli.decoding.coupling import Noise, gumbel
    from spec_cli.decoding.sampling import Sampler, make_generator

    kernels = native.int4()
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(9, width, generator=generator) * 4).round(decimals=1)  # (many ties)
    x[2, : min(width, 30)] = x[2].max()  # a tie at the top wider than k
    positions = torch.arange(9) * 3 + 40
    for k in (1, 5, 50):
        if k >= width:
            continue
        sampler = Sampler(temperature=temperature, top_k=k, top_p=top_p, coupled=True)
        noise = Noise(sampler, make_generator(4), width, "cpu", 0)
        noise.kernels = None  # (torch's way throughout)
        expected = noise.scores(x, positions)
        got = kernels.coupled_top_k(x, positions + 1, temperature, k, top_p, noise.key, width)
        assert torch.equal(got == float("-inf"), expected == float("-inf")), k
        kept = got > float("-inf")
        assert torch.allclose(got[kept], expected[kept], rtol=0, atol=1e-5), k
        alone = torch.cat([kernels.coupled_top_k(x[i:i + 1], positions[i:i + 1] + 1, temperature, k, top_p, noise.key,
                                                 width) for i in range(9)])
        assert torch.equal(alone, got)
    counters = torch.arange(100_000) * 7919 - 3
    assert torch.allclose(kernels.coupled_noise(counters, 5), gumbel(5, counters), rtol=0, atol=5e-6)


@pytest.mark.parametrize("width", [7, 16, 1000, 50_257])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.9), (0.6, 0.5), (1.3, 0.99)])
def test_coupled_nucleus_keeps_what_torch_s_top_p_keeps_row_by_row(width, temperature, top_p):
    """Top-p alone by the kernel (the nucleus among the most probable words, widening where they fall short):
    the words torch's top-p keeps (ties with the last kept too), the same scores for them, each row its own."""
    from spec_cli.decoding.coupling import Noise
    from spec_cli.decoding.sampling import Sampler, make_generator

    kernels = native.int4()
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(9, width, generator=generator) * 4).round(decimals=1)  # (many ties)
    x[2, : min(width, 30)] = x[2].max()  # a tie at the top
    x[5] = torch.linspace(0, 1, width)  # flat: the nucleus wider than the first words looked among
    x[6, width // 2:] = float("-inf")  # (a draft's part of the vocabulary)
    positions = torch.arange(9) * 3 + 40
    sampler = Sampler(temperature=temperature, top_p=top_p, coupled=True)
    noise = Noise(sampler, make_generator(4), width, "cpu", 0)
    noise.kernels = None  # (torch's way throughout)
    expected = noise.scores(x, positions)
    got = kernels.coupled_nucleus(x, positions + 1, temperature, top_p, noise.key, width)
    assert torch.equal(got == float("-inf"), expected == float("-inf"))
    kept = got > float("-inf")
    assert torch.allclose(got[kept], expected[kept], rtol=0, atol=1e-5)
    alone = torch.cat([kernels.coupled_nucleus(x[i:i + 1], positions[i:i + 1] + 1, temperature, top_p, noise.key,
                                               width) for i in range(9)])
    assert torch.equal(alone, got)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_coupled_scores_by_temperature_alone_keep_every_word_that_can_win(temperature):
    """By temperature alone the kernel scores only the words within the noise's range of the largest (the rest
    -inf): at every position the draw is the word every word's scores give, and the words kept score the same
    bits; a peaked row keeps a few words of 151,936, a flat one all of them."""
    from spec_cli.decoding.coupling import Noise
    from spec_cli.decoding.sampling import Sampler, make_generator

    kernels = native.int4()
    vocab, rows = 151_936, 48
    generator = torch.Generator().manual_seed(int(temperature * 10))
    x = torch.randn(rows, vocab, generator=generator) * 2 - 10
    x[:, 5] = 30.0  # peaked rows, a word far above the rest (a language model's usual row)
    x[1::4, 5:40] = 30.0  # ties at the top
    x[2::4] = torch.randn(vocab, generator=generator) * 0.5  # flat rows: every word can win
    x[3::4, :100] = 25 + torch.rand(12, 100, generator=generator)  # a hundred near the top, the rest far below
    x[3::4, 5] = 30.0
    positions = torch.arange(rows) + 1000
    sampler = Sampler(temperature=temperature, coupled=True)
    noise = Noise(sampler, make_generator(8), vocab, "cpu", 0)
    noise.kernels = kernels
    got = noise.scores(x, positions)
    whole = x / temperature + noise.every_word(positions + 1)  # every word's score, the kernel's noise
    kept = got > float("-inf")
    assert torch.equal(got[kept], whole[kept])
    assert torch.equal(got.argmax(-1), whole.argmax(-1))
    counts = kept.sum(-1)
    assert int(counts[0::4].max()) < 2000 and bool((counts[2::4] == vocab).all())
    assert bool((counts[3::4] >= 100).all()) and int(counts[3::4].max()) < 1000
    for row in range(rows):  # each row its own
        assert torch.equal(noise.scores(x[row:row + 1], positions[row:row + 1])[0], got[row])


def test_a_completion_s_noise_is_computed_one_way_throughout():
    """With the kernels, a completion's every score (top-k by the kernel, the kept words' noise, every word's) is
    the kernel's noise: the same bits whichever way a call takes."""
    from spec_cli.decoding.coupling import Noise
    from spec_cli.decoding.sampling import Sampler, make_generator

    x = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 3
    positions = torch.tensor([10, 10, 11, 12, 12, 13])
    for settings in (dict(temperature=1.0, top_k=40), dict(temperature=0.8, top_k=40, top_p=0.9),
                     dict(temperature=0.8, top_p=0.9)):
        noise = Noise(Sampler(**settings, coupled=True), make_generator(2), 3000, "cpu", 0)
        noise.kernels = native.int4()
        scores = noise.scores(x, positions)
        kept = scores > float("-inf")  # (top-p by the kernel may cut a near-tie otherwise than torch's float sums)
        whole = noise.sampler.warped(x) + noise.every_word(positions + 1)
        assert torch.equal(scores[kept], (x / settings["temperature"] + noise.every_word(positions + 1))[kept])
        if "top_p" not in settings:
            assert torch.equal(scores, whole)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.9, top_p=0.8)])
def test_every_method_samples_baseline_s_text_through_the_kernels(tiny_dir, monkeypatch, settings):
    """With the kernels loaded, coupled sampling without top-k (temperature alone, top-p alone) takes their one
    call a forward, and every method still samples the oracle alone's text."""
    from conftest import load_pair
    from helpers import prompts

    from spec_cli.core.events import Token
    from spec_cli.core.settings import Decoding
    from spec_cli.decoding.chain import Models
    from spec_cli.decoding.methods import decode
    from spec_cli.exec import Runner

    kernels = native.int4()
    calls = []
    real = kernels.coupled_nucleus
    monkeypatch.setattr(kernels, "coupled_nucleus", lambda *a: calls.append(1) or real(*a))
    oracle, draft = load_pair(tiny_dir, "llama")
    models = Models(Runner(oracle), Runner(draft))
    for seed, prompt in enumerate(prompts(3, seed=5)):
        texts = {}
        for method in ("baseline", "speculative", "staged"):
            events = decode(models, prompt, Decoding(method=method, max_new_tokens=24, seed=seed, **settings))
            texts[method] = [e.token for e in events if isinstance(e, Token) and e.output]
        assert texts["speculative"] == texts["baseline"] == texts["staged"], seed
    assert len(calls) > 30


def test_a_kernel_runs_without_the_gil():
    """A product computes with the GIL released (a server's event loop and slot threads go on while a forward
    computes): a thread woken just before a long product runs while it computes, not as it returns."""
    import threading
    import time

    rows, inputs, outputs = 1024, 4096, 8192
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
    values = torch.randint(0, 256, (outputs * inputs // 2,), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(inputs // 32, outputs, 2, generator=gen) * 0.01).to(torch.bfloat16)
    ran, go = [], threading.Event()
    other = threading.Thread(target=lambda: (go.wait(), ran.append(time.perf_counter())))
    other.start()
    started = time.perf_counter()
    go.set()  # (the other thread wakes needing the GIL, which this one holds until the product lets it go)
    native.int4().mm(x, values, scales)
    ended = time.perf_counter()
    other.join()
    if ended - started < 0.005:
        pytest.skip("the product was too quick here to tell")
    assert ran[0] - started < (ended - started) / 2  # (with the GIL held: as the product returns)
