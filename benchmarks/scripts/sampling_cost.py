"""What sampling costs the host: coupled scores (`Noise.scores`: warping by temperature, top-k and top-p, plus the
Gumbel noise) for one row and for a tree's rows, at a vocabulary of the Qwen pair's size, random peaked logits (or
`--oracle MODEL`'s own: its rows over 8 code prompts' greedy text, as a language model's rows are: a few words far
above the rest); by torch's operations, and by spec's CPU kernels where they build (one call a row set: top-k,
top-p alone, temperature alone over the words that can win; the noise by theirs).

    python benchmarks/scripts/sampling_cost.py [--vocab 151936] [--seconds 3] [--oracle $QWEN_1_5B]
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--oracle", default=None, help="a model whose own logits to score (else random ones)")
    args = parser.parse_args()
    real = own_logits(args.oracle) if args.oracle else None
    if real is not None:
        args.vocab = real.shape[1]
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
                logits = (torch.randn(rows, args.vocab, generator=generator) * 4 if real is None
                          else real[torch.randint(len(real), (rows,), generator=generator)])
                start, calls, position = time.perf_counter(), 0, 100
                while time.perf_counter() - start < args.seconds:
                    noise.scores(logits, position + torch.arange(rows) % span)
                    position, calls = position + max(1, span * 2 // 3), calls + 1
                line.append(f"{rows} rows {(time.perf_counter() - start) / calls * 1000:.3f} ms")
            print(f"{settings} by {way}: " + ", ".join(line))

def own_logits(oracle: str, tokens: int = 32) -> torch.Tensor:
    """The oracle's float32 logits at each position of its greedy text after each of 8 code prompts."""
    from spec_cli.completion import complete
    from spec_cli.core.settings import Decoding, ModelRef, Profile
    from spec_cli.engine import Engine

    engine = Engine(Profile(name="oracle", source="--oracle", oracle=ModelRef(oracle), draft=None))
    runner, rows = engine._runner("oracle", engine.oracle.model, 1024), []
    prompts = (Path(__file__).resolve().parents[1] / "prompts" / "code-8.jsonl").read_text().splitlines()
    for line in prompts:
        ids = engine.encode(json.loads(line)["prompt"])
        text = ids + complete(engine, ids, Decoding(method="baseline", max_new_tokens=tokens)).tokens
        runner.reset()
        rows.append(runner.forward(text, commit=len(text), last=len(text) - len(ids)).logits.float())
        runner.reset()
    return torch.cat(rows)


if __name__ == "__main__":
    main()
