"""spec beside llama.cpp's own programs on an oracle and its draft (GGUF files), same prompts and threads, greedy.

    eval "$(../shared/tools/fetch-models --env)"
    python benchmarks/scripts/vs_llamacpp_pair.py --oracle $QWEN_1_5B --draft $QWEN_0_5B --bin LLAMA_BIN \
        [--prompts benchmarks/prompts/code-8.jsonl] [-n 128] [--threads 2] [--draft-max 2,4,8] [--methods baseline,staged]
        [--plain-rounds R]

LLAMA_BIN holds llama.cpp's `llama-bench` and `llama-speculative-simple`, built from the sources vendored in
llama-cpp-python's sdist (docs/benchmarks.md, "Beside llama.cpp"). Measured, one program run at a time:
- llama.cpp plain: `llama-bench -p 0 -n N` on the oracle (its own yardstick: generation alone);
- llama.cpp speculative: `llama-speculative-simple --spec-type draft-simple --spec-draft-n-max D` on each prompt,
  for each D; its "decoded" speed (generation, the prompt apart); the best D in all is its number;
- spec: `spec generate --json` in a fresh process per prompt and method (as a user runs it: each starting from
  what the earlier ones learned, kept in the cache dir), its generation speed (the prompt apart), and whether each
  method's tokens are baseline's.
Speeds in all are total tokens over total seconds. `--plain-rounds R` then alternates llama-bench and spec's baseline
R times (plain decoding only; this VM's speed drifts by the quarter hour, so a ratio is read within a round).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spec_cli.core.hardware import cpu_name  # noqa: E402


def llama_bench(binary: Path, model: str, tokens: int, threads: int) -> float:
    out = subprocess.run([str(binary / "llama-bench"), "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads),
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_speculative(binary: Path, oracle: str, draft: str, prompt: str, tokens: int, threads: int,
                      most: int) -> tuple[int, float, float]:
    """(tokens, seconds, acceptance) of llama-speculative-simple's generation."""
    run = subprocess.run([str(binary / "llama-speculative-simple"), "-m", oracle, "-md", draft, "-p", prompt,
                          "-n", str(tokens), "-t", str(threads), "-td", str(threads), "--temp", "0",
                          "--spec-type", "draft-simple", "--spec-draft-n-max", str(most)],
                         capture_output=True, text=True)
    text = run.stdout + run.stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    accept = re.search(r"accept\s+=\s+([\d.]+)%", text)
    if decoded is None:
        raise SystemExit(f"llama-speculative-simple printed no speed (exit {run.returncode}; -4 or 132: an "
                         f"illegal instruction, as its AMX build on a VM without AMX state):\n{text[-2000:]}")
    return int(decoded.group(1)), float(decoded.group(2)), float(accept.group(1)) / 100 if accept else float("nan")


def spec_generate(oracle: str, draft: str, prompt: str, tokens: int, method: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "spec_cli", "generate", "--oracle", oracle, "--draft", draft,
                          "-m", method, "-n", str(tokens), "--json", prompt], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"spec generate failed: {run.stderr.strip().splitlines()[-1]}")
    return json.loads(run.stdout)


def generation_speed(runs: list[dict]) -> float:
    """spec's generation tokens per second over runs: total tokens over total seconds (the prompt apart)."""
    return sum(r["stats"]["new_tokens"] for r in runs) / sum(
        r["stats"]["new_tokens"] / r["generation_tokens_per_second"] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--oracle", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--bin", required=True, type=Path, help="llama.cpp's build/bin")
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl"))
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", default="2,4,8")
    parser.add_argument("--methods", default="baseline,staged")
    parser.add_argument("--plain-rounds", type=int, default=0, help="then R rounds of plain decoding, alternating")
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    print(f"CPU: {cpu_name()}; {args.threads} threads; {len(prompts)} prompts from {args.prompts}; {args.n} tokens")
    plain = llama_bench(args.bin, args.oracle, args.n, args.threads)
    print(f"llama.cpp plain (llama-bench tg{args.n}): {plain:.1f} tok/s", flush=True)
    best = None
    for most in (int(d) for d in args.draft_max.split(",")):
        runs = [llama_speculative(args.bin, args.oracle, args.draft, p, args.n, args.threads, most) for p in prompts]
        speed = sum(r[0] for r in runs) / sum(r[1] for r in runs)
        accept = sum(r[2] for r in runs) / len(runs)
        print(f"llama.cpp speculative, draft up to {most}: {speed:.1f} tok/s (acceptance {accept:.0%})", flush=True)
        best = max(best or 0.0, speed)
    peer = max(plain, best or 0.0)
    results: dict[str, list[dict]] = {}
    for method in args.methods.split(","):
        results[method] = [spec_generate(args.oracle, args.draft, p, args.n, method) for p in prompts]
    base = results.get("baseline")
    for method, runs in results.items():
        tokens = sum(r["stats"]["new_tokens"] for r in runs)
        whole = sum(r["seconds"] for r in runs)
        same = sum(r["tokens"] == b["tokens"] for r, b in zip(runs, base)) if base else None
        speed = generation_speed(runs)
        print(f"spec {method}: {speed:.1f} tok/s generation ({tokens / whole:.1f} with the prompt); "
              f"{speed / plain:.2f}x llama.cpp plain, {speed / peer:.2f}x llama.cpp's best"
              + (f"; identical to baseline {same}/{len(runs)}" if same is not None else ""), flush=True)
    ratios = []
    for round_ in range(1, args.plain_rounds + 1):
        plain = llama_bench(args.bin, args.oracle, args.n, args.threads)
        speed = generation_speed([spec_generate(args.oracle, args.draft, p, args.n, "baseline") for p in prompts])
        ratios.append(speed / plain)
        print(f"round {round_}: llama.cpp plain {plain:.1f}, spec baseline {speed:.1f} tok/s: {speed / plain:.2f}x",
              flush=True)
    if ratios:
        print(f"spec baseline / llama.cpp plain over {len(ratios)} rounds: median {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
