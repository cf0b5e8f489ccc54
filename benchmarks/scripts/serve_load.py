"""`spec serve` under load: 1, 4, 16 and 48 concurrent streamed clients, each with its own prompt (HumanEval's,
of mixed lengths, or `--prompts`'), 128 tokens each, greedy; against each request sent alone.

    python benchmarks/scripts/serve_load.py -p benchmarks/pyfam.toml [--clients 1,4,16,48] [--tokens 128] \
        [--serve-args "--parallel 16"] [--sustained 30] [--prompts benchmarks/prompts/code-8.jsonl]

Starts `spec serve` on a free port (its queue large enough for every client; its prefix cache off unless
`--serve-args` sets `--prefix-cache`: each load sends the prompts the lone pass sent, which a cache would hand it
read, and a crowd of new prompts would not find; pyfam's 16 clients: first text 0.13 s with it, 0.45 s without,
against a lone request's 0.05), sends a short request to warm it,
opens as many connections as the largest load has clients (one client, its pool kept, as an application's is),
then every prompt alone (the reference text and time to first token), then each load. Prints per load: requests answered and refused,
responses identical to the lone ones, aggregate tokens per second (all tokens over the load's wall time), and
the time to the first token (median and worst) against a lone request's median.

A load is a burst: each client sends one request, and its rate is every token over the time until the last one
ends, so it counts the tail where the requests that speculate best have ended and the rest decode in a smaller
batch. With `--sustained SECONDS`, each load runs again as a server's clients do: each client sends its next
prompt (round every prompt) as soon as its last is answered, until SECONDS have passed; the rate is
every token over the time until the last request ends (the tail one request long, against SECONDS of full batches).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(client: httpx.Client, url: str, prompt: str, tokens: int) -> dict:
    """One streamed completion: its text, status, time to the first text and in all. `client` is made once and
    shared, as an application's is: a new httpx client takes ~28 ms of CPU (its SSL context), which a request
    timed with one would count as the server's, and a crowd of them takes the server's cores."""
    start, first, pieces = time.perf_counter(), None, []
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    try:
        with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                response.read()
                return {"status": response.status_code, "text": None, "first": None, "seconds": None}
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    if first is None:
                        first = time.perf_counter() - start
                    pieces.append(choices[0]["text"])
    except httpx.HTTPError as e:
        return {"status": type(e).__name__, "text": None, "first": None, "seconds": None}
    return {"status": 200, "text": "".join(pieces), "first": first, "seconds": time.perf_counter() - start}


def connect(client: httpx.Client, url: str, count: int) -> None:
    """Open `count` connections in `client`'s pool (each held open until all are), as a lone request's is: a
    crowd's first requests would otherwise each open one, while the server is busy with the others."""
    gate = threading.Barrier(count)

    def hold():
        with client.stream("GET", url + "/health", timeout=30) as response:
            gate.wait(timeout=30)
            response.read()

    threads = [threading.Thread(target=hold) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def served(client: httpx.Client, url: str) -> float:
    """Tokens the server has generated so far (its /metrics, every method)."""
    text = client.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("spec_tokens_total"))


def sustained(client: httpx.Client, url: str, clients: int, prompts: list[str], alone: list[dict], args,
              lone_rate: float) -> None:
    """The load again, each client sending its next prompt once answered (client i prompts i, i + clients, ...
    round every prompt), for `args.sustained` seconds."""
    results: list[list[tuple[int, dict]]] = [[] for _ in range(clients)]
    before = served(client, url)
    start = time.perf_counter()
    deadline = start + args.sustained

    def loop(i: int) -> None:
        k = i
        while time.perf_counter() < deadline:
            results[i].append((k % len(prompts), stream(client, url, prompts[k % len(prompts)], args.tokens)))
            k += clients

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [(k, r) for each in results for k, r in each]
    ok = [(k, r) for k, r in done if r["status"] == 200]
    same = sum(r["text"] == alone[k]["text"] for k, r in ok)
    firsts = sorted(r["first"] for _, r in ok if r["first"] is not None)
    rate = (served(client, url) - before) / wall
    print(f"{clients:3} clients sustained: {len(done)} requests, {len(done) - len(ok)} refused or failed, "
          f"{same}/{len(ok)} identical to alone · {wall:6.2f} s · first text median {statistics.median(firsts):.3f} s, "
          f"worst {firsts[-1]:.3f} s · {rate:.1f} tok/s in all ({rate / lone_rate:.2f}x one at a time)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--profile", default="benchmarks/pyfam.toml")
    parser.add_argument("--clients", default="1,4,16,48")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=None,
                        help="a .jsonl of {\"prompt\": ...} lines to send instead of HumanEval's")
    parser.add_argument("--serve-args", default="", help="more `spec serve` options")
    parser.add_argument("--sustained", type=float, default=0.0,
                        help="also run each load for this many seconds, each client sending again once answered")
    args = parser.parse_args()
    loads = [int(c) for c in args.clients.split(",")]
    lines = args.prompts.open() if args.prompts else gzip.open(DATA, "rt")
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: max(loads)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ["spec", "serve", "-p", args.profile, "--port", str(port), "--queue", str(max(loads) + 1),
               *([] if "--prefix-cache" in args.serve_args else ["--prefix-cache", "0"]), *args.serve_args.split()]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_COLOR": "1"})
    log: list[str] = []
    client = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(loads) + 1))
    threading.Thread(target=lambda: log.extend(server.stderr), daemon=True).start()
    try:
        deadline = time.time() + 600
        while True:
            try:
                health = client.get(url + "/health", timeout=5)
                if health.status_code == 200 and not health.json().get("warming"):  # (a request ends a warm-up)
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.time() > deadline:
                sys.exit("the server did not start:\n" + "".join(log[-20:]))
            time.sleep(0.5)
        print(f"spec serve {' '.join(command[3:4] + command[8:])} · {args.tokens} tokens a request, greedy · "
              f"streamed clients", flush=True)
        stream(client, url, "def warm(up):", 8)  # (a first request's one-time costs belong to no pass)
        connect(client, url, max(loads))
        before, start = served(client, url), time.perf_counter()
        alone = [stream(client, url, p, args.tokens) for p in prompts]
        lone_rate = (served(client, url) - before) / (time.perf_counter() - start)
        lone_first = statistics.median(r["first"] for r in alone if r["first"] is not None)
        print(f"alone, one after another: {lone_rate:.1f} tok/s · median first text {lone_first:.3f} s", flush=True)
        for clients in loads:
            results, before = [None] * clients, served(client, url)
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(client, url, prompts[i], args.tokens)))
                       for i in range(clients)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            ok = [r for r in results if r["status"] == 200]
            same = sum(r["text"] == alone[i]["text"] for i, r in enumerate(results) if r["status"] == 200)
            firsts = sorted(r["first"] for r in ok if r["first"] is not None)
            rate = (served(client, url) - before) / wall
            print(f"{clients:3} clients: {len(ok)} answered, {clients - len(ok)} refused or failed, "
                  f"{same}/{len(ok)} identical to alone · {wall:6.2f} s · first text median "
                  f"{statistics.median(firsts):.3f} s, worst {firsts[-1]:.3f} s "
                  f"({statistics.median(firsts) / lone_first:.1f}x a lone request's) · {rate:.1f} tok/s in all "
                  f"({rate / lone_rate:.2f}x one at a time)", flush=True)
            if args.sustained > 0:
                sustained(client, url, clients, prompts, alone, args, lone_rate)
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
