"""llama.cpp's 4-bit blocks read straight into spec's int4 layout, value for value.

Each block holds 32 weights of a row as 4-bit values with a scale and an offset (Q4_K: eight such sub-blocks of
32 under two half-precision factors). spec's int4 kernel computes w = (q - 8) * scale + zero per group of 32, so:
  Q4_0  w = (q - 8) * d         scale d,      zero 0
  Q4_1  w = q * d + m           scale d,      zero m + 8 d
  Q4_K  w = d sc q - dmin mn    scale d sc,   zero 8 d sc - dmin mn
The values are the file's own; only the scale and zero are rounded, to the kernel's bfloat16
(tests/test_quant.py measures what that costs against the file's own dequantization).
"""

from __future__ import annotations

import numpy as np
import torch

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]


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
        packed = blocks[..., 4:16].reshape(rows, -1, 3, 4)
        low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sc = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], -1).astype(np.float32)
        mn = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], -1).astype(np.float32)
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
