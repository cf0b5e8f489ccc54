"""Weight-only quantized projections, computed on directly by torch's integer kernels.

- int4: 4-bit values with a scale and a zero per group of 32 inputs, w = (q - 8) * scale + zero: llama.cpp's
  Q4_0, Q4_1 and Q4_K blocks map onto it value for value (`spec_cli.models.gguf_blocks`), and a float weight is
  quantized to it min-max per group (as gpt-fast does). CPU: spec's own kernel where it runs (AVX-512 VNNI or AVX2)
  (`spec_cli.exec.native`: the activations quantized to int8 per group of 32, integer sums, as llama.cpp does),
  else `aten._weight_int4pack_mm_for_cpu`; CUDA: tinygemm's `aten._weight_int4pack_mm`.
- int8: 8-bit values with one scale per output channel, `aten._weight_int8pack_mm`; on spec's CPU kernel a scale
  (and zero) per group of 32 or 16 inputs, what llama.cpp's 5- and 8-bit blocks become.
- int6: llama.cpp's Q6_K as it is, on spec's CPU kernel: 6-bit values, a signed 8-bit scale per 16 inputs under a
  half-precision scale per 256 (6.56 bits a weight, the file's own values exactly).

The kernels take bfloat16 activations (with float32 ones they are many times slower), so a quantized projection
computes in bfloat16 whatever its model's dtype, and on a CPU gives a row the same bits whatever other rows share
the product (tests/test_quant.py): what exact speculation needs. A product of more rows than `packing.ROWS` runs
in pieces of that many, as the bfloat16 float products do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from spec_cli.core.paths import used, write_whole
from spec_cli.exec import native, packing

KINDS = ("none", "int8", "int4")  # what a float model is quantized to (int6 is read from files only)
BITS = {"int4": 4, "int6": 6, "int8": 8, "fp4": 5}  # (what native/layer.cpp's `project` takes; fp4: MXFP4)
E2M1 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)  # MXFP4's 4-bit
# floats by nibble, doubled (llama.cpp's kvalues_mxfp4): w = E2M1[q] * 2^(e - 128)
GROUP = 32
ACTIVATIONS = torch.bfloat16  # what both kernels compute with; their scales are stored in it too
ROWS_IN = 16  # the int4 kernels' outputs come in multiples of this
PACK_ROWS = 1024  # the CPU's int4 layout is row by row (in 16s): large weights are packed a piece at a time


def _grouped(scales: torch.Tensor, zeros: torch.Tensor, alone: bool = True) -> torch.Tensor:
    """Scales and zeros [out, groups] as spec's kernels hold them: [groups, out, 2] pairs, or [groups, out] the
    scales alone where every zero is 0 (Q8_0, Q5_0, Q6_K, Q4_0: a bit a weight less to read) and `alone`."""
    if alone and bool((zeros.to(ACTIVATIONS) == 0).all()):
        return scales.to(ACTIVATIONS).t().contiguous()
    return torch.stack([scales, zeros], -1).to(ACTIVATIONS).transpose(0, 1).contiguous()


def inner_k_tiles(in_features: int) -> int:
    """tinygemm's (CUDA) tiling of the inputs: the largest of 8, 4, 2 that divides them in 16s."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


