"""Ad hoc (session 39), from spec's root: what loading a model's fitted heads adds to a plan, and what one step's
guesses cost (head 1 alone, and with head 2 under its first guess), with torch's profile of the latter.

    SPEC_CACHE_DIR=DIR python lone-oracle-heads-session39-time.py GGUF
"""
import sys
import time

import torch

sys.path.insert(0, ".")
from spec_cli.core.settings import Decoding  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402
from spec_cli.models import profiles  # noqa: E402

engine = Engine(profiles.select(None, sys.argv[1], None, "default"))
started = time.perf_counter()
heads = engine.plan(Decoding(method="staged")).heads
print("plan (loads heads)", time.perf_counter() - started)
x = torch.randn(engine.oracle.model.config.hidden_size, dtype=engine.dtype)
for below in (0, 1):
    for _ in range(20):
        heads.guesses(x, 1234, below=below)
    started = time.perf_counter()
    for _ in range(200):
        heads.guesses(x, 1234, below=below)
    print("below", below, (time.perf_counter() - started) / 200 * 1e3, "ms")
with torch.profiler.profile() as profile:
    for _ in range(50):
        heads.guesses(x, 1234)
print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
