"""Ad hoc (session 41): families' tiny models with only what a GGUF file can say, written by llama.cpp's own
converter (-convert.py), read by spec, logits against the model's. From spec's root:

    python benchmarks/reports/gguf-as-llama-cpp-writes-session41-sweep.py WORK LLAMA_CPP SPM.model NAME...
"""
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

sys.path[:0] = [".", "tests"]  # (run from spec's root)
from tiny import make_tokenizer
from transformers import AutoModelForCausalLM

from spec_cli.core.settings import ModelRef
from spec_cli.models.loading import load

torch.set_grad_enabled(False)
root = Path(sys.argv.pop(1)); root.mkdir(exist_ok=True)
tok = make_tokenizer(root / "tok", 300)
L = sys.argv.pop(1)  # llama.cpp's folder in llama-cpp-python 0.3.36's sdist
SPM_MODEL = Path(sys.argv.pop(1))  # a sentencepiece tokenizer.model of 300 pieces, as tests/gguf_archs/make.py trains
S = dict(vocab_size=300, bos_token_id=0, eos_token_id=0, pad_token_id=0, hidden_size=64, intermediate_size=128,
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_hidden_layers=3, tie_word_embeddings=False)
SPM = dict(S, bos_token_id=2, eos_token_id=1, pad_token_id=0)
MODELS = {
    "qwen2": ("Qwen2Config", dict(S, rope_parameters=dict(rope_theta=1000000.0))),
    "qwen2-yarn": ("Qwen2Config", dict(S, rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(S, sliding_window=None, rope_parameters=dict(rope_theta=1000000.0))),
    "gemma2": ("Gemma2Config", dict(SPM, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True)),
    "gemma3_text": ("Gemma3TextConfig", dict(SPM, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(SPM, sliding_window=None)),
    "phi3-longrope": ("Phi3Config", dict(SPM, sliding_window=None, original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, long_factor=[1.0 + 0.5 * i for i in range(8)],
        short_factor=[1.0 + 0.05 * i for i in range(8)], original_max_position_embeddings=64))),
    "gemma3-linear": ("Gemma3TextConfig", dict(SPM, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True, num_hidden_layers=6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "gemma3-6": ("Gemma3TextConfig", dict(SPM, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True, num_hidden_layers=6)),
    "stablelm": ("StableLmConfig", dict(S, rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.25))),
}
for name in sys.argv[1:]:
    cls, kw = MODELS[name]
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    config = getattr(transformers, cls)(**kw)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2: p.normal_(0, 0.2)
    model.save_pretrained(folder)
    if kw is SPM or kw.get("bos_token_id") == 2:
        shutil.copy(str(SPM_MODEL), folder / "tokenizer.model")
    else:
        tok.save_pretrained(folder)
    out = root / f"{name}.gguf"
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(Path(__file__).name.replace("-sweep.py", "-convert.py"))), L, str(folder), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True)
    if done.returncode:
        last = [l for l in done.stderr.splitlines() if l.strip()][-1:]
        print(f"{name}: converter failed: {last}", flush=True); continue
    try:
        ours = load(ModelRef(str(out)), torch.device("cpu"), torch.float32, untested=True, say=lambda s: None).model
    except Exception as e:
        print(f"{name}: spec refused: {type(e).__name__}: {str(e)[:300]}", flush=True); continue
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[2, 17, 42, 99, 5, 250, 7, 64, 128, 33, 201, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    a, b = hf(ids).logits, ours(ids).logits
    print(f"{name} (-> {ours.config.model_type}): max |diff| {(a - b).abs().max().item():.3g}", flush=True)
