"""Ad hoc (session 37), from spec's root: torch's CPU attention as `backends.attend` runs it, bfloat16, 6 heads of 64,
causal masks: how often an n-query call gives its last row other bits than that row alone (N draws).

    N=1000 python benchmarks/reports/onednn-isa-caps-session37-attention.py 1 2 33 34 65
"""
import os
import sys

import torch

sys.path.insert(0, ".")
from spec_cli.exec.backends import additive, attend  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
d, heads = 64, 6
for n, span_len in [(n, -(-n // 64) * 64) for n in map(int, sys.argv[1:])]:
    bad = 0
    for t in range(int(os.environ.get("N", "150"))):
        k = torch.randn(1, heads, span_len, d).bfloat16(); v = torch.randn(1, heads, span_len, d).bfloat16()
        q = torch.randn(1, heads, n, d).bfloat16()
        allowed = torch.arange(span_len)[None, :] <= torch.arange(n)[:, None]
        mask = additive(allowed[None, None], torch.bfloat16)
        out = attend(q, k, v, mask, 0.125)
        last = attend(q[:, :, -1:], k, v, mask[:, :, -1:], 0.125)
        bad += not torch.equal(out[:, :, -1:], last)
    print(n, span_len, bad, flush=True)
