"""Ad hoc (session 42): resident memory of a GGUF model after its load, a runner, a 30-token prompt and 20 steps
(MiB from /proc/self/statm), and the peak. PYTHONPATH picks which spec."""
import resource
import sys

import torch

from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner
from spec_cli.models.loading import load


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20



torch.set_grad_enabled(False)
print("start", round(rss()))
m = load(ModelRef(sys.argv[1]), torch.device("cpu"), torch.bfloat16, untested=True, say=lambda s: None).model
print("loaded", round(rss()), "peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
r = Runner(m, capacity=512)
print("runner", round(rss()))
r.forward(list(range(10, 40)), commit=30)
print("prompt", round(rss()))
for i in range(20): r.forward([7 + i], commit=1)
print("20 steps", round(rss()), "peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
