"""spec's bfloat16 attention (`native/glue.cpp`), by its dot products and by float sums (AVX-512 BF16), or in
AVX2's own registers and through avx2.h's emulation (an AVX2 build), as a server's shared forward calls it:
`attend_parts`, several sequences' rows each over its own cache.

    python benchmarks/scripts/attention_cost.py [--heads 12 --kv-heads 2 --d 128 --layers 28] [--keys 420]

For each case (sequences x rows each, keys attended), ms a layer: every layer's caches its own (a model's caches
do not fit in the CPU's last cache, as a microbenchmark's one layer would), the two ways alternating in one
process, the better of three rounds each; and the keys and values read per second. The defaults are
Qwen2.5-Coder-1.5B's heads; `--heads 14 --d 64 --layers 24` the 0.5B's.
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
from spec_cli.exec import native  # noqa: E402


def layers_of(args, sequences: int, rows: int, keys: int) -> list[tuple]:
    """Each layer's attend_parts arguments: new rows at the end of `keys` slots, causal among themselves."""
    heads, kv, d = args.heads, args.kv_heads, args.d
    total = sequences * rows
    q = torch.randn(1, heads, total, d).bfloat16()
    k, v = (torch.randn(1, kv, total, d).bfloat16() for _ in range(2))
    mask = torch.zeros(rows, keys)
    mask[:, keys - rows:] = torch.triu(torch.full((rows, rows), float("-inf")), 1)
    mask = mask.bfloat16()
    out = []
    for _ in range(args.layers):
        caches = [torch.randn(2, 1, kv, keys + 64, d).bfloat16() for _ in range(sequences)]
        out.append((q, k, v, [c[0] for c in caches], [c[1] for c in caches], [rows] * sequences,
                    [keys - rows] * sequences, [None] * sequences, [keys] * sequences, [mask] * sequences, d**-0.5))
    return out


def seconds(kernels, layers, repeats: int = 4) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        for arguments in layers:
            kernels.attend_parts(*arguments)
    return (time.perf_counter() - start) / repeats / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--keys", type=int, default=420)
    parser.add_argument("--cases", default="16x1,16x2,16x4,1x1,1x8", help="sequences x rows each")
    args = parser.parse_args()
    kernels = native.int4()
    if kernels is None:
        sys.exit(f"spec's CPU kernels do not run here: {native.status()}")
    if kernels.attention_dots(-1):
        switch, names = kernels.attention_dots, {0: "float sums", 1: "dot products"}
    elif kernels.attention_avx2(-1):
        switch, names = kernels.attention_avx2, {0: "emulated", 1: "avx2 registers"}
    else:
        switch, names = kernels.attention_dots, {0: "float sums"}
    ways = sorted(names, reverse=True)
    print(f"{cpu_name()} · {torch.get_num_threads()} threads · {args.heads} heads, {args.kv_heads} kv heads, d "
          f"{args.d}, {args.layers} layers, {args.keys} keys")
    torch.manual_seed(0)
    for case in args.cases.split(","):
        sequences, rows = (int(x) for x in case.split("x"))
        layers = layers_of(args, sequences, rows, args.keys)
        best = {way: float("inf") for way in ways}
        for round_ in range(3):
            for way in ways if round_ % 2 == 0 else ways[::-1]:
                switch(way)
                seconds(kernels, layers, 1)
                best[way] = min(best[way], seconds(kernels, layers))
        read = sequences * args.keys * args.kv_heads * args.d * 2 * 2
        line = f"{sequences:3d} x {rows} rows: {names[0]} {best[0] * 1e3:.3f} ms a layer"
        if 1 in best:
            line += (f", {names[1]} {best[1] * 1e3:.3f} ({best[1] / best[0]:.2f}x; keys and values "
                     f"{read / best[1] / 1e9:.1f} GB/s)")
        print(line, flush=True)
    switch(1)


if __name__ == "__main__":
    main()
