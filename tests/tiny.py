"""Tiny random models and a tiny tokenizer, built from configs with save_pretrained: no downloads."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import os\nimport sys\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Hello world!\n",
]


def make_tokenizer(folder: Path, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)
    return fast


def make_model(folder: Path, arch: str, vocab_size: int, layers: int, width: int, seed: int,
               init: float = 0.2, context: int = 256, tokenizer=None):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    if arch == "qwen2":  # (q, k and v with biases, set to random values below: a dropped one shows)
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=context, initializer_range=init, rope_theta=10000.0,
                             bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
    elif arch in ("qwen3_moe", "mixtral"):  # (Qwen3's six experts, three a token, its q and k heads normed;
        # Mixtral's four, two a token)
        from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

        shape = dict(vocab_size=vocab_size, hidden_size=width, intermediate_size=width, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                     initializer_range=init, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
        config = (Qwen3MoeConfig(**shape, head_dim=width // 4, num_experts=6, num_experts_per_tok=3,
                                 moe_intermediate_size=width, norm_topk_prob=True, rope_theta=10000.0)
                  if arch == "qwen3_moe" else MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                                                            rope_theta=10000.0))
        model = AutoModelForCausalLM.from_config(config)
    elif arch == "gpt_oss":  # (four experts, two a token, with biases; heads of 32 (not width / heads); every
        # other layer sliding over 8 tokens; its YaRN rope; its attention sinks)
        from transformers import AutoModelForCausalLM, GptOssConfig

        config = GptOssConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=width,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                              max_position_embeddings=context, initializer_range=init, bos_token_id=0,
                              eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=width, n_layer=layers,
                            n_head=4, initializer_range=init, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=context, initializer_range=init, rope_theta=10000.0,
                             bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # random weights big enough that distributions are peaked and models disagree
        for name, p in model.named_parameters():
            if p.dim() >= 2 or (arch == "qwen2" and name.endswith("proj.bias")):  # (3-d: experts)
                p.normal_(0, init)
            elif arch == "gpt_oss" and not name.endswith("norm.weight"):  # (biases, sinks: each one's own)
                p.normal_(0, init)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def make_noisy_copy(source: Path, folder: Path, noise: float, seed: int):
    """A draft that agrees with its oracle often but not always: the oracle's weights plus noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise * (p.std() if p.numel() > 1 else 0))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def _k_quant(weight, levels: int):
    """A Q4_K or Q5_K super-block's parts of a float weight [rows, columns] (columns in 256s): (values [rows,
    blocks, 8, 32] in 0..levels, head bytes: d and dmin halves and the 12 bytes of 6-bit scales and mins)."""
    import numpy as np

    w = np.asarray(weight, dtype=np.float32)
    rows = w.shape[0]
    sub = w.reshape(rows, -1, 8, 32)
    low, high = sub.min(-1), sub.max(-1)
    scale, minimum = (high - np.minimum(low, 0)) / levels, np.maximum(-low, 0)
    d = np.maximum(scale.max(-1), 1e-8) / 63
    dmin = np.maximum(minimum.max(-1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(minimum / dmin[..., None]), 0, 63).astype(np.uint8)
    step = d16.astype(np.float32)[..., None] * sc
    offset = dmin16.astype(np.float32)[..., None] * mn
    q = np.clip(np.round((sub + offset[..., None]) / step[..., None]), 0, levels).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1)
    return q, np.concatenate([d16[..., None].view(np.uint8), dmin16[..., None].view(np.uint8), packed], -1)


def q4_k(weight):
    """llama.cpp's Q4_K blocks of a float weight [rows, columns] (columns in 256s), as bytes [rows, ...]: the
    gguf package reads them but does not write them. Per 32 weights a 6-bit scale and min under two halves."""
    import numpy as np

    q, head = _k_quant(weight, 15)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*q.shape[:2], 128)
    return np.concatenate([head, qs], -1).reshape(q.shape[0], -1)


def q5_k(weight):
    """llama.cpp's Q5_K blocks of a float weight [rows, columns] (columns in 256s): Q4_K's scales and mins, each
    value's fifth bit in 32 bytes of its own."""
    import numpy as np

    q, head = _k_quant(weight, 31)
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)  # bit j: sub-block j
    low = q & 15
    qs = (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).reshape(*q.shape[:2], 128)
    return np.concatenate([head, fifth, qs], -1).reshape(q.shape[0], -1)