class Quantized(torch.nn.Module):
    """A linear layer ([out, in], optional bias) whose weight is held quantized. `values` is the device's kernel
    layout; `nibbles` (int4) the portable one it is made from: two values per byte, the even input high."""

    def __init__(self, kind: str, values: torch.Tensor, scales: torch.Tensor, out_features: int,
                 in_features: int, bias: torch.Tensor | None = None, group: int = GROUP, source: str = "",
                 layout: str = "torch"):
        super().__init__()
        self.kind, self.group, self.source = kind, group, source
        self.layout = layout  # of `values`: "vnni" (spec's own CPU kernel) or "torch"
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("values", values)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def int4(cls, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, device: torch.device,
             bias: torch.Tensor | None = None, group: int = GROUP, source: str = "") -> "Quantized":
        """From 4-bit values packed two per byte ([out, in / 2] uint8, even input in the high nibble) and a scale
        and zero per group ([out, in / group] each)."""
        out_features, in_features = nibbles.shape[0], nibbles.shape[1] * 2
        pad = -out_features % ROWS_IN  # the kernels take outputs in 16s: padded with zero rows, sliced off
        if pad:
            nibbles = torch.cat([nibbles, nibbles.new_full((pad, nibbles.shape[1]), 0x88)])
            scales, zeros = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scales, zeros))
        layout = int4_layout(device)
        grouped = _grouped(scales, zeros, alone=layout == "vnni")  # (torch's kernels take pairs only)
        return cls("int4", pack_int4(nibbles, device, layout), grouped.to(device), out_features, in_features,
                   None if bias is None else bias.to(device, ACTIVATIONS), group, source, layout)

    @classmethod
    def int8(cls, values: torch.Tensor, scales: torch.Tensor, device: torch.device,
             bias: torch.Tensor | None = None, source: str = "") -> "Quantized":
        """From 8-bit values [out, in] int8 and a scale per output channel."""
        # (copied: the kernel reads out of bounds of a tensor at an odd address, such as safetensors gives)
        return cls("int8", values.to(device).clone(memory_format=torch.contiguous_format),
                   scales.to(device, ACTIVATIONS).clone(memory_format=torch.contiguous_format), values.shape[0],
                   values.shape[1], None if bias is None else bias.to(device, ACTIVATIONS), source=source)

    @classmethod
    def int8_of_halves(cls, halves: "Quantized") -> "Quantized":
        """Q8_0 as loaded (two int4 halves on spec's kernel, `gguf_blocks.q8_halves`) as the one 8-bit product
        they add up to: the file's values and scales, one pass (half the integer work a row, `native` `mm8`)."""
        inputs, groups = halves.in_features // 2, halves.in_features // 2 // halves.group
        packed = torch.empty(halves.values.shape[0], inputs, dtype=torch.uint8)
        for first in range(0, packed.shape[0], PACK_ROWS):  # (a piece of rows at a time: a large head's
            nibbles = native.unpack(halves.values[first:first + PACK_ROWS])  # temporaries never whole)
            high, low = nibbles[:, :inputs].to(torch.int16), nibbles[:, inputs:]  # (q >> 4) + 8, q & 15
            packed[first:first + PACK_ROWS] = native.pack8(((high - 8) * 16 + low).to(torch.int8))
        scales = halves.scales[groups:, :, 0].contiguous()  # the low half's (d, 8 d) -> d: its zero is 0
        return cls("int8", packed, scales, halves.out_features, inputs, halves.bias, halves.group, halves.source,
                   "vnni")

    @classmethod
    def int8_grouped(cls, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, device: torch.device,
                     bias: torch.Tensor | None = None, group: int = GROUP, source: str = "") -> "Quantized":
        """From 8-bit values [out, in] int8 and a scale and zero per group of `group` (32 or 16) inputs ([out,
        in / group] each), w = q * scale + zero, on spec's CPU kernel (`native.int4().mm8`). Where every zero is 0
        (Q8_0, Q5_0, Q6_K) the scales are held alone: [groups, out], a bit a weight less to read."""
        out_features, in_features = values.shape
        pad = -out_features % ROWS_IN
        if pad:
            values = torch.cat([values, values.new_zeros(pad, in_features)])
            scales, zeros = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scales, zeros))
        return cls("int8", _pack8(values, group).to(device), _grouped(scales, zeros).to(device), out_features,
                   in_features, None if bias is None else bias.to(device, ACTIVATIONS), group, source, "vnni")

    @classmethod
    def fp4(cls, nibbles: torch.Tensor, exponents: torch.Tensor, device: torch.device,
            bias: torch.Tensor | None = None, source: str = "MXFP4") -> "Quantized":
        """llama.cpp's MXFP4 (gpt-oss's experts) as it is, on spec's CPU kernel (`mmfp4`): 4-bit indices of E2M1
        packed two per byte ([out, in / 2], the even input high) and an exponent byte e per 32 inputs ([out, in /
        32] uint8), w = E2M1[q] * 2^(e - 128) (4.25 bits a weight). Exponents held as bytes [groups, out]."""
        out_features, in_features = nibbles.shape[0], nibbles.shape[1] * 2
        pad = -out_features % ROWS_IN
        if pad:  # (index 0: a weight of 0)
            nibbles = torch.cat([nibbles, nibbles.new_zeros(pad, nibbles.shape[1])])
            exponents = torch.cat([exponents, exponents.new_zeros(pad, exponents.shape[1])])
        return cls("fp4", pack_int4(nibbles, torch.device("cpu"), "vnni").to(device),
                   exponents.to(torch.uint8).t().contiguous().to(device), out_features, in_features,
                   None if bias is None else bias.to(device, ACTIVATIONS), GROUP, source, "vnni")

    @classmethod
    def int4_super(cls, nibbles: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor,
                   dmin: torch.Tensor, device: torch.device, bias: torch.Tensor | None = None,
                   source: str = "Q4_K") -> "Quantized":
        """llama.cpp's Q4_K as it is, on spec's CPU kernel: 4-bit values packed two per byte ([out, in / 2], the
        even input high), a 6-bit scale and min per 32 inputs ([out, in / 32] uint8 each) and a half-precision d
        and dmin per 256 ([out, in / 256] float16 each): w = d sc q - dmin mn, the file's own weights exactly (the
        pairs of `int4` round each group's to bfloat16). Scales held as bytes [2 groups + 4 supers, out]."""
        out_features, in_features = nibbles.shape[0], nibbles.shape[1] * 2
        if in_features % 256:
            raise ValueError(f"Q4_K takes inputs in 256s; this weight has {in_features}")
        pad = -out_features % ROWS_IN
        if pad:
            nibbles = torch.cat([nibbles, nibbles.new_full((pad, nibbles.shape[1]), 0x88)])
            sc, mn, d, dmin = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (sc, mn, d, dmin))
        scales = torch.cat([sc.to(torch.uint8).t(), mn.to(torch.uint8).t(), *_half_bytes(d), *_half_bytes(dmin)])
        return cls("int4", pack_int4(nibbles, torch.device("cpu"), "vnni").to(device), scales.contiguous().to(device),
                   out_features, in_features, None if bias is None else bias.to(device, ACTIVATIONS), GROUP, source,
                   "vnni")

    @classmethod
    def int6(cls, values: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, device: torch.device,
             bias: torch.Tensor | None = None, source: str = "Q6_K") -> "Quantized":
        """From 6-bit values [out, in] int8 (-32..31), a signed 8-bit scale per 16 inputs ([out, in / 16] int8) and
        a half-precision one per 256 ([out, in / 256] float16): w = d * sc * q, on spec's CPU kernel (`mm6`),
        llama.cpp's Q6_K as it is. Scales held as bytes [in / 16 + 2 * in / 256, out]: the 8-bit ones, then d's
        low bytes, then its high ones (each column an output's: products side by side concatenate along it)."""
        out_features, in_features = values.shape
        if in_features % 256:
            raise ValueError(f"6-bit weights take inputs in 256s; this one has {in_features}")
        pad = -out_features % ROWS_IN
        if pad:
            values, sc, d = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (values, sc, d))
        scales = torch.cat([sc.to(torch.int8).view(torch.uint8).t(), *_half_bytes(d)]).contiguous()
        return cls("int6", _packed(values, native.pack6).to(device), scales.to(device), out_features, in_features,
                   None if bias is None else bias.to(device, ACTIVATIONS), 16, source, "vnni")

    @property
    def super_blocks(self) -> bool:
        """Whether it holds llama.cpp's super-block scales as they are (Q4_K's, Q6_K's): bytes, not bfloat16."""
        return self.scales.dtype == torch.uint8 and self.kind != "fp4"

    def powers(self) -> torch.Tensor:
        """MXFP4's scales as float32 [groups, out]: 2^(e - 128), exactly."""
        return torch.ldexp(torch.ones(self.scales.shape, device=self.scales.device), self.scales.to(torch.int32) - 128)

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Super-block scales (`super_blocks`) as float32 (scale, offset) [groups, out], exactly: w = q * scale +
        offset, q as the layout holds it (int4: 0..15, int6: -32..31)."""
        groups = self.in_features // self.group
        per = 256 // self.group
        lead = groups if self.kind == "int6" else 2 * groups
        halves = self.scales[lead:].to(torch.int32).reshape(-1, 2, groups // per, self.scales.shape[1])
        bits = halves[:, 0] | (halves[:, 1] << 8)
        half = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16).float()
        d = half.repeat_interleave(per, 1)  # [d (, dmin)] x [groups, out]
        if self.kind == "int6":
            return self.scales[:groups].view(torch.int8).float() * d[0], torch.zeros_like(d[0])
        return self.scales[:groups].float() * d[0], -(self.scales[groups:lead].float() * d[1])

    def as_int8(self, group: int) -> "Quantized":
        """The same weights as 8-bit values on spec's kernel, a scale and zero per `group` inputs (a divisor of
        its own group): int4's q - 8 and its scale and zero, each group's scale and zero repeated. A product of
        projections quantized alike (q, k and v of files that mix formats) runs as one."""
        if self.layout != "vnni" or self.group % group:
            raise ValueError(f"no 8-bit form in groups of {group} of this {self.kind} projection")
        values = self.unpacked()
        if self.kind == "int4":
            values = (values.to(torch.int16) - 8).to(torch.int8)
        if self.kind == "fp4":
            values, scales = E2M1[values.long()], self.powers().to(ACTIVATIONS)  # (exact: powers of two)
        elif self.super_blocks:  # (rounded to the 8-bit kernel's bfloat16: w = (q - 8) scale + (offset + 8 scale))
            scale, offset = self.affine()
            zero = offset + 8 * scale if self.kind == "int4" else offset
            scales = torch.stack([scale, zero], -1).to(ACTIVATIONS) if self.kind == "int4" else scale.to(ACTIVATIONS)
        else:
            scales = self.scales
        scales = scales.repeat_interleave(self.group // group, 0).contiguous()
        return Quantized("int8", _pack8(values, group), scales, self.out_features, self.in_features, self.bias, group,
                         self.source, "vnni")

    def rows(self, indices: torch.Tensor) -> "Quantized":
        """The projection of these output rows only (a draft's head over part of the vocabulary), at the same
        values; None where its layout is not spec's CPU kernel's."""
        if self.layout != "vnni":
            return None
        indices = indices.to(torch.long)
        pad = -len(indices) % ROWS_IN
        scales = self.scales[:, indices]
        if pad:
            scales = torch.cat([scales, scales.new_zeros(scales.shape[0], pad, *scales.shape[2:])], 1)
        blocks, where = torch.unique(indices // ROWS_IN, return_inverse=True)  # (only theirs unpacked: a 152k-word
        q = self.unpacked(blocks)[where * ROWS_IN + indices % ROWS_IN]        # head whole took ~0.8 s)
        if pad:  # (int4's 8 and the others' 0: a weight of 0 under a zero scale)
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 8 if self.kind == "int4" else 0)])
        bias = None if self.bias is None else self.bias[indices]
        return Quantized(self.kind, self._pack(q), scales.contiguous(), len(indices), self.in_features, bias,
                         self.group, self.source, "vnni")

    def unpacked(self, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Its values [out (in 16s), in] as spec's CPU kernel layout holds them: int4 0..15, int6 and int8 signed;
        of the outputs of `blocks` only (blocks of ROWS_IN outputs, each packed on its own), in their order."""
        values = self.values
        if blocks is not None:
            values = values.view(-1, ROWS_IN, values.shape[1])[blocks.to(values.device)].reshape(-1, values.shape[1])
        if self.kind in ("int4", "fp4"):
            return native.unpack(values)
        if self.kind == "int6":
            return native.unpack6(values)
        return native.unpack8(values, self.group)

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """`unpacked`'s inverse."""
        if self.kind in ("int4", "fp4"):
            return pack_int4(nibbles_of(q), torch.device("cpu"), "vnni")
        if self.kind == "int6":
            return _packed(q, native.pack6)
        return _pack8(q, self.group)

    @property
    def grouped(self) -> bool:
        """Whether its scales (and zeros) are per group of inputs, [groups, out, 2] (or [groups, out], the zeros
        0), its outputs in 16s (int4, and 8-bit on spec's kernel), rather than per output channel (torch's int8)."""
        return self.kind == "int4" or self.layout == "vnni"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales) )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self)(x)

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}" + (
            f", group={self.group}" if self.grouped else "") + (f", from {self.source}" if self.source else "")


