"""Lone requests behind `spec serve --parallel N`, one after another: each request's own generation rate (the
response's `spec.tokens_per_second`: from its first forward to its last token, its prompt's read apart), the
tokens a forward and the draft's acceptance. A server's slots each keep their own controllers: this shows what a
lone client gets from the slot it lands on.

    python benchmarks/scripts/serve_lone.py -p benchmarks/pyfam.toml [--parallel 16] [--requests 4] [--rounds 2] \
        [--src DIR]

`--src` runs the server from another checkout (its `spec_cli` first on the path), to compare builds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", required=True)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="the same requests again (their prompts now cached)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--src", default=None, help="a checkout to run the server from")
    args = parser.parse_args()
    env = dict(os.environ, NO_COLOR="1")
    if args.src:
        env["PYTHONPATH"] = args.src
    command = [sys.executable, "-m", "spec_cli", "serve", "-p", str(Path(args.profile).resolve()),
               "--parallel", str(args.parallel), "--port", str(args.port)]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").json().get("warming") is False:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit("the server exited")
            time.sleep(0.5)
        prompts = [json.loads(line)["prompt"] for line in gzip.open(DATA, "rt")][: args.requests]
        client = httpx.Client(timeout=600)
        for round_ in range(1, args.rounds + 1):
            rates = []
            for prompt in prompts:
                body = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0}
                spec = client.post(url + "/v1/completions", json=body).json()["spec"]
                rates.append(spec["tokens_per_second"])
                print(f"  {spec['tokens_per_second']:6.1f} tok/s · {spec['tokens_per_forward']:.2f} tokens a forward "
                      f"· acceptance {spec['acceptance']} · {spec['method']}", flush=True)
            print(f"{args.src or 'this checkout'}, round {round_}: lone requests, median "
                  f"{statistics.median(rates):.1f} tok/s", flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
