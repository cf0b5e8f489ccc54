"""Load on a running `spec serve`: N clients, each sending M requests one after another (streamed by
default), all at once. Prints latency (p50/p95), time to first token, tokens/s over the run, and errors.

    spec serve -p benchmarks/pyfam.toml --dtype float32 &
    python benchmarks/scripts/serve_load.py --url http://127.0.0.1:8000 --clients 4 --requests 5 --max-tokens 64

Prompts: the first HumanEval prompts when --dataset is given, else a few built-in code prompts; client i's
request j gets prompt (i * M + j) mod the number of prompts. Uses the `openai` client (pip install openai).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import threading
import time

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "def read_lines(path):\n",
    "for i in range(10):\n",
]


def prompts_from(dataset: str | None, count: int) -> list[str]:
    if not dataset:
        return PROMPTS
    opener = gzip.open if dataset.endswith(".gz") else open
    with opener(dataset, "rt") as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(count))]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default=None, help="default: the server's only model")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=5, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--dataset", default=None, help="a HumanEval .jsonl(.gz) to take prompts from")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()

    import openai

    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    prompts = prompts_from(args.dataset, args.clients * args.requests)
    rows, errors, lock = [], [], threading.Lock()

    def run(i: int) -> None:
        for j in range(args.requests):
            prompt = prompts[(i * args.requests + j) % len(prompts)]
            start = time.perf_counter()
            first, tokens, spec = None, 0, {}
            try:
                if args.no_stream:
                    response = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                         temperature=args.temperature)
                    tokens, spec = response.usage.completion_tokens, response.model_extra.get("spec", {})
                else:
                    stream = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                       temperature=args.temperature, stream=True,
                                                       stream_options={"include_usage": True})
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].text and first is None:
                            first = time.perf_counter() - start
                        if chunk.choices and chunk.choices[0].finish_reason:
                            spec = (chunk.model_extra or {}).get("spec", {})
                        if chunk.usage:
                            tokens = chunk.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 - counted and shown
                with lock:
                    errors.append(f"client {i} request {j}: {type(e).__name__}: {e}")
                continue
            with lock:
                rows.append({"seconds": time.perf_counter() - start, "first": first, "tokens": tokens,
                             "tokens_per_forward": spec.get("tokens_per_forward")})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began

    latencies = [r["seconds"] for r in rows]
    firsts = [r["first"] for r in rows if r["first"] is not None]
    tokens = sum(r["tokens"] for r in rows)
    per_forward = [r["tokens_per_forward"] for r in rows if r["tokens_per_forward"]]
    result = {
        "url": args.url, "model": model, "clients": args.clients, "requests_per_client": args.requests,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": not args.no_stream,
        "completed": len(rows), "errors": len(errors), "wall_seconds": round(wall, 3),
        "latency_p50": round(percentile(latencies, 50), 3), "latency_p95": round(percentile(latencies, 95), 3),
        "first_token_p50": round(percentile(firsts, 50), 3) if firsts else None,
        "first_token_p95": round(percentile(firsts, 95), 3) if firsts else None,
        "tokens": tokens, "tokens_per_second": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_second": round(len(rows) / wall, 3) if wall > 0 else None,
        "mean_tokens_per_forward": round(statistics.mean(per_forward), 3) if per_forward else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.clients} clients x {args.requests} requests, {args.max_tokens} tokens, "
              f"{'streamed' if result['stream'] else 'not streamed'}, T = {args.temperature}, model {model}")
        print(f"completed {len(rows)}, errors {len(errors)}, in {wall:.2f} s")
        print(f"latency p50 {result['latency_p50']:.3f} s, p95 {result['latency_p95']:.3f} s"
              + (f"; first token p50 {result['first_token_p50']:.3f} s, p95 {result['first_token_p95']:.3f} s"
                 if firsts else ""))
        print(f"{tokens} tokens, {result['tokens_per_second']} tokens/s overall, "
              f"{result['requests_per_second']} requests/s, mean tokens per oracle forward "
              f"{result['mean_tokens_per_forward']}")
    for line in errors[:10]:
        print("error:", line)
    raise SystemExit(1 if errors else 0)


if __name__ == "__main__":
    main()
