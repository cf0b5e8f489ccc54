import gzip
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner
from spec_cli.models.loading import load

torch.set_grad_enabled(False)
n = int(sys.argv[2])
text = "".join(json.loads(l)["prompt"] + json.loads(l)["canonical_solution"] for l in gzip.open("../shared/data/humaneval/HumanEval.jsonl.gz", "rt"))
loaded = load(ModelRef(sys.argv[1]), torch.device("cpu"), torch.bfloat16, untested=True)
ids = loaded.tokenizer(text)["input_ids"]
runner = Runner(loaded.model, capacity=n + 64)
runner.forward(ids[:512], commit=512, last=1)
runner.reset()
t = time.perf_counter(); runner.forward(ids[:n], commit=n, last=1); print(n / (time.perf_counter() - t), "tok/s", flush=True)
