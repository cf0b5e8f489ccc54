"""llama.cpp's blocks read straight into spec's int4 and 8-bit layouts, value for value.

Each block holds 32 weights of a row as 4-bit values with a scale and an offset (Q4_K: eight such sub-blocks of
32 under two half-precision factors). spec's int4 kernel computes w = (q - 8) * scale + zero per group of 32, so:
  Q4_0  w = (q - 8) * d         scale d,      zero 0
  Q4_1  w = q * d + m           scale d,      zero m + 8 d
  Q4_K  w = d sc q - dmin mn    scale d sc,   zero 8 d sc - dmin mn
The 5-, 6- and 8-bit blocks go to the 8-bit kernel, w = q * scale + zero (q a signed byte) per group of 32
(Q6_K: 16, its sub-blocks):
  Q8_0  w = d q                 q,            scale d,      zero 0
  Q5_0  w = (q - 16) d          q - 16,       scale d,      zero 0
  Q5_1  w = q d + m             q,            scale d,      zero m
  Q5_K  w = d sc q - dmin mn    q,            scale d sc,   zero -dmin mn
  Q6_K  w = d sc (q - 32)       q - 32,       scale d sc,   zero 0
The values are the file's own; only the scale and zero are rounded, to the kernel's bfloat16
(tests/test_quant.py measures what that costs against the file's own dequantization). Q6_K has a kernel of its
own (`q6_k`, spec's int6): its 6-bit values, 8-bit scales and half-precision super-block scales as they are;
Q4_K, on spec's kernel, its scales and mins as they are too (`q4_k`).
"""

from __future__ import annotations

import numpy as np
import torch

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
EIGHT_BIT = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")  # (on the 8-bit kernel)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight 6-bit scales and mins of a super-block, from their 12 bytes [..., 12]."""
    packed = packed.reshape(*packed.shape[:-1], 3, 4)
    low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], -1).astype(np.float32)
    mn = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], -1).astype(np.float32)
    return sc, mn


def _values(qs: np.ndarray) -> np.ndarray:
    """32 values from 16 bytes: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 15, qs >> 4], -1)


def int4(kind: str, raw: np.ndarray, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles [rows, columns / 2] uint8 with the even input high, scales and zeros [rows, columns / 32] float32)
    of a Q4_0, Q4_1 or Q4_K tensor's raw bytes ([rows, bytes per row] uint8, as gguf's reader gives them)."""
    raw = np.ascontiguousarray(raw).reshape(rows, -1)
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(rows, -1, size)
        d = _halves(blocks, 0)
        values = _values(blocks[..., size - 16:])
        scales, zeros = d, (np.zeros_like(d) if kind == "Q4_0" else _halves(blocks, 2) + 8 * d)
    elif kind == "Q4_K":
        blocks = raw.reshape(rows, -1, 144)
        d, dmin = _halves(blocks, 0), _halves(blocks, 2)
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # four runs of 64 values: low nibbles, then high
        values = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15
        values = values.reshape(rows, -1, 32)
        scales = (d[..., None] * sc).reshape(rows, -1)
        zeros = (8 * scales - (dmin[..., None] * mn).reshape(rows, -1))
    else:
        raise ValueError(f"not a 4-bit block type: {kind}")
    values = values.reshape(rows, columns)
    nibbles = (values[:, ::2] << 4) | values[:, 1::2]
    return (torch.from_numpy(np.ascontiguousarray(nibbles)), torch.from_numpy(scales.reshape(rows, -1).copy()),
            torch.from_numpy(np.ascontiguousarray(zeros.reshape(rows, -1))))


def q4_k(raw: np.ndarray, rows: int, columns: int) -> tuple[torch.Tensor, ...]:
    """(nibbles [rows, columns / 2] uint8 with the even input high, sc and mn [rows, columns / 32] uint8, d and
    dmin [rows, columns / 256] float16) of a Q4_K tensor's raw bytes, w = d sc q - dmin mn: what spec's int4
    kernel holds with super-block scales (`Quantized.int4_super`), the file's own numbers."""
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 144)
    d, dmin = (blocks[..., at:at + 2].copy().view(np.float16)[..., 0] for at in (0, 2))
    sc, mn = (t.astype(np.uint8) for t in _k_scales(blocks[..., 4:16]))
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # four runs of 64 values: low nibbles, then high
    values = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15).reshape(rows, columns)
    nibbles = (values[:, ::2] << 4) | values[:, 1::2]
    return tuple(torch.from_numpy(np.ascontiguousarray(t.reshape(rows, -1))) for t in (nibbles, sc, mn, d, dmin))


def permute_rows(tensors, order: np.ndarray):
    """The same rows of each tensor, in `order` (llama's query and key rows, which llama.cpp interleaves)."""
    index = torch.from_numpy(np.ascontiguousarray(order))
    return tuple(t[index].contiguous() for t in tensors)