def q6_k(weight):
    """llama.cpp's Q6_K blocks of a float weight [rows, columns] (columns in 256s): 6-bit values (q - 32) under
    an 8-bit scale per 16 and a half-precision one per 256; low nibbles, then 2-bit high pairs, scales, d."""
    import numpy as np

    w = np.asarray(weight, dtype=np.float32)
    rows = w.shape[0]
    sub = w.reshape(rows, -1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(scale.max(-1), 1e-8) / 127
    d16 = d.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[..., None]), 1, 127).astype(np.int8)
    step = d16.astype(np.float32)[..., None] * sc
    q = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    low, high = q & 15, q >> 4  # [rows, blocks, half, quarter, 32]
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(rows, -1, 2, 64)  # values l and 64 + l of a half
    qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                             d16[..., None].view(np.uint8)], -1)
    return blocks.reshape(rows, -1)


K_QUANTS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}  # (the gguf package reads these but does not write them)


def make_gguf(source: Path, path: Path, kind: str = "Q4_0", head: bool = True, embedding: str = "Q8_0",
              kinds: dict | None = None) -> Path:
    """A tiny Llama or Qwen2 (from `source`, a folder make_model wrote with a tokenizer) as a GGUF file: its
    projections in `kind` (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 or F32; `kinds` names others per
    projection, {"attn_v": "Q6_K"}), norms and biases float32, the embedding in `embedding`, a Llama's query and
    key rows permuted as llama.cpp's converter does; the tokenizer as a GPT-2 style BPE. `head` False leaves the
    output out (tied)."""
    import json

    import gguf
    import numpy as np
    from gguf.quants import quantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    arch = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss"}.get(config.model_type,
                                                                                   config.model_type)  # (as llama.cpp)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None)
                              else config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if arch == "gpt-oss":  # (as llama.cpp's converter writes it)
            rope = config.rope_parameters
            writer.add_expert_feed_forward_length(config.intermediate_size)
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
            writer.add_sliding_window(config.sliding_window)
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def add(name, array, as_kind):
        array = np.ascontiguousarray(array, dtype=np.float32)
        if as_kind == "F32":
            writer.add_tensor(name, array)
            return
        flat = array.reshape(-1, array.shape[-1])  # (experts [n, out, in]: their rows one after another)
        if as_kind in K_QUANTS:
            raw = K_QUANTS[as_kind](flat)
        else:
            raw = quantize(flat, gguf.GGMLQuantizationType[as_kind])
        writer.add_tensor(name, raw.reshape(*array.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[as_kind])

    add("token_embd.weight", state["model.embed_tokens.weight"], embedding)
    add("output_norm.weight", state["model.norm.weight"], "F32")
    if head:
        add("output.weight", state["lm_head.weight"], (kinds or {}).get("output", kind))
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for i in range(config.num_hidden_layers):
        add(f"blk.{i}.attn_norm.weight", state[f"model.layers.{i}.input_layernorm.weight"], "F32")
        add(f"blk.{i}.{'post_attention_norm' if arch == 'gpt-oss' else 'ffn_norm'}.weight",
            state[f"model.layers.{i}.post_attention_layernorm.weight"], "F32")
        if arch == "gpt-oss":  # (its sinks, its router's bias; its experts' gate and up interleaved, [in, out])
            add(f"blk.{i}.attn_sinks.weight", state[f"model.layers.{i}.self_attn.sinks"], "F32")
            add(f"blk.{i}.ffn_gate_inp.weight", state[f"model.layers.{i}.mlp.router.weight"], "F32")
            add(f"blk.{i}.ffn_gate_inp.bias", state[f"model.layers.{i}.mlp.router.bias"], "F32")
            both = state[f"model.layers.{i}.mlp.experts.gate_up_proj"].swapaxes(1, 2)
            bias = state[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"]
            parts = {"ffn_gate_exps": (both[:, ::2], bias[:, ::2]), "ffn_up_exps": (both[:, 1::2], bias[:, 1::2]),
                     "ffn_down_exps": (state[f"model.layers.{i}.mlp.experts.down_proj"].swapaxes(1, 2),
                                       state[f"model.layers.{i}.mlp.experts.down_proj_bias"])}
            for short, (w, b) in parts.items():
                add(f"blk.{i}.{short}.weight", w, (kinds or {}).get(short.removesuffix("_exps"), kind))
                add(f"blk.{i}.{short}.bias", b, "F32")
        for norm in ("q_norm", "k_norm"):
            if f"model.layers.{i}.self_attn.{norm}.weight" in state:
                add(f"blk.{i}.attn_{norm}.weight", state[f"model.layers.{i}.self_attn.{norm}.weight"], "F32")
        if experts and arch != "gpt-oss":  # (the router in float32; each of gate, up and down every expert's,
            # one tensor)
            add(f"blk.{i}.ffn_gate_inp.weight", state[f"model.layers.{i}.mlp.gate.weight"], "F32")
            both = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
            parts = {"ffn_gate_exps": both[:, : both.shape[1] // 2], "ffn_up_exps": both[:, both.shape[1] // 2:],
                     "ffn_down_exps": state[f"model.layers.{i}.mlp.experts.down_proj"]}
            for short, w in parts.items():
                add(f"blk.{i}.{short}.weight", w, (kinds or {}).get(short.removesuffix("_exps"), kind))
        for short, long in names.items():
            if f"model.layers.{i}.{long}.weight" not in state:
                continue
            w = state[f"model.layers.{i}.{long}.weight"]
            if short == "attn_q" and arch == "llama":
                w = permute(w, config.num_attention_heads)
            elif short == "attn_k" and arch == "llama":
                w = permute(w, config.num_key_value_heads)
            add(f"blk.{i}.{short}.weight", w, (kinds or {}).get(short, kind))
            if f"model.layers.{i}.{long}.bias" in state:
                add(f"blk.{i}.{short}.bias", state[f"model.layers.{i}.{long}.bias"], "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# a tiny Gemma 3: six layers (the sixth global, the rest sliding over 8 tokens), head_dim 256 (transformers scales
# attention by query_pre_attn_scalar's default 256, llama.cpp by head_dim: a file cannot say otherwise), and an
# untied head (with a tied one a tiny random Gemma only repeats its last token)
TINY_GEMMA3 = dict(hidden=64, layers=6, ffn=128, heads=2, kv_heads=1, head_dim=256, vocab=512, window=8, context=512,
                   std=0.3, tied=False)


def make_gemma3_gguf(path: Path, kind: str = "Q4_0", **shape) -> Path:
    """A tiny random Gemma 3 GGUF file, written as benchmarks/scripts/random_gguf.py writes Gemma 3 270M's."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "random_gguf.py"
    found = importlib.util.spec_from_file_location("random_gguf", script)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module.gemma3(path, kind=kind, **{**TINY_GEMMA3, **shape})


def make_served_pair(root: Path, name: str, context: int, max_new_tokens: int, tokenizer=None) -> Path:
    """A tiny GPT-2 pair (a noisy copy for the draft) and its profile, staged in float32, as the server tests
    serve it; `tokenizer`: one made already (with special tokens of its own), else a fresh one."""
    if tokenizer is None:
        tokenizer = make_tokenizer(root / "tokenizer")
    make_model(root / "oracle", "gpt2", len(tokenizer), layers=2, width=64, seed=1, context=context,
               tokenizer=tokenizer)
    make_noisy_copy(root / "oracle", root / "draft", noise=0.1, seed=2)
    path = root / f"{name}.toml"
    path.write_text(f'oracle = "{root / "oracle"}"\ndraft = "{root / "draft"}"\ndtype = "float32"\n'
                    f'[decoding]\nmethod = "staged"\nmax_new_tokens = {max_new_tokens}\ntree_budget = 8\n')
    return path


def make_permuted_copy(source: Path, folder: Path, seed: int) -> list[int]:
    """The model at `source` with its vocabulary's ids shuffled: the same words under other numbers, so a draft
    of "another vocabulary" that guesses exactly what `source` does. Returns the new id of each old one."""
    import json
    import random

    from tokenizers import Tokenizer
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )

    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {a["id"] for a in spec["added_tokens"]}
    plain = sorted(i for i in vocab.values() if i not in special)
    shuffled = plain[:]
    random.Random(seed).shuffle(shuffled)
    new = dict(zip(plain, shuffled)) | {i: i for i in special}
    spec["model"]["vocab"] = {token: new[i] for token, i in vocab.items()}
    old = AutoTokenizer.from_pretrained(source)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token=old.bos_token,
                                   eos_token=old.eos_token, unk_token=old.unk_token)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    by_new = torch.tensor(sorted(new, key=new.get))  # the old id of each new one
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.copy_(embedding[by_new])
        head = model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != embedding.data_ptr():
            head.weight.copy_(head.weight[by_new])
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return [new[i] for i in range(len(new))]
