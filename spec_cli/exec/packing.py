"""Linear layers with their weights laid out once for oneDNN, on a CPU.

PyTorch's CPU matmul lays a weight out afresh on every call, so on a CPU a forward of a few tokens cost
far more than one token's and speculation rarely paid. With each weight packed once, a few tokens cost
about what one does, and one costs less than before: the forward cost curve of a GPU. The price is a second
copy of each packed weight (the model keeps its own for its own forward and for tied embeddings), so packing
stops where the copies would take more than half the memory that was available.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

DTYPES = (torch.float32, torch.bfloat16)
SMALLEST = 1 << 17  # weights a float32 product must hold to pay: oneDNN's call costs several times MKL's,
                    # so pyfam's draft packs its head and MLP, its oracle everything. In bfloat16 every
                    # product is packed: MKL's gives a row other bits when more rows share it, oneDNN's does not
ROWS = 32  # in bfloat16 a product of more rows can give a row other bits (pyfam's 1536-wide MLP output, 33 rows
          # and up, a few rows in a hundred), of 2 to 32 never: longer inputs run in pieces of 32; and on a Zen 4
          # (no AMX) one row alone runs another kernel that rounds a few rows in a hundred otherwise (the same
          # 1536-wide output), as on an Ice Lake: one row runs as two, a last piece of one (33 rows) too
PACKABLE = ("Linear", "Conv1D")  # torch's Linear ([out, in]) and GPT-2's Conv1D ([in, out])


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `dtype`'s products are laid out once on this device: by oneDNN, in bfloat16 only where the CPU has
    what its bfloat16 path needs (AVX-512 BW, VL and DQ, or AVX-NE-CONVERT; an AVX2 CPU raises on the first packed
    weight); else in bfloat16 for spec's own kernel (`own_bfloat16`)."""
    if device.type != "cpu" or dtype not in DTYPES:
        return False
    if dtype == torch.bfloat16 and not onednn_bfloat16():
        return own_bfloat16() is not None
    return torch.backends.mkldnn.is_available()


def onednn_bfloat16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def own_bfloat16():
    """spec's native module where it runs bfloat16 products instead of oneDNN (`native/bf16.cpp`'s mm16: a CPU
    without AVX-512, where torch's bfloat16 product reads the weights again for every row), else None."""
    from spec_cli.exec import native

    return None if onednn_bfloat16() else native.int4()


