"""What quantizing a product's activations to int8 costs in spec's CPU kernel: products of 16 outputs (their
weights nothing to read) at the 1.5B's input widths, by rows; the time is the activations' quantization and the
call.

    python benchmarks/scripts/quantize_cost.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec_cli.core.hardware import cpu_name  # noqa: E402
from spec_cli.exec import native  # noqa: E402


def main() -> None:
    torch.set_grad_enabled(False)
    module = native.int4()
    if module is None:
        raise SystemExit(f"spec's kernel does not run here: {native.status()}")
    print(f"{cpu_name()}, {torch.get_num_threads()} threads")
    for inputs in (1536, 8960):
        for rows in (1, 4, 16):
            weights = torch.randint(0, 255, (16 * inputs // 2,), dtype=torch.uint8)
            scales = torch.randn(inputs // 32, 16, 2).to(torch.bfloat16)
            x = torch.randn(rows, inputs, dtype=torch.bfloat16)
            for _ in range(100):
                module.mm(x, weights, scales)
            start = time.perf_counter()
            for _ in range(2000):
                module.mm(x, weights, scales)
            print(f"{inputs:5} inputs, {rows:2} rows: {(time.perf_counter() - start) / 2000 * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
