"""Ad hoc (session 40): heads fitted on the first 82k / all 164k tokens of one library read, scored on HumanEval's
prompts and solutions read by the oracle (text from no file of the library)."""
import gzip
import json
import sys

import torch

sys.path.insert(0, ".")
from spec_cli.core.settings import Draft2Ref, ModelRef, Profile
from spec_cli.draft2 import heads
from spec_cli.engine import Engine
from spec_cli.exec import Runner

oracle = sys.argv[1]
engine = Engine(Profile("alone", "", ModelRef(oracle), None, draft2=Draft2Ref("auto")))
model = engine.oracle.model
d = torch.load("/tmp/k40/reads.pt")
reads = heads.Reads(d["hidden"], d["tokens"], d["targets"])
train, lib_check = reads.split(8 * heads.PIECE)
runner = Runner(model, vocab_size=engine.vocab_size, capacity=heads.PIECE)
texts = [p["prompt"] + p["canonical_solution"] for p in map(json.loads, gzip.open("../shared/data/humaneval/HumanEval.jsonl.gz", "rt"))]
he = heads.read(runner, texts, engine.tokenizer, 8 * heads.PIECE)
for spec_ in sys.argv[2:]:
    kw = {k: int(v) for k, v in (kv.split("=") for kv in spec_.split(","))}
    n = kw.pop("tokens", None)
    part = heads.Reads(train.hidden[: n // heads.PIECE], train.tokens[: n // heads.PIECE], train.targets[: n // heads.PIECE])
    saved = heads.fit(part, model, **kw)
    h = heads.Heads(saved, model)
    print(f"{spec_}: HumanEval {heads.agreement(h, he):.3f}  library tail {heads.agreement(h, lib_check):.3f}", flush=True)
