"""Chains against one-token steps (logits' bits) on the HF path, bfloat16, float and int4 weights, per family."""
import random
import sys

sys.path.insert(0, "tests")
from pathlib import Path

import archs
import torch
from test_invariance import chain_equals_steps
from tiny import make_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from spec_cli.exec import Runner, backends, quant

archs.WIDTH = int(__import__("os").environ.get("WIDTH", "64"))
root = Path(f"/tmp/k44/archs{archs.WIDTH}"); root.mkdir(exist_ok=True, parents=True)
if not (root / "tokenizer").exists():
    make_tokenizer(root / "tokenizer")
tok = AutoTokenizer.from_pretrained(root / "tokenizer")

names = sys.argv[1:] or [n for n in archs.ARCHITECTURES if n.split("-")[0] not in backends.LEAN and "-rope-" not in n]
for name in names:
    folder = root / name
    if not folder.exists():
        archs.make(folder, name, len(tok), tokenizer=tok)
    out = [name]
    for kind in ("float", "int4"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        if kind == "int4":
            quant.quantize_model(model, "int4")
        quant.split_experts(model) if kind == "float" else None
        quant.route_rows_alone(model)
        r = Runner(model, capacity=512)
        rng = random.Random(5)
        bad = 0
        for c in range(20):
            prompt = [rng.randrange(1, 300) for _ in range(rng.choice((5, 37, 70)))]
            chain = [rng.randrange(1, 300) for _ in range(rng.choice((2, 3, 5, 9)))]
            bad += bool(chain_equals_steps(model, prompt, chain))
        out.append(f"{kind}: {bad}/20 lean={r.lean is not None} trees={r.exact_trees}")
    print(*out, flush=True)
