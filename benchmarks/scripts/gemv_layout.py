"""GPT-2's Conv1D (addmm with an [in, out] weight) against F.linear with the weight transposed once.

    python benchmarks/scripts/gemv_layout.py
"""

import time

import torch

torch.set_grad_enabled(False)


def microseconds(f, n: int = 500) -> float:
    for _ in range(20):
        f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e6


for dtype in (torch.bfloat16, torch.float32):
    x, w, b = torch.randn(1, 384, dtype=dtype), torch.randn(384, 1152, dtype=dtype), torch.randn(1152, dtype=dtype)
    wt = w.T.contiguous()
    print(f"{dtype}, one row, 384x1152: addmm {microseconds(lambda: torch.addmm(b, x, w)):.0f} us, "
          f"F.linear {microseconds(lambda: torch.nn.functional.linear(x, wt, b)):.0f} us")
