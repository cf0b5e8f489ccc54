"""One-token forward cost of pyfam's oracle: full, with a self-draft's sublayers skipped, and everything skipped.

    python benchmarks/scripts/forward_cost.py [bfloat16|float32]     (from the repository root)
"""

import sys
import time

from spec_cli.core.families import Skip
from spec_cli.engine import Engine
from spec_cli.exec import Runner
from spec_cli.models import profiles

engine = Engine(profiles.load("benchmarks/pyfam.toml"), need_draft=False, dtype=sys.argv[1] if sys.argv[1:] else None)
runner = Runner(engine.oracle.model, capacity=512)
runner.forward(list(range(1, 200)), commit=199)
layers = runner.layers


def milliseconds(skip: Skip, n: int = 300) -> float:
    for _ in range(20):
        runner.forward([5], skip=skip)
        runner.keep([])
    start = time.perf_counter()
    for _ in range(n):
        runner.forward([5], skip=skip)
        runner.keep([])
    return (time.perf_counter() - start) / n * 1000


print(f"{engine.dtype}: one token after 199")
print(f"full forward                {milliseconds(Skip()):.2f} ms")
print(f"attention 2,4,6 + MLP 3,5   {milliseconds(Skip.of([2, 4, 6], [3, 5])):.2f} ms")
print(f"everything skipped          {milliseconds(Skip.of(range(layers), range(layers))):.2f} ms")
