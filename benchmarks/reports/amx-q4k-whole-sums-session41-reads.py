"""Ad hoc (session 41): spec's prompt reads of HumanEval's text (prompts and solutions joined) on one GGUF file,
tokens a second at each length (3 timings each; ROUNDS=N: N, session 45), and how many (16 rows, super-block)
pairs of Q4_K's tile products went group by group."""
import gzip
import json
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from spec_cli.core.hardware import cpu_name
from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner, native
from spec_cli.models.loading import load

torch.set_grad_enabled(False)
path, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
text = "".join(json.loads(l)["prompt"] + json.loads(l)["canonical_solution"]
               for l in gzip.open("../shared/data/humaneval/HumanEval.jsonl.gz", "rt"))
loaded = load(ModelRef(path), torch.device("cpu"), torch.bfloat16, untested=True)
ids = loaded.tokenizer(text)["input_ids"]
kernel = native.int4()
print(f"CPU: {cpu_name()}, threads {torch.get_num_threads()}, tiles {kernel.tiles()}")
for n in sizes:
    runner = Runner(loaded.model, capacity=n + 64)
    runner.forward(ids[:n], commit=n, last=1)
    grouped = getattr(kernel, "tiles_groupwise", lambda: None)()
    rates = []
    for r in range(int(os.environ.get("ROUNDS", 3))):
        runner.reset()
        t = time.perf_counter(); runner.forward(ids[n * r: n * (r + 1)], commit=n, last=1)
        rates.append(n / (time.perf_counter() - t))
    grouped = getattr(kernel, "tiles_groupwise", lambda: None)()
    print(f"{n} tokens: " + " ".join(f"{x:.0f}" for x in rates) + f" tok/s; group by group: {grouped}", flush=True)
