"""Ad hoc (session 37), from spec's root: does a packed bfloat16 product (spec's packing.linear rule) give every row the bits it has at 2 rows,
at 1..70 rows, under this process's oneDNN ISA (ONEDNN_MAX_CPU_ISA)?"""
import os
import sys

import torch

sys.path.insert(0, ".")
from spec_cli.exec import packing  # noqa: E402

torch.manual_seed(0)
shapes = [tuple(map(int, s.split("x"))) for s in os.environ["SHAPES"].split(",")] if "SHAPES" in os.environ else [(768, 768), (768, 3072), (3072, 768), (1536, 1536), (1536, 8960), (8960, 1536), (896, 4864), (4864, 896), (2048, 50257)]
bad = 0
for i, o in shapes:
    lin = torch.nn.Linear(i, o, bias=True).to(torch.bfloat16)
    fwd = packing.linear([lin])
    x = torch.randn(70, i).to(torch.bfloat16)
    outs = {}
    for m in list(range(1, 41)) + [64, 70]:
        outs[m] = fwd(x[:m].unsqueeze(0))[0]
    base = outs[2]
    worst = []
    for m, y in outs.items():
        k = min(m, 2)
        diff = (y[:k] != base[:k]).any(dim=-1).sum().item()
        # each row against that row computed in the largest call
        diff2 = (y != outs[70][:m]).any(dim=-1).sum().item()
        if diff or diff2:
            worst.append((m, diff, diff2))
    bad += bool(worst)
    print(f"{i}x{o}: {'rows differ at ' + str(worst[:6]) if worst else 'every row the same at 1-40, 64, 70'}", flush=True)
print("ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "default"), "bad shapes", bad)