class Doubled(torch.nn.Module):
    """An int4 projection over its input twice ([x, x]): llama.cpp's Q8_0 as two 4-bit halves
    (`spec_cli.models.gguf_blocks.q8_halves`), the file's 8-bit values exactly."""

    def __init__(self, inner: Quantized):
        super().__init__()
        self.inner = inner
        self.kind, self.out_features, self.in_features = "int8 as 2 x int4", inner.out_features, inner.in_features // 2
        self.source = inner.source
        self._call = product(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(torch.cat([x, x], -1))


def q8(halves: Quantized) -> torch.nn.Module:
    """A Q8_0 projection as loaded (two int4 halves): one 8-bit product where spec's kernel runs it, else the
    halves over [x, x]."""
    return Quantized.int8_of_halves(halves) if halves.layout == "vnni" else Doubled(halves)


def native_kernel(say=None):
    """spec's own CPU int4 kernel, where it runs here (else None: torch's)."""
    return native.int4(say) if native.wanted() else None


def int4_layout(device: torch.device) -> str:
    """The layout int4 weights are packed in on `device`: "vnni" for spec's own CPU kernel, else "torch"."""
    return "vnni" if device.type == "cpu" and native_kernel() else "torch"



def _pack8(values: torch.Tensor, group: int) -> torch.Tensor:
    """8-bit values [out, in] in spec's kernel layout (`native.pack8`), a piece of rows at a time."""
    return _packed(values, lambda part: native.pack8(part, group))


def _half_bytes(halves: torch.Tensor) -> list[torch.Tensor]:
    """Half-precision numbers [out, n] as two rows of bytes each, [n, out] low then [n, out] high."""
    bits = halves.to(torch.float16).view(torch.int16).to(torch.int32)
    return [(bits & 255).to(torch.uint8).t(), ((bits >> 8) & 255).to(torch.uint8).t()]


def _packed(values: torch.Tensor, pack) -> torch.Tensor:
    """`pack(values)` a piece of rows at a time (a large head's temporaries never whole)."""
    pieces = [pack(values[first:first + PACK_ROWS]) for first in range(0, values.shape[0], PACK_ROWS)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def pack_int4(nibbles: torch.Tensor, device: torch.device, layout: str = "torch") -> torch.Tensor:
    if device.type == "cuda":
        return torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), inner_k_tiles(nibbles.shape[1] * 2))
    out = torch.empty(nibbles.shape, dtype=torch.uint8)
    if layout == "vnni":  # (blocks of 16 rows one after another: packed a piece of rows at a time)
        for first in range(0, nibbles.shape[0], PACK_ROWS):
            out[first:first + PACK_ROWS] = native.pack(nibbles[first:first + PACK_ROWS])
        return out
    for first in range(0, nibbles.shape[0], PACK_ROWS):  # (the packer takes int32 values: 8x the bytes)
        part = nibbles[first:first + PACK_ROWS]
        values = torch.stack([part >> 4, part & 15], -1).reshape(part.shape[0], -1).to(torch.int32)
        out[first:first + part.shape[0]] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    return out


