"""Ad hoc (session 40): fit heads of other sizes on one read of the library by the 1.5B; held-out agreement."""
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from spec_cli.core.settings import Draft2Ref, ModelRef, Profile
from spec_cli.draft2 import heads
from spec_cli.draft2.fit import corpus_files
from spec_cli.engine import Engine
from spec_cli.exec import Runner

oracle = sys.argv[1]
engine = Engine(Profile("alone", "", ModelRef(oracle), None, draft2=Draft2Ref("auto")))
model = engine.oracle.model
path = "/tmp/k40/reads.pt"
held = 8 * heads.PIECE
if os.path.exists(path):
    d = torch.load(path)
    reads = heads.Reads(d["hidden"], d["tokens"], d["targets"])
else:
    runner = Runner(model, vocab_size=engine.vocab_size, capacity=heads.PIECE)
    t = time.time()
    reads = heads.read(runner, heads.corpus_texts(corpus_files(None)), engine.tokenizer, int(sys.argv[2]) + held)
    print(f"read {reads.tokens.numel()} tokens in {time.time()-t:.0f} s", flush=True)
    torch.save({"hidden": reads.hidden, "tokens": reads.tokens, "targets": reads.targets}, path)
train, check = reads.split(held)
for spec_ in sys.argv[3:]:
    kw = dict(kv.split("=") for kv in spec_.split(","))
    kw = {k: int(v) for k, v in kw.items()}
    n = kw.pop("tokens", None)
    part = train if n is None else heads.Reads(train.hidden[: n // heads.PIECE], train.tokens[: n // heads.PIECE], train.targets[: n // heads.PIECE])
    t = time.time()
    saved = heads.fit(part, model, **kw)
    a = heads.agreement(heads.Heads(saved, model), check)
    print(f"{spec_}: held-out agreement {a:.3f} (fit {time.time()-t:.0f} s, {part.tokens.numel()} tokens)", flush=True)
