"""The thread that runs the models: requests wait in a bounded queue in arrival order; each of `parallel` slots
takes the next, decodes it with `complete()` and hands its text back to the event loop piece by piece. With
several slots their forwards run together (`exec.lockstep`): each slot's sequence is decoded as it would be
alone (its own cache, method, sampling and seed), and every forward's products are shared by the slots'
rows. The slots' requests are decoded in one thread, each in a greenlet (`exec.cohort`). A slot's next request
joins at the next forward; a finished or abandoned one leaves at once.

A job's messages, in order: Started, then Text..., then Done; or Failed at any point. The server knows no
KV cache: every completion runs with `reuse=True`, so a slot's engine keeps whatever prefix the new prompt
shares with its last one (or, with a prefix cache, with any earlier one).
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
from spec_cli.detok import TextStream
from spec_cli.exec import openmp

WARM_TOKENS = 8  # each slot decodes these before serving (`Worker.warm`), after WARM_TEXT or a part of it
WARM_TEXT = "def area(width, height):\n    return width * height\n"  # (short: the pair reads ~9 ms a token a slot)


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
    stop: str | None = None  # the stop string that ended the text

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
    tokens: tuple[Token, ...] = ()  # with log-probabilities (where asked): the output tokens decided since the last


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
        self._posted: list[Message] = []  # handed over, not yet in the channel
        self._lock = threading.Lock()
        self.held: list[Job] | None = None  # (a cohort's slot) where it waits to be sent with the others' (`send`)

    def post(self, message: Message) -> None:
        """From the worker thread: hand a message to the event loop. The loop is woken once for all the messages
        posted before it runs (a step's tokens come together; each wake-up is a write to its pipe and a turn
        of the GIL, and 16 slots posted ~900 a second)."""
        with self._lock:
            self._posted.append(message)
            wake = len(self._posted) == 1
        if wake:
            if self.held is not None:
                self.held.append(self)
            else:
                send([self])

    def _deliver(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for message in posted:
            self.channel.put_nowait(message)

    async def next(self) -> Message:
        return await self.channel.get()

    async def ready(self) -> list[Message]:
        """The next message and every one already posted after it, the texts side by side joined as one: a
        stream sends a step's tokens as one event (each event is a JSON encoding and a write through the HTTP
        stack, on the event loop's share of the GIL: under 16 pyfam clients, over half of the GIL's time)."""
        messages = [await self.channel.get()]
        while not self.channel.empty():
            message = self.channel.get_nowait()
            if isinstance(message, Text) and isinstance(messages[-1], Text):
                messages[-1] = Text(messages[-1].delta + message.delta, messages[-1].tokens + message.tokens)
            else:
                messages.append(message)
        return messages

    def cancel(self) -> None:
        self.cancelled.set()


def send(jobs: list[Job]) -> None:
    """Wake the event loop once to take every message `jobs` posted."""
    try:
        jobs[0].loop.call_soon_threadsafe(_deliver, jobs)
    except RuntimeError:  # the loop is closed: the server has stopped, nobody is waiting
        pass


def _deliver(jobs: list[Job]) -> None:
    for job in jobs:
        job._deliver()


class Worker:
    def __init__(self, engine, plan_for: Callable[[Decoding], object], log: Callable[[str], None],
                 max_queue: int = 32, debug: bool = False, parallel: int = 1):
        self.engine = engine
        self.plan_for = plan_for  # the Plan a request's settings run with
        self.log = log
        self.debug = debug
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.decoding = 0  # requests being decoded now
        self.recent: list[float] = []  # seconds the last few jobs took (for Retry-After)
        self.completed = 0  # requests answered (for /health)
        self.finished: deque[tuple[Job, Result]] = deque(maxlen=16)  # the last few, newest last
        self.totals: dict[str, Totals] = {}  # by method: what its requests brought (for /metrics)
        self.lock = threading.Lock()  # (the counts above, the tokenizer's encoding)
        self.lockstep = self.cohort = None
        engines = [engine]
        if parallel > 1:
            from spec_cli.exec.cohort import Cohort
            from spec_cli.exec.lockstep import Lockstep

            self.lockstep = Lockstep()  # (it gives this thread's OpenMP team back: its forwards' thread computes)
            self.cohort = Cohort(self.lockstep)
            engines = [engine.slot(self.lockstep) for _ in range(parallel)]
        else:
            openmp.give_back_team()  # (the models' loading made this thread's: the slot's thread computes)
        self.engines = engines  # each slot's
        # (several slots) the slots free for the next request, the last freed first: its controllers priced for the
        # company it is in (a lone request on the pair: 42 tok/s against 23 handed round every slot in turn)
        self.idle: deque = deque(engines)
        self.held: list[Job] = []  # (several slots) jobs with messages to send once every slot waits (`_slots`)
        self.warming = None  # (ids, plan, when, [slots still warming]) as the slots warm up (`warm`)
        self.warmed = threading.Event()  # no slot is warming up (`warm` clears it while they do)
        self.warmed.set()
        self.asked = threading.Event()  # a request came: the warm-up ends
        # one slot: its own thread; several: one thread for all, each slot's request a greenlet (`exec.cohort`)
        self.thread = threading.Thread(target=self._loop if parallel == 1 else self._slots,
                                       name="spec-slot" if parallel == 1 else "spec-slots", daemon=True)

    @property
    def parallel(self) -> int:
        return len(self.engines)

    def start(self) -> None:
        if self.thread.ident is None:  # (`warm` may have started it)
            self.thread.start()

    def warm(self, ids: list[int], plan, tokens: int = WARM_TOKENS) -> None:
        """(several slots, as serving starts) Start the slots, each first decoding `tokens` after a part of `ids`,
        all at once as a crowd of requests would: each slot's runners are built and its memory first
        touched, its controllers first priced beside the others', and the shared forwards' cost of a row
        measured, so the first crowd does not pay for it all (pyfam, 16 slots, 16 clients: its first text took
        ~1.8x a later crowd's). The first request ends every slot's warm-up at its next step; nothing goes into
        the prefix caches. `warmed` is set again once every slot is done."""
        if self.lockstep is None:
            return
        self.warmed.clear()
        plan = plan.replace(settings=plan.settings.replace(max_new_tokens=tokens))
        self.warming = (ids, plan, time.perf_counter(), [self.parallel])
        self.start()

    def _warm(self, engine) -> None:
        ids, plan, started, left = self.warming
        cut = self.engines.index(engine) % 4  # (prompts of several lengths)
        try:
            with self.lockstep.taking_part():
                complete(engine, ids[: max(1, len(ids) - cut)], plan, reuse=True,
                         watch=lambda event: self.stopping.is_set() or self.asked.is_set())
        except Exception as e:  # noqa: BLE001 - the slot serves all the same
            if self.debug:
                traceback.print_exc()
            self.log(f"warming a slot: {type(e).__name__}: {e}")
        finally:
            self.idle.append(engine)
            left[0] -= 1
            if not left[0]:
                self.log(f"{self.parallel} slots warmed up in {time.perf_counter() - started:.1f} s")
                self.warmed.set()

    def join(self, timeout: float) -> None:
        """Wait for the slots to finish (at most `timeout` seconds)."""
        if self.thread.ident is not None:
            self.thread.join(timeout=timeout)

    def submit(self, job: Job) -> None:
        """Queue `job` behind the others; Refused (429) when the queue is full, (503) when shutting down."""
        if self.stopping.is_set():
            raise Refused(503, "shutting_down", "the server is shutting down")
        self.asked.set()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Refused(429, "queue_full", f"the server is busy: {self.jobs.maxsize} requests are already "
                                             "waiting; retry later") from None
        if self.cohort is not None:
            self.cohort.wake()  # (a free slot takes it now, even while a forward runs)

    def retry_after(self) -> int:
        """Seconds a refused client might wait: the queue's length times a recent job's time, over the slots."""
        typical = sorted(self.recent)[len(self.recent) // 2] if self.recent else 1.0
        return max(1, round(typical * (self.jobs.qsize() + 1) / self.parallel))

    def stop(self) -> None:
        """Shutting down: the running generations stop at their next step, waiting requests are answered 503
        (by the slots: this runs in a signal handler, which must take no lock the loop may hold)."""
        self.stopping.set()  # (the slots' thread sees it within 0.2 s: waking it here could take a lock the loop holds)

    def _take(self, timeout: float) -> Job | None:
        """The next request to decode (None: none came within `timeout`, or it was answered here)."""
        try:
            job = self.jobs.get(timeout=timeout) if timeout else self.jobs.get_nowait()
        except queue.Empty:
            return None
        if job.cancelled.is_set():
            return None
        if self.stopping.is_set():
            job.post(Failed(503, "shutting_down", "the server is shutting down"))
            return None
        return job

    def _loop(self) -> None:
        """(one slot) Each request in turn."""
        while not (self.stopping.is_set() and self.jobs.empty()):
            job = self._take(0.2)
            if job is not None:
                self._serve(job, self.engine)

    def _slots(self) -> None:
        """(several slots) Every slot's request decoded in this thread, each a greenlet (`exec.cohort`): a free
        slot takes the next request as soon as it comes; the others resume as their forwards come back."""
        cohort = self.cohort
        with cohort.serving():
            warming = self.warming is not None
            while not (self.stopping.is_set() and self.jobs.empty() and not cohort.live):
                with cohort.turn():  # (what starts or resumes here is one forward: with the others, if one runs)
                    if warming:
                        warming, slots = False, list(self.idle)
                        self.idle.clear()
                        for engine in slots:
                            cohort.start(self._warm, engine)
                    while self.idle and not self.jobs.empty():
                        job = self._take(0)
                        if job is not None:
                            job.held = self.held
                            cohort.start(self._serve, job, self.idle.pop())
                    cohort.resume()
                self._send_held()
                cohort.wait(timeout=0.2)
            self._send_held()

    def _send_held(self) -> None:
        """(several slots) Wake the event loop for every message the slots posted since the last time: once all
        wait for the forward, so the loop sends them while it computes, not between the slots' steps."""
        if self.held:
            held, self.held[:] = list(self.held), []
            send(held)

    def _serve(self, job: Job, engine) -> None:
        with self.lock:
            self.decoding += 1
        try:
            if self.lockstep is not None:
                with self.lockstep.taking_part():
                    self._run(job, engine)
                engine.remember()  # (the next request sharing its prefix may go to another slot)
            else:
                self._run(job, engine)
        except Exception as e:  # noqa: BLE001 - (an error out of a slot's greenlet would end every slot's thread)
            if self.debug:
                traceback.print_exc()
            self.log(f"a slot failed: {type(e).__name__}: {e}")
        finally:
            with self.lock:
                self.decoding -= 1
            if self.lockstep is not None:
                self.idle.append(engine)

    def _run(self, job: Job, engine) -> None:
        started = time.perf_counter()
        try:
            result = self._generate(job, engine)
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
            with self.lock:
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

    def _generate(self, job: Job, engine) -> Result:
        with self.lock:  # (one tokenizer for every slot)
            ids = job.encode()
        context = engine.oracle.context
        check_room(len(ids), context, "model")
        settings = job.settings
        settings = settings.replace(max_new_tokens=min(settings.max_new_tokens, context - len(ids)))
        plan = self.plan_for(settings)
        text = TextStream(engine.tokenizer, ids, job.stops, job.strip)
        ended: list[int] = []  # a stop token came
        scored: list[Token] = []  # output tokens with log-probabilities, not posted yet
        job.post(Started(len(ids)))

        def watch(event) -> bool:
            if isinstance(event, Token) and event.output:
                if event.token in job.stop_ids:
                    ended.append(event.token)
                    return True
                if event.logprob is not None:
                    scored.append(event)
                delta = text.add(event.token)
                if delta:
                    job.post(Text(delta, tuple(scored)))
                    scored.clear()
                if text.stopped:
                    return True
            return job.cancelled.is_set() or self.stopping.is_set()

        done = complete(engine, ids, plan, reuse=True, watch=watch)
        rest = text.finish()
        if rest or scored:
            job.post(Text(rest, tuple(scored)))
        finish = done.reason
        if text.stopped or ended:
            finish = "stop"
        elif done.reason == "stop":
            finish = "disconnected" if job.cancelled.is_set() else "shutdown"
        return Result(text.text, len(ids), len(ids) - done.stats.prompt_tokens, done.stats.new_tokens, finish,
                      done.seconds, done.stats, plan.settings.method, text.matched)
