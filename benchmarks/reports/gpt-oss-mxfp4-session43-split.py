"""Ad hoc (session 43): where a one-token forward of a gpt-oss file goes (its experts, router, attention), warm,
2 threads: python gpt-oss-mxfp4-session43-split.py FILE.gguf."""
import sys
import time

import torch

from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner
from spec_cli.models.loading import load

torch.set_grad_enabled(False)
m = load(ModelRef(sys.argv[1]), torch.device("cpu"), torch.bfloat16, untested=True, say=lambda s: None).model
r = Runner(m, capacity=1024)
r.forward(list(range(10, 138)), commit=128)
spent = {"experts": 0.0, "router": 0.0, "attn": 0.0}
def timed(mod, key):
    f = mod.forward
    def g(*a, **k):
        t = time.perf_counter(); y = f(*a, **k); spent[key] += time.perf_counter() - t; return y
    mod.forward = g
for layer in m.model.layers:
    timed(layer.mlp.experts, "experts"); timed(layer.mlp.router, "router"); timed(layer.self_attn, "attn")
for k in range(3):
    for key in spent: spent[key] = 0.0
    t = time.perf_counter()
    for i in range(10): r.forward([100 + i], commit=0)
    total = (time.perf_counter() - t) / 10
    print(f"forward {1000*total:.1f} ms; " + ", ".join(f"{k} {1000*v/10:.1f}" for k, v in spent.items()))
# the products alone: every expert's gate_up and down once, one row
e = m.model.layers[0].mlp.experts
x = torch.randn(1, 2880).bfloat16()
t = time.perf_counter()
for i in range(20):
    for j in range(4):
        both, down = e._call(j); y = both(x); down(y[:, :2880])
print(f"4 experts' products alone: {1000*(time.perf_counter()-t)/20:.2f} ms a layer")
