"""One way to run a completion: run the events, fold the stats, time prompt processing apart from
generation, and stop cleanly on Ctrl-C. `spec generate`, `spec chat`, the benchmark and `spec tune` all
run their completions through `complete`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spec_cli.core.events import Event, Finished, Stats, Token


@dataclass
class Completion:
    tokens: list[int]  # the output tokens
    stats: Stats
    seconds: float  # from the first forward to the last token
    first_token_seconds: float  # prompt processing: until the first output token
    reason: str  # eos, length, context, stop (the caller's watch ended it), interrupted (Ctrl-C)
    events: list[Event] = field(default_factory=list)  # the whole trace, when asked for

    @property
    def interrupted(self) -> bool:
        return self.reason == "interrupted"

    @property
    def tokens_per_second(self) -> float:
        return self.stats.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def prompt_tokens_per_second(self) -> float | None:
        """Prompt processing speed: the prompt tokens the oracle ran over the time to the first token."""
        if not self.stats.prompt_tokens or self.first_token_seconds <= 0:
            return None
        return self.stats.prompt_tokens / self.first_token_seconds

    @property
    def generation_tokens_per_second(self) -> float | None:
        """Generation speed after the first token: the tokens that followed it over the time they took."""
        later = self.seconds - self.first_token_seconds
        if self.stats.new_tokens < 2 or later <= 0:
            return None
        return (self.stats.new_tokens - 1) / later


def complete(engine, prompt: list[int], plan, *, reuse: bool = False,
             watch: Callable[[Event], bool | None] | None = None, trace: bool = False) -> Completion:
    """Run one completion of `prompt` (token ids) with `plan` (an engine Plan or a bare Decoding).

    `watch` sees every event as it comes (a live view); when it returns True the completion stops there
    (reason "stop": a chat reply's end marker, a code stop). Ctrl-C ends it too (reason "interrupted");
    what came so far is kept either way. `trace` keeps every event in the result.
    """
    stats, tokens, events = Stats(), [], []
    reason = None
    stream = engine.events(prompt, plan, reuse=reuse)  # (builds and warms up the runners it needs)
    start = time.perf_counter()
    first = None
    try:
        for event in stream:
            stats.add(event)
            if trace:
                events.append(event)
            if isinstance(event, Token) and event.output:
                tokens.append(event.token)
                if first is None:
                    first = time.perf_counter()
            elif isinstance(event, Finished):
                reason = event.reason
            if watch is not None and watch(event):
                reason = stats.finish_reason = "stop"
                break
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        stream.close()
    end = time.perf_counter()
    return Completion(tokens, stats, end - start, (first or end) - start, reason or "length", events)


def peak_memory(device) -> tuple[str, int] | None:
    """("GPU", bytes) on CUDA: the most the tensors held; else ("RAM", bytes): this process's peak resident
    memory so far. None where it cannot be read."""
    import torch

    if getattr(device, "type", device) == "cuda":
        return "GPU", int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        import sys
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "RAM", int(peak if sys.platform == "darwin" else peak * 1024)
