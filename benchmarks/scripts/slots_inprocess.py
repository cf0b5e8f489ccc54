"""Slots in one process, without the server: N sequences each run `complete()` over its own `Engine.slot`, their
forwards shared (`exec.lockstep`), in one thread as a server's are (each a greenlet: `exec.cohort`) or with
`--threads` a thread each, against the same prompts decoded one at a time; every text checked against the
one-at-a-time one.

    python benchmarks/scripts/slots_inprocess.py -p benchmarks/pyfam.toml --slots 16 --tokens 128 \
        [--first 0] [--methods baseline,staged] [--rounds 2] [--threads]

Prints the one-at-a-time rate (staged), then per method and round the rate together, texts identical, tokens
per oracle forward, the median time to the first token, and the shared forwards (count, rows and sequences a
forward, seconds).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import threading
import time
from pathlib import Path

from spec_cli.completion import complete
from spec_cli.core.process import settle, starting
from spec_cli.engine import Engine
from spec_cli.exec.cohort import Cohort
from spec_cli.exec.lockstep import Lockstep
from spec_cli.models import profiles as store

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", default="benchmarks/pyfam.toml")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--first", type=int, default=0, help="the first HumanEval problem")
    parser.add_argument("--methods", default="baseline,staged")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", action="store_true", help="a thread a sequence, not one thread for all")
    args = parser.parse_args()
    profile = store.load(args.profile)
    starting()  # (the collector as `spec serve` has it: no full passes over the loaded models)
    engine = Engine(profile, need_draft=True)
    settle()
    prompts = [json.loads(line)["prompt"] for line in gzip.open(DATA, "rt")][args.first:args.first + args.slots]
    ids = [engine.encode(p) for p in prompts]
    n = len(ids)
    staged = profile.decoding.replace(method="staged", max_new_tokens=args.tokens)
    started = time.perf_counter()
    alone = [complete(engine, i, engine.plan(staged)) for i in ids]
    lone_rate = sum(len(c.tokens) for c in alone) / (time.perf_counter() - started)
    print(f"{n} prompts, {args.tokens} tokens: staged one at a time {lone_rate:.1f} tok/s", flush=True)
    lockstep = Lockstep()  # (one, as a server has: its forwards' thread's OpenMP team the one computing)
    for method in args.methods.split(","):
        settings = profile.decoding.replace(method=method, max_new_tokens=args.tokens)
        slots = [engine.slot(lockstep) for _ in range(n)]
        for _ in range(args.rounds):
            done = [None] * n
            lockstep.counts.__init__()
            started = time.perf_counter()
            (in_threads if args.threads else in_cohort)(lockstep, n, lambda k: complete(slots[k], ids[k],
                                                                                         slots[k].plan(settings)), done)
            wall = time.perf_counter() - started
            tokens = sum(len(c.tokens) for c in done)
            forwards = sum(c.stats.oracle_forwards for c in done)
            same = sum(c.tokens == a.tokens for c, a in zip(done, alone))
            first = sorted(c.first_token_seconds for c in done)[n // 2]
            counts = lockstep.counts
            print(f"  together {method}: {tokens / wall:.1f} tok/s ({tokens / wall / lone_rate:.2f}x), identical "
                  f"{same}/{n}, {sum(c.stats.new_tokens for c in done) / forwards:.2f} tokens an oracle forward, "
                  f"median first token {first:.2f} s · {counts.forwards} shared forwards, "
                  f"{counts.rows / max(1, counts.forwards):.1f} rows and "
                  f"{counts.sequences / max(1, counts.forwards):.1f} sequences a forward, {counts.seconds:.2f} s",
                  flush=True)


def in_threads(lockstep: Lockstep, n: int, work, done: list) -> None:
    gate = threading.Barrier(n)

    def run(k):
        gate.wait()
        with lockstep.taking_part():
            done[k] = work(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def in_cohort(lockstep: Lockstep, n: int, work, done: list) -> None:
    """As `spec serve`'s slots: one thread, each sequence a greenlet, all started in one turn."""
    cohort = Cohort(lockstep)

    def run(k):
        with lockstep.taking_part():
            done[k] = work(k)

    thread = threading.Thread(target=cohort.run, args=([functools.partial(run, k) for k in range(n)],))
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
