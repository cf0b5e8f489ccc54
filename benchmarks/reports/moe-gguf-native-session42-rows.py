"""Ad hoc (session 42): a GGUF model's forward cost by the rows it verifies (a chain after a 128-token prompt),
and its one-token forward, warm, 2 threads. PYTHONPATH picks which spec."""
import sys
import time

import torch

import spec_cli
from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner
from spec_cli.models.loading import load

torch.set_grad_enabled(False)
print("spec from", spec_cli.__file__)
m = load(ModelRef(sys.argv[1]), torch.device("cpu"), torch.bfloat16, untested=True, say=lambda s: None).model
r = Runner(m, capacity=1024)
r.forward(list(range(10, 138)), commit=128)
for rows in [int(x) for x in sys.argv[2].split(",")]:
    times = []
    for rep in range(12):
        ids = [(7 * rep + 13 * i) % 40000 + 100 for i in range(rows)]
        t = time.perf_counter(); r.forward(ids, commit=0); times.append(time.perf_counter() - t)
    times.sort()
    print(f"{rows} rows: {1000 * times[len(times) // 2]:.1f} ms (median of 12)", flush=True)
