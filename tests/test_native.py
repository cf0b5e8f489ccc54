"""spec's own CPU int4 kernel (spec_cli/exec/native): its layout, its arithmetic, and a row's bits whatever shares
the product."""

import pytest
import torch

from spec_cli.exec import native, quant

pytestmark = pytest.mark.skipif(native.int4() is None, reason=f"spec's int4 kernel: {native.status()}")


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


def test_a_compiled_step_traces_the_kernel_whole():
    # (called directly, the kernel is a pybind function dynamo cannot trace: a compiled step fell back to eager)
    product = quant.product(quant.Quantized.int4(*weight(32, 64, seed=3), torch.device("cpu")))
    x = torch.randn(3, 64).bfloat16()
    torch._dynamo.reset()
    traced = torch.compile(product, backend="eager", fullgraph=True)
    assert torch.equal(traced(x), product(x))
