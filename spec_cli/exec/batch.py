"""One forward's rows as device tensors, and the attention masks built from them on the device.

A row is a token to run: its id, its position, the cache slot it writes, how many slots from 0 it sees
(`limit`: the committed prefix, or for a token being committed everything up to itself), and the scratch
slots it sees besides (`ancestry`: bits over the scratch region that starts at `limit`, its own ancestors
and itself). Everything a step needs is in these tensors, so the traced step is the same function for every
step of a bucket: nothing in it depends on a Python value that changes per step.

An eager step may use what the host knows besides (`first`, `scratch`): on a small model every tensor op
counts, and a chain needs neither limits nor ancestry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 32  # ancestry bits per word (int64 words: no sign bit in play)
WORDS = 16  # scratch slots a tree may hold: WORDS * BITS


@dataclass
class Batch:
    ids: torch.Tensor  # [rows] token ids
    positions: torch.Tensor  # [rows]
    slots: torch.Tensor  # [rows] where each row writes its keys and values
    limits: torch.Tensor  # [rows] slots 0..limit-1 are seen
    ancestry: torch.Tensor | None  # [rows, WORDS] scratch slots seen besides, as bits from slot `limit` on
    first: int | None = None  # eager: the rows are the chain of slots first.. (no limits, no ancestry)
    scratch: int | None = None  # eager: where every row's ancestry bits start (each row's limit, or 0 bits)
    writes: int | None = None  # eager: the rows write slots writes.. in order (a tree's rows too: sliced, not indexed)

    def __len__(self) -> int:
        return self.ids.shape[0]


def chain(ids: torch.Tensor, start: int, pad: int, capacity: int, eager: bool = False) -> Batch:
    """Rows that each follow the one before, from slot `start`, after `pad` padding rows: built on the device
    from the start alone (no upload). Padding rows sit at position 0, write past the capacity, see slot 0."""
    device, n = ids.device, ids.shape[0]
    real = torch.arange(start, start + n, device=device)
    if eager and not pad:
        return Batch(ids, real, real, None, None, first=start)
    if pad:
        ids = torch.cat([ids.new_zeros(pad), ids])
        positions = torch.cat([real.new_zeros(pad), real])
        slots = torch.cat([torch.arange(capacity, capacity + pad, device=device), real])
        limits = torch.cat([real.new_ones(pad), real + 1])
    else:  # (a copy made here, like every other input of the step: a compiled step sees one kind of tensor)
        ids, positions, slots, limits = ids.clone(), real, real, real + 1
    return Batch(ids, positions, slots, limits, torch.zeros(pad + n, WORDS, dtype=torch.long, device=device))


def packed(rows: list[tuple[int, int, int, int]], ids: torch.Tensor | None, extra: list[int],
           device: torch.device, scratch: int | None = None) -> tuple[Batch, torch.Tensor]:
    """Rows given on the host as (id, position, slot, limit) and ancestry bits, sent in one upload (with
    `extra`, other host data the step needs, returned as a device tensor). `ids` (on the device) replaces
    the first ids of the rows. `scratch` (eager only): the slot every row's ancestry starts at."""
    flat = []
    empty = [0] * WORDS
    for row in rows:
        flat.extend(row[:4])
        bits = row[4]
        words = [(bits >> (BITS * w)) & 0xFFFFFFFF for w in range(-(-bits.bit_length() // BITS))]
        flat.extend(words)
        flat.extend(empty[len(words):])
    data = torch.tensor(flat + extra, dtype=torch.long, device=device)
    table = data[: len(flat)].view(len(rows), 4 + WORDS)
    if scratch is None:  # a compiled step sees the same strides however a batch was built
        columns, ancestry = table.t().contiguous(), table[:, 4:].contiguous()
    else:
        columns, ancestry = table.t(), table[:, 4:]
    batch = Batch(columns[0], columns[1], columns[2], columns[3], ancestry, scratch=scratch)
    if ids is not None:
        batch.ids = torch.cat([ids, batch.ids[ids.shape[0]:]])
    return batch, data[len(flat):]


def allowed(batch: Batch, span: int, slot_positions: torch.Tensor, windows, cols: torch.Tensor) -> dict:
    """Boolean masks [rows, span] per attention window (None: full attention); `cols`: 0, 1, 2, ... (at least
    `span` and `BITS` of them)."""
    shifts, cols = cols[:BITS], cols[:span]
    if batch.first is not None:  # a chain: each row sees every slot up to its own
        seen = cols[None, :] <= batch.positions[:, None]
    elif batch.scratch is not None:  # the host knows where the scratch starts: its bits go there, unshifted
        seen = cols[None, :] < batch.limits[:, None]
        width = min(span - batch.scratch, BITS * WORDS)
        if width > 0:
            words = batch.ancestry[:, : -(-width // BITS)]
            bits = ((words[:, :, None] >> shifts) & 1).view(len(batch), -1)[:, :width]
            seen[:, batch.scratch : batch.scratch + width] |= bits.bool()
    else:
        seen = cols[None, :] < batch.limits[:, None]
        offset = cols[None, :] - batch.limits[:, None]
        inside = (offset >= 0) & (offset < BITS * WORDS)
        offset = offset.clamp(0, BITS * WORDS - 1)
        word = batch.ancestry.gather(1, offset // BITS)
        seen = seen | (inside & ((word >> (offset % BITS)) & 1).bool())
    found = {None: seen}
    keys = slot_positions[:span]
    for window in {w for w in windows if w}:
        found[window] = seen & (keys[None, :] > batch.positions[:, None] - window)
    return found
