"""Ad hoc (session 41): spec's Q4_K product (native.int4().mm) of a random N x K weight at 64, 128 and 512 rows:
GMAC/s.    python amx-q4k-whole-sums-session41-micro.py 17920 1536"""
import sys
import time

import torch

sys.path[:0] = [".", "tests"]  # (run from spec's root)
from tiny import K_QUANTS

from spec_cli.exec import native, quant
from spec_cli.models import gguf_blocks

torch.manual_seed(0)
N, K = int(sys.argv[1]), int(sys.argv[2])
w = torch.randn(N, K) * 0.05
m = quant.Quantized.int4_super(*gguf_blocks.q4_k(K_QUANTS["Q4_K"](w.numpy()), N, K), torch.device("cpu"))
k = native.int4()
for M in (64, 128, 512):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    k.mm(x, m.values, m.scales)
    t = time.perf_counter(); n = 5
    for _ in range(n): k.mm(x, m.values, m.scales)
    dt = (time.perf_counter() - t) / n
    print(f"M={M}: {M*N*K/dt/1e9:.0f} GMAC/s ({dt*1000:.1f} ms)")
