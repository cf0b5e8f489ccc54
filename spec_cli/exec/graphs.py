"""CUDA graphs over a compiled step, as SGLang's graph runners keep them: each (skip set, token bucket) is
captured once into fixed input buffers, then replayed with the inputs copied in and the logits copied out.

Not torch.compile's own cudagraph trees (mode="reduce-overhead"): a tree's outputs are overwritten by the next
replay while a strategy still holds them (the draft's logits across the oracle's forward), its KV caches are
inputs it would have to be told are static, and the order of buckets changes every step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from spec_cli.core.errors import described


class Captured:
    """One captured step: the buffers it reads, the output it writes, and how to run it again."""

    def __init__(self, replay: Callable[[], None], inputs: list[torch.Tensor], output: torch.Tensor):
        self.replay, self.inputs, self.output = replay, inputs, output


def cuda_capture(fn: Callable, inputs: list[torch.Tensor], pool) -> Captured:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn(*inputs)
    return Captured(graph.replay, inputs, output)


def replay_capture(fn: Callable, inputs: list[torch.Tensor], pool: list) -> Captured:
    """What a capture means, on any device: the step run again on the same buffers into the same output, which
    (like every output in a shared pool) the next replay of any step overwrites. The tests' stand-in for a
    CUDA graph: a step that read anything but its buffers, or logits kept past the next replay, go wrong here too."""
    output = fn(*inputs)
    pool.append(output)

    def replay():
        for other in pool:
            other.fill_(float("nan"))
        output.copy_(fn(*inputs))

    return Captured(replay, inputs, output)


class Graphs:
    """Captured steps. `step(key, fn, inputs)`: the first call of `fn` with a key (its bucket) runs it for
    real (compiling it: nothing compiles inside a capture), then captures it; every later call replays."""

    def __init__(self, capture: Callable = cuda_capture):
        self.capture = capture
        self.captured: dict = {}
        self.failed = False
        # the memory every graph here shares (replays never overlap, outputs are copied out): a pool lives while
        # a graph captured into it does, so it is these graphs' own, never one whose graphs were all freed
        self.pool = [] if capture is replay_capture else None

    def step(self, key, fn: Callable, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.failed:
            return fn(*inputs)
        key = (fn, key)
        found = self.captured.get(key)
        if found is None:
            return self._first(key, fn, inputs)
        for buffer, value in zip(found.inputs, inputs):
            buffer.copy_(value)
        found.replay()
        return found.output.clone()  # the next replay (of any graph in the pool) may overwrite it

    def _first(self, key, fn: Callable, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        buffers = [t.clone() for t in inputs]
        cuda = buffers[0].device.type == "cuda"
        if cuda:  # the real run on a side stream, as a capture wants its kernels warmed (cuBLAS handles)
            side = torch.cuda.Stream(buffers[0].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                output = fn(*buffers).clone()
            torch.cuda.current_stream().wait_stream(side)
        else:
            output = fn(*buffers).clone()
        try:  # capturing only records: the real run above already wrote this step's cache entries
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.captured[key] = self.capture(fn, buffers, self.pool)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: say so once, run uncaptured
            if isinstance(e, (torch.cuda.OutOfMemoryError, KeyboardInterrupt)):
                raise
            self.failed = True
            print(f"spec: capturing a CUDA graph failed ({described(e)}); running the compiled step without graphs",
                  file=sys.stderr)
        return output
