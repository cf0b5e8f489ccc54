"""Several sequences decoded together: their runners' forwards of one model run as one.

Each sequence is decoded by its own thread (a server's slot) with its own runners, caches and strategy, exactly
as it would be alone. Where a runner would run a forward, it hands its rows here and waits; once every taking
part thread is waiting (none is still doing host work), the last to arrive runs what they handed in: per model
and skip set, one forward over all their rows (`backends.grouped_forward`: each product once over every row,
each sequence's attention over its own cache under its own masks), then hands each its logits. Threads join
and leave between forwards; a long prompt comes in pieces (`piece` tokens) so it never stalls the others long.

A row's bits depend only on its own inputs where the products are row-invariant (spec's CPU kernels in
bfloat16), so a sequence's tokens are the ones it gets alone; a lone sequence runs the same grouped forward.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from spec_cli.exec import backends

PIECE = 128  # prompt tokens a forward takes at most: a long prompt is prefilled between the others' steps


@dataclass
class Handed:
    """One runner's rows, handed in for the next shared forward, and what comes back."""

    runner: object
    batch: object
    skip: object
    span: int
    plain: bool
    last: int | None
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class Counts:
    """What the shared forwards ran: forwards, sequences and rows in all (rows per forward = rows / forwards)."""

    forwards: int = 0
    sequences: int = 0
    rows: int = 0
    seconds: float = 0.0
    widest: int = 0  # the most sequences in one forward


class Lockstep:
    def __init__(self, piece: int = PIECE):
        self.piece = piece
        self.lock = threading.Condition()
        self.busy = 0  # threads taking part and doing host work (not waiting here)
        self.pending: list[Handed] = []
        self.counts = Counts()
        self._leans: dict = {}  # (model, words) -> the lean loop its runners share

    def lean(self, model, words, build):
        """The lean loop of `model` (with the draft's `words`) that its runners share: its packed weights once."""
        key = (id(model), None if words is None else tuple(words.tolist()))
        with self.lock:
            if key not in self._leans:
                self._leans[key] = (model, build())  # (the model kept: its id stays its own)
            return self._leans[key][1]

    @contextmanager
    def taking_part(self):
        """The calling thread decodes a sequence until the block ends: shared forwards wait for its rows."""
        with self.lock:
            self.busy += 1
        try:
            yield self
        finally:
            with self.lock:
                self.busy -= 1
                ready = self._ready()
            if ready:
                self._run(ready)

    @property
    def taking(self) -> int:
        """Threads taking part now (working or waiting for a forward)."""
        return self.busy + len(self.pending)

    def run(self, runner, batch, skip, span: int, plain: bool, last: int | None) -> torch.Tensor:
        """`runner`'s logits of `batch` (as `Runner._step` gives them), computed in a forward shared with the
        rows the other taking part threads hand in. A thread not taking part runs alone."""
        handed = Handed(runner, batch, skip, span, plain, last)
        with self.lock:
            self.pending.append(handed)
            self.busy -= 1
            ready = self._ready()
        if ready:
            self._run(ready)
        with self.lock:
            while not handed.done:
                self.lock.wait()
        if handed.error is not None:
            raise handed.error
        return handed.logits

    def _ready(self) -> list[Handed]:
        """(under the lock) Everything handed in, taken, once no thread is still working: the caller runs it."""
        if self.busy > 0 or not self.pending:
            return []
        taken, self.pending = self.pending, []
        self.busy += len(taken)  # (each thread works again once its logits are back)
        return taken

    @torch.inference_mode()  # (grad mode is per thread: the runners' caches are inference tensors)
    def _run(self, taken: list[Handed]) -> None:
        groups: dict = {}
        for handed in taken:
            groups.setdefault((id(handed.runner.lean), handed.skip), []).append(handed)  # (one model, one skip set)
        try:
            for group in groups.values():
                self._forward(group)
        except BaseException as e:  # noqa: BLE001 - every waiting thread gets it
            for handed in taken:
                if not handed.done:
                    handed.error = e
        finally:
            with self.lock:
                for handed in taken:
                    handed.done = True
                self.lock.notify_all()

    def _forward(self, group: list[Handed]) -> None:
        started = time.perf_counter()
        first = group[0].runner
        parts = []
        for handed in group:
            store, masks = handed.runner.prepare(handed.batch, handed.span, handed.plain)
            parts.append(backends.Part(handed.batch.ids[None], handed.batch.positions[None], store, masks,
                                       handed.last))
        logits = backends.grouped_forward(first.lean, parts, first.windows, group[0].skip)
        for handed, rows in zip(group, logits):
            handed.logits = rows
        counts = self.counts
        counts.forwards += 1
        counts.sequences += len(group)
        counts.rows += sum(len(h.batch) for h in group)
        counts.widest = max(counts.widest, len(group))
        counts.seconds += time.perf_counter() - started
