"""What one token of plain decoding reads and where its time goes: the oracle's weights by part (layers, head)
and format, in bytes and bits a weight, and a baseline completion's milliseconds a token in the layers, the head
and the rest, with the bandwidth that implies. The yardstick for the weight formats (llama.cpp reads the file's
own bytes: its size less the token embeddings).

    python benchmarks/scripts/bytes_per_token.py --oracle $QWEN_1_5B [-n 64] [--prompt "def quicksort(xs):"]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from spec_cli.completion import complete
from spec_cli.core.hardware import cpu_name
from spec_cli.engine import Engine
from spec_cli.exec import quant
from spec_cli.models import profiles


def weights(model) -> tuple[Counter, Counter]:
    """Bytes and weights of every projection, by (part, format, group)."""
    read, count = Counter(), Counter()
    for name, module in model.named_modules():
        part = "head" if "lm_head" in name else "layers"
        if isinstance(module, quant.Quantized):
            key = (part, module.kind, module.group)
            read[key] += sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
            count[key] += module.out_features * module.in_features
        elif isinstance(module, torch.nn.Linear):
            key = (part, str(module.weight.dtype).removeprefix("torch."), 0)
            read[key] += module.weight.numel() * module.weight.element_size()
            count[key] += module.weight.numel()
    return read, count


class Timed:
    """A layer stack's `run`, timed."""

    def __init__(self, inner, seconds: dict):
        self.inner, self.seconds = inner, seconds

    def run(self, *args):
        started = time.perf_counter()
        out = self.inner.run(*args)
        self.seconds["layers"] += time.perf_counter() - started
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--oracle", required=True)
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--prompt", default="def quicksort(xs):")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    profile = profiles.select(None, oracle=args.oracle)
    engine = Engine(profile, need_draft=False)
    read, count = weights(engine.oracle.model)
    for key in sorted(read):
        print(f"{key[0]:7} {key[1]:9} group {key[2]:3}: {read[key] / 2**20:7.0f} MiB, "
              f"{8 * read[key] / count[key]:.2f} bits a weight")
    total = sum(read.values())
    print(f"read a token: {total / 2**20:.0f} MiB")
    plan = engine.plan(profile.decoding.replace(method="baseline", max_new_tokens=args.n))
    ids = engine.encode(args.prompt)
    complete(engine, ids, plan)  # warm
    lean = engine._models(plan, len(ids) + args.n + 8).oracle.lean
    if lean is None or lean.stack is None:
        raise SystemExit("this model's layers do not run as one call here: no split to time")
    seconds = {"layers": 0.0, "head": 0.0}
    lean.stack, logits = Timed(lean.stack, seconds), lean.logits

    def timed_logits(x):
        started = time.perf_counter()
        out = logits(x)
        seconds["head"] += time.perf_counter() - started
        return out

    lean.logits = timed_logits
    started = time.perf_counter()
    done = complete(engine, ids, plan)
    wall = time.perf_counter() - started
    n = len(done.tokens)
    each = {k: 1000 * v / n for k, v in seconds.items()}
    per = 1000 * wall / n
    print(f"{cpu_name()}, {n} tokens, {torch.get_num_threads()} threads: {per:.1f} ms a token; layers "
          f"{each['layers']:.1f} ms, head {each['head']:.1f} ms, the rest {per - each['layers'] - each['head']:.1f} ms; "
          f"{total / 2**30 / (wall / n):.1f} GiB/s of weights")


if __name__ == "__main__":
    main()
