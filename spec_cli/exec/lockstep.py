"""Several sequences decoded together: their runners' forwards of one model run as one.

Each sequence is decoded by its own thread, or its own greenlet of a cohort (a server's slots: `exec.cohort`),
with its own runners, caches and strategy, exactly as it would be alone. Where a runner would run a forward, it
hands its rows here and waits; once every taking part sequence is waiting (none is still doing host work), one
thread runs what they handed in: per model and skip set, one forward over all their rows
(`backends.grouped_forward`: each product once over every row, each sequence's attention over its own cache under
its own masks), then hands each its logits. Sequences join and leave between forwards; a long prompt comes in
pieces (`piece` tokens), and a round reads at most `prompt_rows` of prompts, first come first, so a crowd of new
prompts never stalls the others' steps long.

A row's bits depend only on its own inputs where the products are row-invariant (spec's CPU kernels in
bfloat16), so a sequence's tokens are the ones it gets alone (in float32 a product's rounding depends on its row
count, as a verified chain's does: close, not bitwise). A forward with one sequence is its runner's own.

One OpenMP team does the compute, the forwards' thread's (`exec.openmp`: where libgomp manages more threads than
CPUs, every team's threads sleep between parallel regions): the thread that makes a Lockstep gives its team back (the
models' loading made it), and a thread taking part does its host work (sampling, its caches' bookkeeping) in one
thread, making no team (a server's slots' thread, `exec.cohort`, for good, between requests too).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from spec_cli.exec import backends
from spec_cli.exec.openmp import give_back_team, threads_here

PIECE = 128  # prompt tokens a forward takes at most: a long prompt is prefilled between the others' steps
PROMPT_ROWS = 2 * PIECE  # prompt rows a round of shared forwards takes at most (beyond the first piece)
FEW = 8  # rows a read may have and still never wait
TIMED, TIMED_LEAST = 64, 8  # shared forwards a model's cost of a row is fitted on: the last so many, at least


@dataclass
class Handed:
    """One runner's rows, handed in for the next shared forward, and what comes back."""

    runner: object
    batch: object
    skip: object
    span: int
    plain: bool
    last: int | None
    reading: bool = False  # a prompt's piece (budgeted), not a decoding step
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)


@dataclass
class Counts:
    """What the shared forwards ran: forwards, sequences and rows in all (rows per forward = rows / forwards)."""

    forwards: int = 0
    sequences: int = 0
    rows: int = 0
    seconds: float = 0.0
    widest: int = 0  # the most sequences in one forward