def nibbles_of(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (0..15, any integer dtype) packed two per byte, the even input high."""
    values = values.to(torch.uint8)
    return ((values[:, ::2] << 4) | values[:, 1::2]).contiguous()


def _kernel(kind: str, device: torch.device, group: int, values, scales,
            layout: str = "torch") -> Callable[[torch.Tensor], torch.Tensor]:
    if layout == "vnni":
        module = native.int4()  # (built: the weight was packed for it)
        mm = {"int8": module.mm8, "int6": module.mm6, "fp4": module.mmfp4}.get(kind, module.mm)
        op = getattr(torch.ops.spec, f"{kind}_mm")  # (what a compiled step traces)
        return lambda x: (op if torch.compiler.is_compiling() else mm)(x.contiguous(), values, scales)
    if kind == "int8":
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.contiguous(), values, scales)
    if device.type == "cuda":
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, values, group, scales)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, values, group, scales)


def product(*modules: Quantized) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable for quantized projections of one input, outputs side by side. On a CPU their weights are
    concatenated (the kernels' layouts are row by row); on CUDA each runs on its own."""
    first = modules[0]
    device = first.values.device
    if len(modules) > 1 and device.type == "cuda":
        calls = [product(m) for m in modules]

        def side_by_side(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([call(x) for call in calls], -1)

        side_by_side.packed = calls[0].packed  # (what a gated MLP asks of its gate and up: a crash on CUDA without)
        return side_by_side
    if len(modules) > 1:
        values = torch.cat([m.values for m in modules])
        held = [m.scales for m in modules]
        if first.grouped and len({s.dim() for s in held}) > 1:  # (some with their zeros, some without: all with)
            held = [s if s.dim() == 3 else torch.stack([s, torch.zeros_like(s)], -1) for s in held]
        scales = torch.cat(held, 1 if first.grouped else 0)
        start = 0
        for m in modules:  # (each module's values now a view of the product's: the weights held once)
            m.values = values[start:start + m.values.shape[0]]
            start += m.values.shape[0]
    else:
        values, scales = first.values, first.scales
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else values.new_zeros(m.out_features, dtype=ACTIVATIONS)
                          for b, m in zip(biases, modules)])
    kernel = _kernel(first.kind, device, first.group, values, scales, first.layout)
    width = sum(m.out_features for m in modules)
    padded = first.grouped and first.out_features % ROWS_IN != 0  # (then alone: `fusable`)
    pieces = device.type == "cpu"

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        cast = flat.dtype != ACTIVATIONS
        if cast:
            flat = flat.to(ACTIVATIONS)
        if pieces and flat.shape[0] > packing.ROWS:
            y = torch.cat([kernel(part) for part in flat.split(packing.ROWS)])
        else:
            y = kernel(flat)
        if padded:
            y = y[:, :width]
        if bias is not None:
            y = y + bias
        y = y.reshape(*x.shape[:-1], width)
        return y.to(x.dtype) if cast else y

    forward.packed = values  # (counted as a packed product: a few rows cost about one)
    if first.layout == "vnni" and not padded:  # what a fused layer calls (native/layer.cpp; no bias: empty)
        forward.native = (values, scales, (bias if bias is not None else values.new_zeros(0, dtype=ACTIVATIONS)),
                          BITS[first.kind])
    return forward


