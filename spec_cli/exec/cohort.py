"""Many sequences decoded by one thread, each in its own greenlet, their forwards shared (`exec.lockstep`).

As threads, a server's slots each wait for the shared forward and then all wake at once: a trip through the
kernel's scheduler each, and a fight for the GIL at every torch call, which lets go of it (pyfam, 16 slots:
13.6-14.9 ms between forwards of ~15, against ~8 of the slots' own work). Here one thread holds them all: where a
sequence would wait for its logits, its greenlet gives way to the next; once a forward is back, each sequence it
served resumes in turn, in the order they handed in, and runs until its next forward or its end.

The thread is the cohort's own (`serving`): in inference mode throughout (torch's grad mode is the thread's,
so every sequence must see the same), its torch work in one OpenMP thread (the forwards' thread computes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch
from greenlet import greenlet

from spec_cli.exec.lockstep import Handed, Lockstep
from spec_cli.exec.openmp import threads_here


class Cohort:
    def __init__(self, lockstep: Lockstep):
        self.lockstep = lockstep
        self.waiting: dict[greenlet, Handed] = {}  # a sequence waiting for its logits, in the order handed in
        self.live: set[greenlet] = set()  # sequences started and not ended
        self.woken = threading.Event()  # a forward is back, or `wake` was called
        self._hub: greenlet | None = None  # the thread's own greenlet, which starts and resumes the others

    @contextmanager
    def serving(self):
        """The calling thread runs the cohort until the block ends (`start`, `resume`, `wait`)."""
        self._hub = greenlet.getcurrent()
        ident = threading.get_ident()
        self.lockstep.waits[ident] = self._wait
        self.lockstep.woken.append(self.wake)
        threads = threads_here(1)
        try:
            with torch.inference_mode():
                yield self
        finally:
            threads_here(threads)
            del self.lockstep.waits[ident]
            self.lockstep.woken.remove(self.wake)
            self._hub = None

    def turn(self):
        """The thread's own part (a context): the sequences it starts or resumes in the block hand their rows in
        together, for one forward once the block ends (started one by one, each would run its own). It holds the
        forward back, but is no sequence: a step's company is the sequences alone."""
        return self.lockstep.taking_part(sequence=False)

    def start(self, work: Callable[..., object], *args) -> None:
        """Run `work(*args)` as a new sequence, until its first forward or its end. `work` catches its own errors:
        one raised ends the cohort's thread too (from this call or `resume`)."""
        task = greenlet(work)
        self.live.add(task)
        self._switch(task, *args)

    def resume(self) -> None:
        """Run every sequence whose logits are back, each until its next forward or its end."""
        for task, handed in list(self.waiting.items()):
            if handed.ready.is_set():
                del self.waiting[task]
                self._switch(task)

    def wait(self, timeout: float | None = None) -> None:
        """Until a forward is back or `wake` is called (at most `timeout` seconds)."""
        self.woken.wait(timeout)
        self.woken.clear()  # (a forward back after this wakes the next wait; one before it, `resume` sees)

    def run(self, works: list[Callable[[], object]]) -> None:
        """(the calling thread) Each of `works` as a sequence, all started in one turn, until every one has ended
        (each catches its own errors, as `start` says)."""
        with self.serving():
            with self.turn():
                for work in works:
                    self.start(work)
            while self.live:
                self.wait(timeout=1.0)
                with self.turn():
                    self.resume()

    def wake(self) -> None:
        """(any thread) End the cohort's `wait`: a forward is back, or there is new work."""
        self.woken.set()

    def _switch(self, task: greenlet, *args) -> None:
        try:
            task.switch(*args)
        finally:
            if task.dead:
                self.live.discard(task)

    def _wait(self, handed: Handed) -> None:
        """(Lockstep.run, in one of the cohort's sequences) Give way until `handed`'s logits are back."""
        self.waiting[greenlet.getcurrent()] = handed
        self._hub.switch()