def on_gpu(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether `modules` are several Linears of one input on a GPU, read as one product (`side_by_side`)."""
    return len(modules) > 1 and all(type(m).__name__ == "Linear" and isinstance(m.weight, torch.Tensor)
                                    and m.weight.device.type == "cuda" for m in modules)


def memory_available() -> int | None:
    """Bytes of memory the system could still give (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def chooser(device: torch.device, dtype: torch.dtype, pack: bool | None) -> Callable[[Sequence[torch.nn.Module]], bool]:
    """Which projections to pack (read together, as one product): `pack` True every one that can be, False
    none, None (automatic) on a CPU those large enough to pay (in bfloat16 all), in the order asked, while their
    copies leave half the memory that was available free (a model too large for a whole copy gets its first
    layers packed)."""
    if pack is not False and device.type == "cuda":  # (a GPU's kernels need no layout: fused, not packed)
        return on_gpu
    if pack is False or not available(device, dtype):  # (asked or not: what cannot run here is not packed)
        return lambda modules: False
    if pack:
        return lambda modules: all(packable(m) for m in modules)
    free = memory_available()
    left = math.inf if free is None else free / 2

    def choose(modules) -> bool:
        nonlocal left
        if not all(packable(m) for m in modules):
            return False
        if dtype == torch.float32 and sum(m.weight.numel() for m in modules) < SMALLEST:
            return False
        size = sum(m.weight.numel() * m.weight.element_size() for m in modules)
        if size > left:
            return False
        left -= size
        return True

    return choose


def packable(module) -> bool:
    """Whether `module` is a plain projection whose weight oneDNN can take (the caller checks for hooks)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in PACKABLE and isinstance(weight, torch.Tensor)
            and weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2)


def _layout(module) -> torch.Tensor:
    weight = module.weight.detach()
    return weight.t() if type(module).__name__ == "Conv1D" else weight  # as [out, in]


def held_once(modules: Sequence[torch.nn.Module], weight: torch.Tensor) -> None:
    """Each module's weight as a view of `weight` (their [out, in] weights side by side: its rows, a Conv1D's
    transposed), which its own forward reads as before, so the product's plain layout is the only copy: on a GPU
    (`side_by_side`) and for `mm16` on AVX2 (SmolLM2-135M in bfloat16 on a Zen 3: 132 MiB more resident with the
    copies)."""
    start = 0
    for m in modules:
        rows = _layout(m).shape[0]
        part = weight[start:start + rows]
        m.weight.data = part.t() if type(m).__name__ == "Conv1D" else part
        start += rows


def own_product(module, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """bfloat16 rows times `weight` [out, in] on spec's kernel (`mm16`), the bias added in bfloat16 as spec's
    quantized products add it. Every row's bits are its own: no pieces of rows."""
    width = weight.shape[0]
    if weight.shape[1] % 8:  # (mm16 takes inputs in 8s; no model we know has others)
        return lambda x: torch.nn.functional.linear(x, weight, bias)

    def forward(x: torch.Tensor) -> torch.Tensor:
        mm16 = torch.ops.spec.bf16_mm if torch.compiler.is_compiling() else module.mm16  # (what a compiled step traces)
        y = mm16(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), weight)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], width).to(x.dtype)

    forward.packed = weight  # (what the tests look for)
    forward.native = (weight, weight.new_empty(0), bias if bias is not None else weight.new_zeros(0), 16)
    return forward


def products(lean) -> list:
    """A lean loop's callables that may be products: the head's, then every layer's parts."""
    return [lean.head] + [f for layer in lean.layers for f in layer]


def packs(lean) -> int:
    """How many of a lean loop's products are packed."""
    return sum(hasattr(f, "packed") for f in products(lean))


def side_by_side(modules: Sequence[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Projections of one input as one product (q, k and v; gate and up): their weights concatenated, each
    module's weight then a view of it (held once), one kernel where there were several. For a GPU, where a
    small model's forward is a few hundred kernels of a few microseconds each."""
    weight = torch.cat([m.weight.detach() for m in modules])
    held_once(modules, weight)
    biases = [getattr(m, "bias", None) for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.weight.shape[0])
                          for b, m in zip(biases, modules)])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    forward.packed = weight
    return forward


def linear(modules: Sequence[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable for the projections `modules` (all reading the same input), outputs side by side: their
    weights concatenated and packed once; a bias where any has one (zeros for the others). On a GPU
    `side_by_side`."""
    if on_gpu(modules):
        return side_by_side(modules)
    weights = [_layout(m) for m in modules]
    weight = torch.cat(weights) if len(weights) > 1 else weights[0].contiguous()
    biases = [getattr(m, "bias", None) for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])
    if weight.dtype == torch.bfloat16 and (own := own_bfloat16()) is not None:
        held_once(modules, weight)
        return own_product(own, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    project = torch.ops.mkldnn._linear_pointwise
    pieces = weight.dtype != torch.float32

    def piece(x: torch.Tensor) -> torch.Tensor:
        if pieces and x.shape[-2] == 1:  # (one row as two: oneDNN's one-row kernel sums otherwise, `ROWS`)
            return project(torch.cat([x, x], -2), packed, bias, "none", [], "").narrow(-2, 0, 1)
        return project(x, packed, bias, "none", [], "")

    def forward(x: torch.Tensor) -> torch.Tensor:
        if pieces and x.shape[-2] > ROWS:  # (the last piece may be one row: 33 rows are 32 and one)
            return torch.cat([piece(part) for part in x.split(ROWS, dim=-2)], -2)
        return piece(x)

    forward.packed = packed  # (what the tests look for)
    forward.onednn = (packed, bias)  # (what the native GPT-2 block takes)
    return forward
