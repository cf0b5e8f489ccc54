"""Ad hoc (session 37), from spec's root: the 1.5B's greedy path and each position's top-K (prompt rows too), for offline drafting simulations."""
import json
import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from spec_cli.core.settings import ModelRef  # noqa: E402
from spec_cli.exec import Runner  # noqa: E402
from spec_cli.models.loading import load  # noqa: E402

K = 8
path, out = sys.argv[1], sys.argv[2]
files = sys.argv[3:]
torch.set_grad_enabled(False)
loaded = load(ModelRef(path), torch.device("cpu"), torch.bfloat16, untested=True)
model, tok = loaded.model, loaded.tokenizer
runner = Runner(model, capacity=2048)
data = {}
for f in files:
    for i, line in enumerate(open(f)):
        prompt = json.loads(line)["prompt"]
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        runner.reset()
        t = time.time()
        fw = runner.forward(ids, commit=len(ids), last=len(ids))
        tops = [fw.logits.float().topk(K, dim=-1).indices.reshape(len(ids), K)]
        nxt = int(tops[0][-1, 0])
        gen = [nxt]
        for _ in range(127):
            fw = runner.forward([nxt], commit=1)
            top = fw.logits.float().topk(K, dim=-1).indices.reshape(1, K)
            tops.append(top)
            nxt = int(top[0, 0]); gen.append(nxt)
        key = f"{f.split('/')[-1]}:{i}"
        data[key + ":ids"] = np.array(ids + gen, dtype=np.int64)
        data[key + ":prompt"] = np.array([len(ids)])
        data[key + ":top"] = torch.cat(tops).numpy()
        print(key, len(ids), f"{time.time()-t:.1f}s", repr(tok.decode(gen[:20])), flush=True)
np.savez(out, **data)
