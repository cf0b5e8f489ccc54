"""Forward costs of a GGUF oracle and its draft (the real pair: Qwen2.5-Coder-1.5B and -0.5B), by rows verified.

    eval "$(../shared/tools/fetch-models --env)"
    python benchmarks/scripts/pair_cost.py $QWEN_1_5B $QWEN_0_5B [--rows 1,2,4,8,16] [--prefix 200] [--as-file]

For each model, ms per forward of `rows` new tokens after a `prefix`-token cache (the rows then dropped, as a
rejected speculation is), the head included; and the share of a one-row forward that is the head alone. The
models after the first load as spec loads a draft (`Engine.draft_ref`: int4 where spec's kernel runs; a draft's
precision changes no output), unless `--as-file`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spec_cli.core.hardware import cpu_name  # noqa: E402
from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner, quant  # noqa: E402
from spec_cli.models.loading import load  # noqa: E402


def milliseconds(runner: Runner, rows: int, repeats: int) -> float:
    tokens = list(range(100, 100 + rows))
    for _ in range(3):
        runner.forward(tokens)
        runner.keep([])
    start = time.perf_counter()
    for _ in range(repeats):
        runner.forward(tokens)
        runner.keep([])
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--as-file", action="store_true", help="every model at its file's precision")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for i, path in enumerate(args.models):
        draft = i > 0 and not args.as_file and quant.native_kernel() is not None
        ref = ModelRef(path, quantize="int4") if draft else ModelRef(path)
        model = load(ref, torch.device("cpu"), torch.bfloat16, untested=True).model
        runner = Runner(model, capacity=args.prefix + 64)
        runner.forward(list(range(1000, 1000 + args.prefix)), commit=args.prefix)
        costs = {rows: milliseconds(runner, int(rows), args.repeats) for rows in args.rows.split(",")}
        head = runner.lean.head if runner.lean is not None else None
        x = torch.randn(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
        head_ms = None
        if head is not None:
            for _ in range(3):
                head(x)
            start = time.perf_counter()
            for _ in range(args.repeats):
                head(x)
            head_ms = (time.perf_counter() - start) / args.repeats * 1000
        print(f"{Path(path).name}{' (as a draft: int4)' if draft else ''}: " + ", ".join(f"{rows} rows {ms:.2f} ms" for rows, ms in costs.items())
              + (f"; head alone {head_ms:.2f} ms" if head_ms is not None else ""))
        del runner, model


if __name__ == "__main__":
    main()
