"""Time to the first token of a request that shares a long prefix with an earlier one, not the last one.

    python benchmarks/scripts/prefix_cache.py -p benchmarks/pyfam.toml [--prefix 1000] [--tokens 16]

Three requests in a row, as a server sees them from two clients: A = S + q1 (S a prefix of `--prefix` tokens
made of HumanEval prompts, cold), B = another text of the same length (the other client), C = S + q2. With the
prefix cache (`spec serve --prefix-cache`, on by default) C runs only q2; without it, S again (the runner held
B). Prints each request's time to the first token, with the cache and without, in one process.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from spec_cli.completion import complete
from spec_cli.engine import Engine
from spec_cli.models import profiles

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", default="benchmarks/pyfam.toml")
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    profile = profiles.load(args.profile)
    texts = [json.loads(line)["prompt"] for line in gzip.open(DATA, "rt")]
    for cache in (1 << 30, 0):
        engine = Engine(profile, need_draft=True, prefix_cache=cache)
        ids = engine.encode("".join(texts[:40]))
        system, other = ids[: args.prefix], ids[args.prefix: 2 * args.prefix]
        q1, q2 = engine.encode(texts[100]), engine.encode(texts[101])
        settings = profile.decoding.replace(max_new_tokens=args.tokens)
        complete(engine, engine.encode("def f(x):"), settings)  # (warm)
        times = []
        for name, prompt in (("A = S + q1", system + q1), ("B (other)", other), ("C = S + q2", system + q2)):
            start = time.perf_counter()
            done = complete(engine, prompt, settings, reuse=True)
            times.append(done.first_token_seconds)
            print(f"prefix cache {'on ' if cache else 'off'} {name:11} {len(prompt):5} prompt tokens  first token "
                  f"{done.first_token_seconds:6.2f} s  ({time.perf_counter() - start:.2f} s in all)", flush=True)
        print(f"prefix cache {'on ' if cache else 'off'}: C's first token / A's = {times[2] / times[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
