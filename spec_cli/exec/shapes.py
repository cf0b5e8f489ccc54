"""How forwards are shaped: token counts padded to buckets, and how much of the cache is attended."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.core.hardware import cpu_has_fast_bf16

# A CPU's attention kernel takes keys in vector-wide chunks and a shorter tail another way (its exp rounds
# differently), so a row's result would depend on how far the forward it shares attends: an attended length
# rounded up to a multiple of this gives a row the same bits in a one-token step and in a verifying chain
# (measured in bfloat16 on a Xeon with AMX: lengths 8 apart already agree). Not in float32, where a row's
# products and attention also round by how many rows share them: there identity is not bitwise.
ALIGN = 64
# On CUDA a product's kernel (cuBLAS's, tinygemm's) and attention's split are chosen by the shape, so a row
# computed beside 0 or 15 others would round otherwise: every forward there runs this many rows (a longer one
# in pieces of it) and the head takes them all, one shape whatever the step, so a row's bits are its own.
# Padding rows cost little where a forward reads its weights once (bandwidth bound past this many rows)
ROWS = 64
# ... and this many for quantized products (tinygemm's int4 costs by the row: Qwen2.5-Coder-1.5B's shape on an H200,
# 3.6 ms a forward of 1 row, 5.6 of 16, 11.1 of 64), a longer forward (a prompt) in more pieces
QUANTIZED_ROWS = 16


def power_buckets(limit: int = 64) -> tuple[int, ...]:
    """1, 2, 4, ..., limit: the token counts of speculation (longer runs pad to a multiple of `limit`)."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


@dataclass(frozen=True)
class Shapes:
    """`tokens`: the counts a forward is padded up to (empty: never padded; past the largest, to a multiple of
    it); `span`: the attended cache length is rounded up to a multiple of this (0: always the whole capacity,
    1: exactly what is filled). A compiled step needs both static: buckets, and the whole capacity."""

    tokens: tuple[int, ...] = ()
    span: int = 1
    fixed: bool = False  # one shape: every forward exactly `tokens[0]` rows, a longer one in pieces (`one`)

    @classmethod
    def one(cls, rows: int = ROWS) -> "Shapes":
        """Every forward `rows` rows and the whole capacity attended: one kernel plan for every step."""
        return cls((rows,), 0, True)

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype, compiled: bool = False,
                   per_shape: bool = True, aligned: bool = True) -> "Shapes":
        """`per_shape`: whether the products build kernels per shape (oneDNN's do; torch's integer kernels for
        quantized weights do not, and cost by the row: on a CPU in blocks of 4, padding 5 rows to 8 costs 8 rows;
        on CUDA one shape of fewer rows);
        `aligned`: whether the attention is torch's CPU kernel, whose rows need an attended length in `ALIGN`s
        (spec's own sums each row alone: exactly what is filled)."""
        if device.type == "cuda":
            return cls.one(ROWS if per_shape else QUANTIZED_ROWS)
        if compiled:  # one kernel plan (one graph) per bucket
            return cls(power_buckets(), 0)
        if dtype != torch.float32:  # with AMX or AVX-512 BF16 oneDNN builds its kernels per shape: buckets
            return cls(power_buckets() if cpu_has_fast_bf16() and per_shape else (), ALIGN if aligned else 1)
        return cls((), 1)  # measured: no cold shapes in float32, and padding costs compute

    @property
    def static(self) -> bool:
        return bool(self.tokens) and self.span == 0

    def pad(self, n: int) -> int:
        if not self.tokens:
            return n
        for size in self.tokens:
            if size >= n:
                return size
        largest = self.tokens[-1]
        return -(-n // largest) * largest

    def attended(self, end: int, capacity: int) -> int:
        if self.span == 0:
            return capacity
        return min(capacity, -(-end // self.span) * self.span)