def fusable(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether quantized projections of one input can run as one product (one of them always can)."""
    if not all(isinstance(m, Quantized) for m in modules):
        return False
    return len(modules) == 1 or (len({_form(m) for m in modules}) == 1
                                 and all(not m.grouped or m.out_features % ROWS_IN == 0 for m in modules))


def _form(m: Quantized) -> tuple:
    return m.kind, m.group, m.values.device, m.layout, m.scales.dtype


def runs(modules: Sequence[torch.nn.Module]) -> list[list[Quantized]] | None:
    """Quantized projections of one input as the fewest runs of neighbours that are each one product (`fusable`):
    a file's q and k in Q4_K beside its v in Q6_K are two. None where some are not quantized."""
    if not all(isinstance(m, Quantized) for m in modules):
        return None
    found: list[list[Quantized]] = []
    for m in modules:
        if found and fusable([*found[-1], m]):
            found[-1].append(m)
        else:
            found.append([m])
    return found


def side_by_side(*modules: Quantized) -> Callable[[torch.Tensor], torch.Tensor]:
    """Quantized projections of one input in several formats: each run of one format one product (`runs`),
    their outputs side by side. `parts`: each run's `native` (what a fused layer calls), where all have one."""
    found = runs(modules)
    if len(found) == 1:
        return product(*modules)
    calls = [product(*run) for run in found]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([call(x) for call in calls], -1)

    forward.packed = calls[0].packed
    if all(hasattr(call, "native") for call in calls):
        forward.parts = [call.native for call in calls]
    return forward


class Experts(torch.nn.Module):
    """A mixture's experts, each expert's gate and up (one projection, `gate_up`, where `fused`: the two side by
    side, as a file's blocks of one kind are kept) and down its own projection (quantized: a GGUF file's blocks on
    spec's kernels; or float), in place of transformers' experts of 3-d weights (`MixtralExperts` and its kin:
    `forward(hidden_states, top_k_index, top_k_weights)`, `experts_of`). The forward is transformers' eager one:
    each expert hit, in the experts' order, takes its rows and adds its weighted output into theirs, so a row's
    sum is of the same products in the same order whatever rows share the forward (exact speculation where the
    products are row-invariant, as spec's kernels are)."""

    def __init__(self, experts: int, hidden: int, width: int, act_fn, dtype: torch.dtype, fused: bool = True,
                 biases: bool = False):
        super().__init__()
        self.num_experts, self.act_fn, self.fused = experts, act_fn, fused

        def placeholders(out_features: int, in_features: int) -> torch.nn.ModuleList:  # (replaced as loaded)
            with torch.device("meta"):
                return torch.nn.ModuleList(torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
                                           for _ in range(experts))
        if fused:
            self.gate_up = placeholders(2 * width, hidden)
        else:
            self.gate, self.up = placeholders(width, hidden), placeholders(width, hidden)
        self.down = placeholders(hidden, width)
        if biases:  # (gpt-oss's: each expert's gate, up and down biases, added to its products' outputs)
            with torch.device("meta"):
                self.gate_bias, self.up_bias = (torch.nn.Parameter(torch.empty(experts, width, dtype=dtype),
                                                                   requires_grad=False) for _ in range(2))
                self.down_bias = torch.nn.Parameter(torch.empty(experts, hidden, dtype=dtype), requires_grad=False)
        self.biases = biases
        self._calls: list | None = None
        self._kernel = None  # (`_one_call`: None not yet asked, False none)

    @classmethod
    def like(cls, module: torch.nn.Module, fused: bool = True) -> "Experts":
        if hasattr(module, "limit"):  # gpt-oss's: [experts, hidden, 2 x width], biases, its clamped SwiGLU
            experts, hidden, doubled = module.gate_up_proj.shape
            return cls(experts, hidden, doubled // 2, ClampedSwiGLU(module.alpha, module.limit),
                       module.gate_up_proj.dtype, fused, biases=True)
        experts, doubled, hidden = module.gate_up_proj.shape
        return cls(experts, hidden, doubled // 2, module.act_fn, module.gate_up_proj.dtype, fused)

    def _call(self, e: int):
        """(gate and up side by side, down) of expert e: quantized, one product each where they are alike (held
        as one where `fused`); float ones packed (`packing.linear`: a row's bits its own, as the quantized
        products' are)."""
        if self._calls is None:
            self._calls = [None] * self.num_experts
        if self._calls[e] is None:
            parts = [self.gate_up[e]] if self.fused else [self.gate[e], self.up[e]]
            both = side_by_side(*parts) if all(isinstance(m, Quantized) for m in parts) else packing.linear(parts)
            down = self.down[e]
            self._calls[e] = both, product(down) if isinstance(down, Quantized) else packing.linear([down])
        return self._calls[e]

    def _one_call(self):
        """spec's native experts (`native/layer.cpp`'s MixtureExperts: the loop below as one call, SiLU times up
        by glue's `silu_mul`, or gpt-oss's activation by torch's operations with its biases in the products) where
        every expert's gate_up and down are each one product on spec's kernels; else False."""
        if self._kernel is None:
            self._kernel = False
            module = native.int4()
            clamped = isinstance(self.act_fn, ClampedSwiGLU)
            if module is not None and self.fused and (clamped or (type(self.act_fn).__name__ in ("SiLU", "SiLUActivation")
                                                                 and not self.biases)):
                calls = [self._call(e) for e in range(self.num_experts)]
                if all(hasattr(f, "native") for pair in calls for f in pair):
                    parts = [list(f.native) for pair in calls for f in pair]
                    if self.biases:  # (each expert's, in the bias slot of its products: added as `_expert` adds them)
                        for e in range(self.num_experts):
                            parts[2 * e][2] = torch.cat([self.gate_bias[e], self.up_bias[e]]).to(ACTIVATIONS)
                            parts[2 * e + 1][2] = self.down_bias[e].to(ACTIVATIONS).contiguous()
                    activation = (self.act_fn.alpha, self.act_fn.limit) if clamped else (0.0, 0.0)
                    self._kernel = module.Experts([t for p in parts for t in p[:3]], [p[3] for p in parts],
                                                  *activation)
        return self._kernel

    def _expert(self, e: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        both, down = self._call(e)
        gate, up = both(x).chunk(2, -1)
        if not self.biases:
            return (down(self.act_fn(gate) * up) * weight).to(x.dtype)
        gate, up = gate + self.gate_bias[e], up + self.up_bias[e]
        return ((down(self.act_fn(gate, up)) + self.down_bias[e]) * weight).to(x.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.bfloat16 and hidden_states.device.type == "cpu" and \
                not torch.compiler.is_compiling() and self._one_call():
            return self._kernel.run(hidden_states, top_k_index, top_k_weights)
        chosen = top_k_index.tolist()  # (each expert's rows gathered on the host: one read)
        final = torch.zeros_like(hidden_states)
        if len(chosen) == 1:  # (one row: added in place, as index_add_ adds it)
            for e, slot in sorted((e, slot) for slot, e in enumerate(chosen[0]) if e < self.num_experts):
                final = final + self._expert(e, hidden_states, top_k_weights[:, slot, None])
            return final
        taken: dict[int, tuple[list, list]] = {}
        for row, experts in enumerate(chosen):
            for slot, e in enumerate(experts):
                if e < self.num_experts:
                    rows, slots = taken.setdefault(e, ([], []))
                    rows.append(row)
                    slots.append(slot)
        for e in sorted(taken):  # (the experts' order, as transformers' loop)
            rows, slots = (torch.tensor(t, device=hidden_states.device) for t in taken[e])
            final.index_add_(0, rows, self._expert(e, hidden_states[rows], top_k_weights[rows, slots, None]))
        return final


class ClampedSwiGLU(torch.nn.Module):
    """gpt-oss's activation of an expert's gate and up (transformers' `GptOssExperts._apply_gate`, the gate and up
    apart, not interleaved): the gate clamped above, the up both sides, gate x sigmoid(alpha x gate) x (up + 1)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class _RowByRow(torch.overrides.TorchFunctionMode):
    """Within it, a product `F.linear(x, w[, b])` gives each row of x the bits it has alone: `own(x)` for the
    router's weight in bfloat16 (spec's `mm16`, its bias added), else each row's product on its own (a float32
    router's, DeepSeek's)."""

    def __init__(self, weight: torch.Tensor, own: Callable | None):
        super().__init__()
        self.weight, self.own = weight, own

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.nn.functional.linear or len(args) not in (2, 3) or kwargs:
            return func(*args, **(kwargs or {}))
        x, weight = args[:2]
        if self.own is not None and weight is self.weight and x.dtype == torch.bfloat16:
            return self.own(x)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            return func(*args)
        return torch.cat([func(row, *args[1:]) for row in rows.split(1)]).reshape(*x.shape[:-1], weight.shape[0])


class Routed(torch.nn.Module):
    """A mixture's router (transformers' own module: its product, then each row's softmax, top-k and weights), or
    another product of few outputs beside its experts (Qwen2-MoE's shared expert's gate), whose product gives each
    row the bits it has alone: for bfloat16 rows on a CPU with spec's kernels on `mm16`
    (each row's sums its own), else row by row. torch's product, packed by oneDNN or not, splits a product of few
    outputs' inputs among threads by how many rows it has: with two threads, in bfloat16, a row in a few hundred
    took other bits than alone at 8 or 16 outputs (Mixtral 8x7B's router), so a verified row could have been
    routed otherwise than alone."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.router = router
        self._mode = None

    def forward(self, x: torch.Tensor):
        if torch.compiler.is_compiling():
            return self.router(x)
        if self._mode is None:
            weight, module = self.router.weight, native.int4()
            own = (packing.own_product(module, weight, getattr(self.router, "bias", None))
                   if module is not None and weight.device.type == "cpu"
                   and weight.dtype == torch.bfloat16 and weight.shape[1] % 8 == 0 else None)
            self._mode = _RowByRow(weight, own)
        with self._mode:
            return self.router(x)


ROUTERS = ("gate", "router", "shared_expert_gate")  # products of few outputs beside a mixture's experts (Granite's
                                                   # router is `router`; Qwen2-MoE's shared expert has a gate)


def routers_of(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) of each of a mixture's `ROUTERS` not yet `Routed` (a module with one weight
    [few outputs, width] beside the experts)."""
    found = []
    for parent in model.modules():
        if isinstance(getattr(parent, "experts", None), torch.nn.Module):
            for name in ROUTERS:
                module = getattr(parent, name, None)
                if (isinstance(module, torch.nn.Module) and not isinstance(module, Routed)
                        and getattr(module, "weight", None) is not None):
                    found.append((parent, name, module))
    return found


def route_rows_alone(model: torch.nn.Module) -> int:
    """Each mixture's router `Routed` (a verified row routed as it is alone); how many."""
    routers = routers_of(model)
    for parent, attribute, router in routers:
        setattr(parent, attribute, Routed(router))
    return len(routers)


def split_experts(model: torch.nn.Module) -> int:
    """transformers' experts of 3-d weights (`experts_of`) as `Experts` of one projection each (float, their
    weights views of the 3-d ones: nothing copied), which `quantize_model` then quantizes as any projection; how
    many were split; gpt-oss's stay transformers' own (its gate and up interleaved: no views of them)."""
    found = experts_of(model, biases=False)
    for parent, attribute, experts in found:
        split = Experts.like(experts)
        for e in range(split.num_experts):
            for name, weight in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
                linear = torch.nn.Linear(weight.shape[2], weight.shape[1], bias=False, device="meta")
                linear.weight = torch.nn.Parameter(weight.detach()[e], requires_grad=False)
                getattr(split, name)[e] = linear
        setattr(parent, attribute, split)
    return len(found)


def experts_of(model: torch.nn.Module, biases: bool = True) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) of each mixture's experts held as transformers' 3-d weights whose forward
    `Experts` computes: a gate and up side by side, a down, no biases (`act_fn`); or (`biases`) gpt-oss's, with
    biases, its gate and up interleaved and its own activation."""
    found = []
    for parent in model.modules():
        for attribute, child in parent.named_children():
            weights = set(dict(child.named_parameters(recurse=False)))
            if weights == {"gate_up_proj", "down_proj"} and child.gate_up_proj.dim() == 3 and hasattr(child, "act_fn"):
                found.append((parent, attribute, child))
            elif biases and weights == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"} \
                    and child.gate_up_proj.dim() == 3 and hasattr(child, "limit"):
                found.append((parent, attribute, child))
    return found


def int4_of(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles, scales, zeros) of a float weight [out, in]: min-max per group, the scale and zero rounded to the
    kernel's dtype before the values are chosen (so the values fit what the kernel will use)."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"int4 needs inputs in groups of {group}; this weight has {in_features}")
    w = weight.detach().float().contiguous().reshape(out_features, -1, group)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-8).to(ACTIVATIONS).float()
    zeros = (low + 8 * scales).to(ACTIVATIONS).float()
    values = ((w - zeros[..., None]) / scales[..., None] + 8).round().clamp(0, 15)
    return nibbles_of(values.reshape(out_features, in_features)), scales, zeros


def int8_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of a float weight [out, in]: symmetric, one scale per output channel."""
    w = weight.detach().float()
    scales = (w.abs().amax(1) / 127).clamp(min=1e-8).to(ACTIVATIONS).float()
    return (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


def dequantized(module: Quantized) -> torch.Tensor:
    """The float32 weight [out, in] a quantized projection computes with (for tests and requantizing)."""
    if module.layout == "vnni" and module.super_blocks:  # (llama.cpp's super-block scales, exactly)
        q = module.unpacked()
        scale, offset = module.affine()
        w = q.float().reshape(q.shape[0], -1, module.group) * scale.t()[..., None] + offset.t()[..., None]
        return w.reshape(q.shape[0], -1)[: module.out_features]
    if module.kind == "fp4":  # (MXFP4: E2M1's values under a power of two a group)
        q = E2M1[module.unpacked().long()].float().reshape(module.values.shape[0], -1, module.group)
        w = q * module.powers().t()[..., None]
        return w.reshape(module.values.shape[0], -1)[: module.out_features]
    if module.kind == "int8" and module.layout == "vnni":  # (8 bits a value, a scale and zero per group)
        held = module.scales.float()
        scales, zeros = held.unbind(-1) if held.dim() == 3 else (held, torch.zeros_like(held))  # [groups, out] each
        q = module.unpacked().float().reshape(module.values.shape[0], -1, module.group)
        w = q * scales.t()[..., None] + zeros.t()[..., None]
        return w.reshape(module.values.shape[0], -1)[: module.out_features]
    if module.kind == "int8":
        return module.values.float() * module.scales.float()[:, None]
    if module.layout == "vnni":
        held = module.scales.float()
        scales, zeros = held.unbind(-1) if held.dim() == 3 else (held, torch.zeros_like(held))  # [groups, out] each
        q = module.unpacked().float().reshape(module.values.shape[0], -1, module.group)
        w = (q - 8) * scales.t()[..., None] + zeros.t()[..., None]
        return w.reshape(module.values.shape[0], -1)[: module.out_features]
    eye = torch.eye(module.in_features, dtype=ACTIVATIONS, device=module.values.device)
    full = _kernel("int4", module.values.device, module.group, module.values, module.scales)(eye).float().t()
    return full[: module.out_features]


def linear_layers(model: torch.nn.Module):
    """(parent, attribute, module) of each projection a model's forward runs: torch's Linear and GPT-2's Conv1D."""
    for name, module in model.named_modules():
        for attribute, child in module.named_children():
            if type(child).__name__ in packing.PACKABLE and getattr(child, "weight", None) is not None:
                yield module, attribute, child


def quantize_model(model: torch.nn.Module, kind: str, copies: Path | None = None) -> int:
    """Replace every projection (the output head too, untied from the embedding) by its `kind` quantized form;
    returns how many were replaced. With `copies` (a folder; CPU only), a model quantized before is read back
    from its copy there instead (`_copy_name`), and one quantized now is kept there: quantizing costs seconds a
    load, reading the copy a fraction of that."""
    device = next(model.parameters()).device
    names = {id(module): name for name, module in model.named_modules()}
    layers = [(f"{names[id(parent)]}.{attribute}", parent, attribute, child)
              for parent, attribute, child in linear_layers(model)]
    copy = copies / _copy_name(layers, kind, device) if copies is not None and device.type == "cpu" else None
    kept = _read_copy(copy, device) if copy is not None else None
    if kept is not None and _put_copy(layers, kept):
        return len(kept)
    replaced = {}
    for name, parent, attribute, child in layers:
        weight = child.weight.detach()
        if type(child).__name__ == "Conv1D":
            weight = weight.t()
        bias = getattr(child, "bias", None)
        bias = None if bias is None else bias.detach()
        if kind == "int4":
            if weight.shape[1] % GROUP:
                continue
            nibbles, scales, zeros = int4_of(weight)
            new = Quantized.int4(nibbles, scales, zeros, device, bias, source="int4")
        else:
            values, scales = int8_of(weight)
            new = Quantized.int8(values, scales, device, bias, source="int8")
        setattr(parent, attribute, new)
        replaced[name] = new
    if copy is not None:
        _write_copy(copy, replaced)
    return len(replaced)


COPY_FORMAT = 1
SAMPLE = 4096  # values of each weight that name a model's copy


def _copy_name(layers, kind: str, device: torch.device) -> str:
    """A quantized copy's file name: a hash of what decides its contents: the kind, the kernel's layout, the
    versions, and the weights themselves (each one's name, shape, dtype and 4,096 of its values, evenly
    spaced: a model fine-tuned from another differs in all of them), so no model is ever given another's."""
    layout = int4_layout(device) if kind == "int4" else "torch"
    digest = hashlib.sha256(json.dumps([COPY_FORMAT, kind, layout, device.type, torch.__version__]).encode())
    for name, _, _, child in layers:
        weight = child.weight.detach()
        flat = weight.reshape(-1)
        digest.update(f"{name} {tuple(weight.shape)} {weight.dtype}".encode())
        digest.update(flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].float().cpu().numpy().tobytes())
    return f"{kind}-{digest.hexdigest()[:24]}.pt"


def _read_copy(path: Path, device: torch.device) -> dict | None:
    try:
        kept = torch.load(path, map_location=device, weights_only=True)
    except Exception:  # (none yet, or unreadable: quantized again, and written anew)
        return None
    used(path)
    return kept


def _put_copy(layers, kept: dict) -> bool:
    """Put a copy's projections in place of the model's; False (nothing changed) when the copy does not fit."""
    places = {name: (parent, attribute) for name, parent, attribute, _ in layers}
    try:
        modules = {name: Quantized(**fields) for name, fields in kept.items()}
    except (TypeError, ValueError):
        return False
    if not set(modules) <= set(places):
        return False
    for name, module in modules.items():
        setattr(*places[name], module)
    return True


def _write_copy(path: Path, replaced: dict[str, "Quantized"]) -> None:
    fields = {name: {"kind": m.kind, "values": m.values, "scales": m.scales, "out_features": m.out_features,
                     "in_features": m.in_features, "bias": m.bias, "group": m.group, "source": m.source,
                     "layout": m.layout} for name, m in replaced.items()}
    try:
        write_whole(path, lambda partial: torch.save(fields, partial))
    except OSError:  # a read-only or full cache: quantized again next time
        pass


def summary(model: torch.nn.Module) -> dict:
    """The weights' formats and bytes: {'format': 'int4+bfloat16', 'bytes': ..., 'quantized': n}."""
    kinds, total, quantized = set(), 0, 0
    seen = set()
    for module in model.modules():
        if isinstance(module, Quantized):
            kinds.add(module.kind)
            quantized += 1
            total += module.nbytes
    for tensor in list(model.parameters()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        kinds.add(str(tensor.dtype).removeprefix("torch."))
        total += tensor.numel() * tensor.element_size()
    for module in model.modules():  # an embedding read from a GGUF file's blocks (spec_cli.models.gguf.RowsFromBlocks)
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, torch.Tensor):
            kinds.add(getattr(module.block_kind, "name", "blocks"))
            total += blocks.numel() * blocks.element_size()
    order = {"fp4": 0, "int4": 1, "int6": 2, "int8": 3}
    return {"format": "+".join(sorted(kinds, key=lambda k: (order.get(k, len(order)), k))), "bytes": total,
            "quantized": quantized}