class Lockstep:
    def __init__(self, piece: int = PIECE, prompt_rows: int = PROMPT_ROWS):
        self.piece, self.prompt_rows = piece, prompt_rows
        give_back_team()
        self.lock = threading.Lock()
        self.busy = 0  # threads taking part and doing host work (not waiting here)
        self.holding = 0  # of them, cohorts' turns (`taking_part(sequence=False)`): no sequence of their own
        self.pending: list[Handed] = []
        self.work: queue.SimpleQueue = queue.SimpleQueue()  # forwards for the forwards' thread, in order
        self.thread: threading.Thread | None = None
        self.counts = Counts()
        self._leans: dict = {}  # (model, words) -> the lean loop its runners share
        self._timed: dict = {}  # lean loop -> its recent shared forwards: (rows, seconds)
        self._slopes: dict = {}  # lean loop -> (its forwards counted then, `row_seconds` then): once a forward
        self.waits: dict[int, Callable[[Handed], None]] = {}  # thread -> how it waits for a forward (`exec.cohort`)
        self.woken: list[Callable[[], None]] = []  # called once a forward is back (a cohort resumes its sequences)

    def lean(self, model, words, build):
        """The lean loop of `model` (with the draft's `words`) that its runners share: its packed weights once."""
        key = (id(model), None if words is None else tuple(words.tolist()))
        with self.lock:
            if key not in self._leans:
                self._leans[key] = (model, build())  # (the model kept: its id stays its own)
            return self._leans[key][1]

    @contextmanager
    def taking_part(self, sequence: bool = True):
        """The calling thread decodes a sequence until the block ends: shared forwards wait for its rows. Its own
        torch work runs in one thread meanwhile (no OpenMP team of its own). `sequence` False: it only holds the
        forwards back until the sequences it runs have handed in (a cohort's turn), and is not counted as one."""
        with self.lock:
            self.busy += 1
            self.holding += not sequence
        threads = threads_here(1)
        try:
            yield self
        finally:
            threads_here(threads)
            with self.lock:
                self.busy -= 1
                self.holding -= not sequence
                self._hand_over()

    def row_seconds(self, lean) -> float | None:
        """What one more row adds to a shared forward of `lean`'s model: the slope of seconds over rows across
        its recent forwards (least squares; None until they are enough and of more than one size)."""
        seen = self.counts.forwards  # (read before the timings: a forward counted meanwhile makes the next call fit)
        kept = self._slopes.get(id(lean))
        if kept is not None and kept[0] == seen:  # (every slot asks at every step: ~26 us a fit, in the GIL)
            return kept[1]
        timed = list(self._timed.get(id(lean), ()))
        slope = None
        if len(timed) >= TIMED_LEAST:
            mean_rows = sum(r for r, _ in timed) / len(timed)
            mean_seconds = sum(s for _, s in timed) / len(timed)
            spread = sum((r - mean_rows) ** 2 for r, _ in timed)
            if spread:
                slope = max(0.0, sum((r - mean_rows) * (s - mean_seconds) for r, s in timed) / spread)
        self._slopes[id(lean)] = (seen, slope)
        return slope

    @property
    def taking(self) -> int:
        """Sequences taking part now (working or waiting for a forward): the company a step is priced for (a
        cohort's turn is none: counted, a lone request in a server of several slots was priced as one of two, and
        speculated at 1.1-1.2 tokens an oracle forward where alone it took 4.3-4.7)."""
        return self.busy - self.holding + len(self.pending)

    def run(self, runner, batch, skip, span: int, plain: bool, last: int | None,
            reading: bool = False) -> torch.Tensor:
        """`runner`'s logits of `batch` (as `Runner._step` gives them), computed in a forward shared with the
        rows the other taking part threads hand in (`reading`: a prompt's piece, which may wait a round)."""
        handed = Handed(runner, batch, skip, span, plain, last, reading)
        with self.lock:
            self.pending.append(handed)
            self.busy -= 1
            self._hand_over()
        wait = self.waits.get(threading.get_ident())
        if wait is not None:  # (a cohort's sequence: it gives way to the others in its thread)
            wait(handed)
        else:
            handed.ready.wait()  # (each its own event: no crowd of threads woken to retake one lock)
        if handed.error is not None:
            raise handed.error
        return handed.logits

    def _hand_over(self) -> None:
        """(under the lock) Once no thread is still working, everything handed in goes to the forwards' thread."""
        if self.busy > 0 or not self.pending:
            return
        taken, self.pending = self._budgeted(self.pending)
        self.busy += len(taken)  # (each thread works again once its logits are back)
        if self.thread is None:
            self.thread = threading.Thread(target=self._forwards, name="spec-forwards", daemon=True)
            self.thread.start()
        self.work.put(taken)

    def _budgeted(self, pending: list[Handed]) -> tuple[list[Handed], list[Handed]]:
        """(what runs now, what waits): every step, and prompt pieces in the order they came while they fit in
        `prompt_rows` (the first always runs): a crowd of new prompts is read a few at a time, first come first,
        so the first of them start generating early and the others' steps are never long stalled."""
        now, later, used = [], [], 0
        for handed in pending:
            rows = len(handed.batch)
            if not handed.reading or rows <= FEW:  # (a step catching up a few tokens: never held back)
                now.append(handed)
            elif not used or used + rows <= self.prompt_rows:
                now.append(handed)
                used += rows
            else:
                later.append(handed)
        return now, later

    def _forwards(self) -> None:
        """The one thread that runs the shared forwards: one team of compute threads, not one per slot (an idle
        team's threads spin a while after each forward, on the cores the next forward needs)."""
        while True:
            self._run(self.work.get())

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
                if handed.logits is None:
                    handed.error = e
        finally:
            for handed in taken:
                handed.ready.set()
            for wake in list(self.woken):
                wake()

    def _forward(self, group: list[Handed]) -> None:
        started = time.perf_counter()
        first = group[0].runner
        if len(group) == 1:  # alone this time: its runner's own forward (whole layers a call), the same bits
            h = group[0]
            h.logits = first._step(h.batch, h.skip, h.span, h.plain, h.last)
            self._count(group, started)
            return
        parts = [h.runner.part(h.batch, h.span, h.plain, h.last) for h in group]
        out = backends.grouped_forward(first.lean, parts, first.windows, group[0].skip)
        for handed, (logits, normed) in zip(group, out):
            handed.logits = logits
            if handed.runner.keeps_hidden:  # (what its head read: a model alone's fitted heads read it next)
                handed.runner.hidden = normed
        self._count(group, started)

    def _count(self, group: list[Handed], started: float) -> None:
        rows, seconds = sum(len(h.batch) for h in group), time.perf_counter() - started
        self._timed.setdefault(id(group[0].runner.lean), deque(maxlen=TIMED)).append((rows, seconds))
        counts = self.counts
        counts.forwards += 1
        counts.sequences += len(group)
        counts.rows += rows
        counts.widest = max(counts.widest, len(group))
        counts.seconds += seconds