def q8_halves(raw: np.ndarray, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor (w = d q, q 8-bit signed) as int4 over its inputs twice: q = 16 hi + lo with hi = q >> 4
    (-8..7) and lo = q & 15, so the first half holds hi + 8 with scale 16 d and zero 0, the second lo with scale
    d and zero 8 d; a product over [x, x] sums both in one kernel call, accumulated in float32."""
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 34)
    d = _halves(blocks, 0)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, columns).astype(np.int16)
    high, low = (q >> 4) + 8, q & 15
    values = np.concatenate([high, low], 1).astype(np.uint8)
    nibbles = (values[:, ::2] << 4) | values[:, 1::2]
    scales = np.concatenate([16 * d, d], 1)
    zeros = np.concatenate([np.zeros_like(d), 8 * d], 1)
    return torch.from_numpy(np.ascontiguousarray(nibbles)), torch.from_numpy(scales), torch.from_numpy(zeros)


def q6_k(raw: np.ndarray, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [rows, columns] int8 (-32..31), sc [rows, columns / 16] int8, d [rows, columns / 256] float16) of a
    Q6_K tensor's raw bytes, w = d sc q: what spec's 6-bit kernel holds, the file's own numbers."""
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 210)
    low = blocks[..., :128].reshape(rows, -1, 2, 1, 64)  # per half of 128 values: 64 bytes of low nibbles
    low = ((low >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15).reshape(rows, -1, 2, 4, 32)
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)  # per half: 32 bytes of four 2-bit pairs
    high = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    values = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = blocks[..., 192:208].copy().view(np.int8)
    d = blocks[..., 208:210].copy().view(np.float16)
    return (torch.from_numpy(np.ascontiguousarray(values.reshape(rows, columns))),
            torch.from_numpy(np.ascontiguousarray(sc.reshape(rows, -1))),
            torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))))


def mxfp4(raw: np.ndarray, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nibbles [rows, columns / 2] (two a byte, the even input high), exponents [rows, columns / 32] uint8) of an
    MXFP4 tensor's raw bytes (a block: an exponent byte e, then 16 bytes of indices, value j low and j + 16 high),
    w = E2M1[q] * 2^(e - 128) (`quant.E2M1`, doubled): the file's own numbers."""
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 17)
    qs = blocks[..., 1:]
    values = np.concatenate([qs & 15, qs >> 4], -1).reshape(rows, columns)
    nibbles = (values[:, ::2] << 4) | values[:, 1::2]
    return torch.from_numpy(np.ascontiguousarray(nibbles)), torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))


def group_of(kind: str) -> int:
    """The inputs an 8-bit kind's scale covers."""
    return 16 if kind == "Q6_K" else 32


def int8(kind: str, raw: np.ndarray, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(values [rows, columns] int8, scales and zeros [rows, columns / group] float32, group) of a Q8_0, Q5_0,
    Q5_1, Q5_K or Q6_K tensor's raw bytes ([rows, bytes per row] uint8, as gguf's reader gives them)."""
    raw = np.ascontiguousarray(raw).reshape(rows, -1)
    group = group_of(kind)
    if kind == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        d = _halves(blocks, 0)
        values, scales, zeros = blocks[..., 2:].copy().view(np.int8), d, np.zeros_like(d)
    elif kind in ("Q5_0", "Q5_1"):
        size = 22 if kind == "Q5_0" else 24
        blocks = raw.reshape(rows, -1, size)
        d = _halves(blocks, 0)
        high = blocks[..., size - 20:size - 16].copy().view(np.uint32)  # [rows, blocks, 1]: bit j is value j's 5th
        fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (_values(blocks[..., size - 16:]) | (fifth << 4)).astype(np.int8)
        if kind == "Q5_0":
            values, scales, zeros = q - 16, d, np.zeros_like(d)
        else:
            values, scales, zeros = q, d, _halves(blocks, 2)
    elif kind == "Q5_K":
        blocks = raw.reshape(rows, -1, 176)
        d, dmin = _halves(blocks, 0), _halves(blocks, 2)
        sc, mn = _k_scales(blocks[..., 4:16])
        high = blocks[..., 16:48].reshape(rows, -1, 1, 32)  # bit j of byte i: the 5th bit of sub-block j's value i
        fifth = (high >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        qs = blocks[..., 48:].reshape(rows, -1, 4, 1, 32)  # four runs of 64 values: low nibbles, then high
        low = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15).reshape(rows, -1, 8, 32)
        values = (low | (fifth << 4)).astype(np.int8)
        scales = (d[..., None] * sc).reshape(rows, -1)
        zeros = -(dmin[..., None] * mn).reshape(rows, -1)
    elif kind == "Q6_K":
        values, sc, d = (t.numpy() for t in q6_k(raw, rows, columns))
        scales = (d.astype(np.float32).repeat(16, 1) * sc).reshape(rows, -1)
        zeros = np.zeros_like(scales)
    else:
        raise ValueError(f"not an 8-bit kernel's block type: {kind}")
    return (torch.from_numpy(np.ascontiguousarray(values.reshape(rows, columns))),
            torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1))),
            torch.from_numpy(np.ascontiguousarray(zeros.reshape(rows, -1))), group)
