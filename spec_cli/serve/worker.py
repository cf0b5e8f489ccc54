"""The one thread that runs the models: requests wait in a bounded queue in arrival order and are decoded
one at a time with `complete()`; their text goes back to the event loop piece by piece.

A job's messages, in order: Started, then Text..., then Done; or Failed at any point. The server knows no
KV cache: every completion runs with `reuse=True`, so the engine keeps whatever prefix the new prompt shares
with the last one (a chat's next turn runs only its new tokens).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from spec_cli.completion import complete
from spec_cli.core.errors import OutOfMemory, PromptTooLong, SpecError, check_room
from spec_cli.core.events import Stats, Token
from spec_cli.core.settings import Decoding
from spec_cli.serve.text import TextStream


@dataclass
class Totals:
    """A method's requests so far: tokens, seconds, and what its forwards brought."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stats: Stats = field(default_factory=Stats)

    def add(self, result: "Result") -> None:
        self.requests += 1
        self.tokens += result.completion_tokens
        self.seconds += result.seconds
        self.stats.merge(result.stats)


class Refused(SpecError):
    """A request the server cannot run: answered with `status` and an OpenAI error `code`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Result:
    text: str
    prompt_tokens: int
    cached_tokens: int  # of the prompt, already in the KV cache from the last request
    completion_tokens: int
    finish: str  # eos, stop (a stop string), length, context, disconnected, shutdown
    seconds: float  # from the first forward to the last token
    stats: Stats
    method: str

    @property
    def finish_reason(self) -> str:
        """OpenAI's word for it: "stop" (EOS or a stop string) or "length" (cut short)."""
        return "stop" if self.finish in ("eos", "stop") else "length"

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def extra(self) -> dict:
        """spec's own statistics, in the responses' `spec` field."""
        stats = self.stats
        return {
            "method": self.method,
            "finish": self.finish,
            "tokens_per_forward": round(stats.tokens_per_oracle_forward, 4),
            "oracle_forwards": stats.oracle_forwards,
            "acceptance": _round(stats.acceptance("oracle")),
            "draft2_acceptance": _round(stats.acceptance("draft")),
            "cached_tokens": self.cached_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(frozen=True)
class Started:
    """The prompt is encoded and fits: its text will follow."""

    prompt_tokens: int


@dataclass(frozen=True)
class Text:
    delta: str  # the next piece of the completion's text


@dataclass(frozen=True)
class Done:
    result: Result


@dataclass(frozen=True)
class Failed:
    """The request's answer is an error: `status` with an OpenAI error `code`."""

    status: int
    code: str
    message: str


Message = Started | Text | Done | Failed


class Job:
    """One request's decoding: what to run, and the channel its messages come back on."""

    def __init__(self, endpoint: str, encode: Callable[[], list[int]], settings: Decoding, stops: list[str],
                 strip: bool = False, stop_ids: frozenset[int] = frozenset()):
        self.endpoint = endpoint
        self.stop_ids = stop_ids  # tokens that end the text (a FIM token: the middle is filled), not in it
        self.encode = encode  # the prompt's token ids (runs in the worker: the tokenizer is not shared)
        self.settings = settings
        self.stops = stops
        self.strip = strip
        self.cancelled = threading.Event()  # the client went away: stop at the next step
        self.loop = asyncio.get_running_loop()
        self.channel: asyncio.Queue = asyncio.Queue()

    def post(self, message: Message) -> None:
        """From the worker thread: hand a message to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.channel.put_nowait, message)
        except RuntimeError:  # the loop is closed: the server has stopped, nobody is waiting
            pass

    async def next(self) -> Message:
        return await self.channel.get()

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    def __init__(self, engine, plan_for: Callable[[Decoding], object], log: Callable[[str], None],
                 max_queue: int = 32, debug: bool = False):
        self.engine = engine
        self.plan_for = plan_for  # the Plan a request's settings run with
        self.log = log
        self.debug = debug
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.busy = False
        self.recent: list[float] = []  # seconds the last few jobs took (for Retry-After)
        self.completed = 0  # requests answered (for /health)
        self.finished: deque[tuple[Job, Result]] = deque(maxlen=16)  # the last few, newest last
        self.totals: dict[str, Totals] = {}  # by method: what its requests brought (for /metrics)
        self.thread = threading.Thread(target=self._loop, name="spec-generation", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` behind the others; Refused (429) when the queue is full, (503) when shutting down."""
        if self.stopping.is_set():
            raise Refused(503, "shutting_down", "the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Refused(429, "queue_full", f"the server is busy: {self.jobs.maxsize} requests are already "
                                             "waiting; retry later") from None

    def retry_after(self) -> int:
        """Seconds a refused client might wait: the queue's length times a recent job's time."""
        typical = sorted(self.recent)[len(self.recent) // 2] if self.recent else 1.0
        return max(1, round(typical * (self.jobs.qsize() + 1)))

    def stop(self) -> None:
        """Shutting down: the running generation stops at its next step, waiting requests are answered 503
        (by the worker: this runs in a signal handler, which must take no lock the loop may hold)."""
        self.stopping.set()

    def _loop(self) -> None:
        while not (self.stopping.is_set() and self.jobs.empty()):
            try:
                job = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            if job.cancelled.is_set():
                continue
            if self.stopping.is_set():
                job.post(Failed(503, "shutting_down", "the server is shutting down"))
                continue
            self.busy = True
            try:
                self._run(job)
            finally:
                self.busy = False

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            result = self._generate(job)
        except Refused as e:
            self._fail(job, e.status, e.code, str(e))
        except OutOfMemory as e:
            self._fail(job, 503, "out_of_memory", str(e))
        except PromptTooLong as e:
            self._fail(job, 400, "context_length_exceeded", str(e))
        except SpecError as e:
            self._fail(job, 400, "invalid_request", str(e))
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            if self.debug:
                traceback.print_exc()
            self._fail(job, 500, "internal_error", f"{type(e).__name__}: {e}"
                       + ("" if self.debug else " (run the server with --debug for the traceback)"))
        else:
            self.recent = (self.recent + [time.perf_counter() - started])[-8:]
            self.completed += 1
            self.finished.append((job, result))
            self.totals.setdefault(result.method, Totals()).add(result)
            self.log(f"{job.endpoint} 200 · {result.prompt_tokens} prompt tokens ({result.cached_tokens} cached) "
                     f"· {result.completion_tokens} tokens in {result.seconds:.2f} s · "
                     f"{result.tokens_per_second:.1f} tok/s · "
                     f"{result.stats.tokens_per_oracle_forward:.2f} tokens/forward · {result.finish}")
            job.post(Done(result))  # after the log line: the client's answer comes after its line

    def _fail(self, job: Job, status: int, code: str, message: str) -> None:
        self.log(f"{job.endpoint} {status} · {message}")
        job.post(Failed(status, code, message))

    def _generate(self, job: Job) -> Result:
        engine = self.engine
        ids = job.encode()
        context = engine.oracle.context
        check_room(len(ids), context, "model")
        settings = job.settings
        settings = settings.replace(max_new_tokens=min(settings.max_new_tokens, context - len(ids)))
        plan = self.plan_for(settings)
        text = TextStream(engine.tokenizer, ids, job.stops, job.strip)
        ended: list[int] = []  # a stop token came
        job.post(Started(len(ids)))

        def watch(event) -> bool:
            if isinstance(event, Token) and event.output:
                if event.token in job.stop_ids:
                    ended.append(event.token)
                    return True
                delta = text.add(event.token)
                if delta:
                    job.post(Text(delta))
                if text.stopped:
                    return True
            return job.cancelled.is_set() or self.stopping.is_set()

        done = complete(engine, ids, plan, reuse=True, watch=watch)
        rest = text.finish()
        if rest:
            job.post(Text(rest))
        finish = done.reason
        if text.stopped or ended:
            finish = "stop"
        elif done.reason == "stop":
            finish = "disconnected" if job.cancelled.is_set() else "shutdown"
        return Result(text.text, len(ids), len(ids) - done.stats.prompt_tokens, done.stats.new_tokens, finish,
                      done.seconds, done.stats, settings.method)
