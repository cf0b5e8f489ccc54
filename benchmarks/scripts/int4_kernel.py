"""spec's int4 kernel against torch's on SmolLM2-135M's four products a layer (qkv 960x576, out 576x576, gate+up
3072x576, down 576x1536), random weights, by rows: microseconds a layer and for 30 layers (hot caches: in a
model the weights stream from memory, so a forward costs more).

    python benchmarks/scripts/int4_kernel.py [--rows 1,2,4,5,8,16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec_cli.core.hardware import cpu_name  # noqa: E402
from spec_cli.exec import native, quant  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def bench(f, reps=200) -> float:
    for _ in range(10):
        f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    args = parser.parse_args()
    kernel = native.int4()
    if kernel is None:
        sys.exit(f"spec's int4 kernel does not run here: {native.status()}")
    torch.manual_seed(0)
    weights = []
    for out_features, in_features in SHAPES:
        nibbles, scales, zeros = quant.int4_of(torch.randn(out_features, in_features))
        ours = quant.Quantized.int4(nibbles, scales, zeros, torch.device("cpu"))
        torch_values = quant.pack_int4(nibbles, torch.device("cpu"))
        weights.append((ours.values, ours.scales, torch_values))
    print(f"{cpu_name()}, {torch.get_num_threads()} threads")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        theirs = bench(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, t, 32, s)
                                for x, (_, s, t) in zip(xs, weights)])
        mine = bench(lambda: [kernel.mm(x, v, s) for x, (v, s, _) in zip(xs, weights)])
        print(f"{rows:3} rows  torch {theirs:6.0f} us a layer  spec {mine:5.0f}  x30 layers: "
              f"{theirs * 30 / 1000:6.2f} vs {mine * 30 / 1000:5.2f} ms")


if __name__ == "__main__":
    main()
