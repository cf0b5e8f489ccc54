"""ms a forward by rows, the lean loop against the model's own forward, one model (bfloat16, spec's load)."""
import sys
import time

import torch

from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner
from spec_cli.models.loading import load

model = load(ModelRef(sys.argv[1]), torch.device("cpu"), torch.bfloat16, untested=True, say=lambda l: None).model
prompt = list(range(100, 164))
for rep in range(2):
    for lean in (True, False):
        r = Runner(model, capacity=1024, lean=lean)
        r.forward(prompt, commit=len(prompt))
        out = []
        for rows in (1, 2, 4, 8, 16):
            ids = list(range(200, 200 + rows))
            for _ in range(2): r.forward(ids)
            t = time.perf_counter(); n = 6
            for _ in range(n): r.forward(ids)
            out.append(f"{rows}:{(time.perf_counter() - t) / n * 1000:.1f}")
        print("lean" if lean else "own ", "ms by rows", " ".join(out), "trees exact", r.exact_trees, flush=True)
