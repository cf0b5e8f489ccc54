"""Ad hoc (session 40): Q4_K gate+up/down products of 24 distinct layers (from memory, as in a model), then one layer's weights 24 times (in cache), by rows; SPEC_AMX_FEW (the patch beside this file) picks tiles or VNNI.

    SPEC_AMX_FEW=1000|9 python serve-lone-heads-session40-amx-cold.py 1,8,16     (from spec's root)
"""
import os
import sys
import time

import torch

sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from tiny import K_QUANTS  # noqa: E402

from spec_cli.exec import native, quant  # noqa: E402
from spec_cli.models import gguf_blocks  # noqa: E402

torch.manual_seed(0)
k = native.int4()
base = []
for n, kk in ((8960 * 2, 1536), (1536, 8960)):
    w = torch.randn(n, kk) * 0.02
    base.append(quant.Quantized.int4_super(*gguf_blocks.q4_k(K_QUANTS["Q4_K"](w.numpy()), n, kk), torch.device("cpu")))
layers = [[(m.values.clone(), m.scales.clone()) for m in base] for _ in range(24)]


def timed(weights, what):
    for rows in [int(r) for r in sys.argv[1].split(",")]:
        xs = [torch.randn(rows, 1536).bfloat16(), torch.randn(rows, 8960).bfloat16()]
        f = lambda: [k.mm(x, v, s) for layer in weights for x, (v, s) in zip(xs, layer)]  # noqa: E731
        f()
        t = time.perf_counter(); reps = 5
        for _ in range(reps): f()
        print(f"FEW={os.environ.get('SPEC_AMX_FEW')} rows {rows}: {(time.perf_counter()-t)/reps*1000:.1f} ms for 24 layers{what}")


timed(layers, "")
timed([layers[0]] * 24, ", one layer's weights (hot)")
