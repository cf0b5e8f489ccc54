"""Ad hoc (session 38), from spec's root: the 1.5B's last hidden states (the head's input) with its argmax, on
(a) teacher-forced reads of Python's library and HumanEval's prompts (training), (b) its greedy paths (evaluation:
ids, prompt length, top-8 and hidden state of every position).

    python lone-oracle-fitted-heads-session38-capture.py GGUF train.npz eval.npz TOKENS PROMPTS.jsonl...
    SKIP=81920 python ... GGUF train2.npz unused.npz 81920      (the next 81,920 tokens of the same stream)
    python ... GGUF unused.npz cap.npz 0 PROMPTS.jsonl...          (the greedy paths alone: session 37's capture)
"""
import glob
import gzip
import json
import os
import random
import sys
import sysconfig
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from spec_cli.core.settings import ModelRef  # noqa: E402
from spec_cli.exec import Runner  # noqa: E402
from spec_cli.models.loading import load  # noqa: E402

K, CHUNK = 8, 512
path, train_out, eval_out, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
files = sys.argv[5:]
torch.set_grad_enabled(False)
loaded = load(ModelRef(path), torch.device("cpu"), torch.bfloat16, untested=True)
model, tok = loaded.model, loaded.tokenizer
runner = Runner(model, capacity=2048)
lean = runner.lean
seen = []
head = lean.head


def recording(x):
    seen.append(x.reshape(-1, x.shape[-1]).to(torch.float16))
    return head(x)


lean.head = recording

if budget:
    texts = [json.loads(l)["prompt"] for l in gzip.open("../shared/data/humaneval/HumanEval.jsonl.gz", "rt")]
    lib = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))
    random.Random(0).shuffle(lib)
    H, X, Y = [], [], []
    got, t0 = 0, time.time()
    pieces = iter(texts + [open(f, errors="ignore").read() for f in lib])
    pending = []
    skip = int(os.environ.get("SKIP", "0"))  # tokens of the stream passed over (a second capture's data goes on)
    while got < budget:
        while len(pending) < CHUNK:
            pending += tok(next(pieces), add_special_tokens=False)["input_ids"] + [tok.eos_token_id or 0]
        ids, pending = pending[:CHUNK], pending[CHUNK:]
        if skip > 0:
            skip -= len(ids)
            continue
        runner.reset()
        seen.clear()
        fw = runner.forward(ids, commit=len(ids), last=len(ids))
        H.append(torch.cat(seen)[-len(ids):])
        X.append(np.array(ids))
        Y.append(fw.logits.float().reshape(len(ids), -1).argmax(-1).numpy())
        got += len(ids)
        print(f"train {got} tokens {time.time() - t0:.0f}s", flush=True)
    np.savez(train_out, h=torch.cat(H).numpy(), x=np.stack(X), y=np.stack(Y))

data = {}
for f in files:
    for i, line in enumerate(open(f)):
        prompt = json.loads(line)["prompt"]
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        runner.reset()
        seen.clear()
        t = time.time()
        fw = runner.forward(ids, commit=len(ids), last=len(ids))
        tops = [fw.logits.float().topk(K, dim=-1).indices.reshape(len(ids), K)]
        nxt = int(tops[0][-1, 0])
        gen = [nxt]
        for _ in range(127):
            fw = runner.forward([nxt], commit=1)
            top = fw.logits.float().topk(K, dim=-1).indices.reshape(1, K)
            tops.append(top)
            nxt = int(top[0, 0])
            gen.append(nxt)
        key = f"{f.split('/')[-1]}:{i}"
        data[key + ":ids"] = np.array(ids + gen, dtype=np.int64)
        data[key + ":prompt"] = np.array([len(ids)])
        data[key + ":top"] = torch.cat(tops).numpy()
        data[key + ":h"] = torch.cat(seen).numpy()
        assert data[key + ":h"].shape[0] == len(ids) + 127, data[key + ":h"].shape
        print(key, len(ids), f"{time.time() - t:.1f}s", repr(tok.decode(gen[:20])), flush=True)
np.savez(eval_out, **data)
