"""What sampling costs the host: coupled scores (`Noise.scores`: warping by temperature, top-k and top-p, plus the
Gumbel noise) for one row and for a tree's rows, at a vocabulary of the Qwen pair's size, random peaked logits; by
torch's operations, and by spec's CPU kernels where they build (top-k in one kernel call, the noise by theirs).

    python benchmarks/scripts/sampling_cost.py [--vocab 151936] [--seconds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec_cli.core.hardware import cpu_name  # noqa: E402
from spec_cli.decoding.coupling import Noise  # noqa: E402
from spec_cli.decoding.sampling import Sampler, make_generator  # noqa: E402
from spec_cli.exec import native  # noqa: E402

SETTINGS = [dict(temperature=1.0, top_k=50), dict(temperature=0.8, top_p=0.95),
            dict(temperature=1.0, top_k=50, top_p=0.95), dict(temperature=1.0)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; vocabulary {args.vocab}")
    generator = torch.Generator().manual_seed(0)
    kernels = native.int4()
    ways = {"torch": None, "kernels": kernels} if kernels is not None else {"torch": None}
    for settings in SETTINGS:
        sampler = Sampler(**settings, coupled=True)
        for way, chosen in ways.items():
            noise = Noise(sampler, make_generator(1), args.vocab, "cpu", 100)
            noise.kernels = chosen
            line = []
            for rows, span in ((1, 1), (12, 6)):  # a plain step; a tree of 12 rows over 6 positions
                logits = torch.randn(rows, args.vocab, generator=generator) * 4
                start, calls, position = time.perf_counter(), 0, 100
                while time.perf_counter() - start < args.seconds:
                    noise.scores(logits, position + torch.arange(rows) % span)
                    position, calls = position + max(1, span * 2 // 3), calls + 1
                line.append(f"{rows} rows {(time.perf_counter() - start) / calls * 1000:.3f} ms")
            print(f"{settings} by {way}: " + ", ".join(line))

if __name__ == "__main__":
    main()
