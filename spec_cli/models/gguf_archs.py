"""What transformers' GGUF loader does not read, taught to it: architectures it refuses (the configuration each
one's metadata holds and what llama.cpp's converter did to its tensors), settings it drops from the files of those
it reads (`ADDED_KEYS`, `configured`), Mixtral's experts in a llama file. Each tested against files that converter wrote
(tests/gguf_archs).

Granite (IBM's Granite 3 and Granite-Code 3), SmolLM3, OLMo 2, Gemma (1, CodeGemma) and EXAONE 4 are llama-shaped
(and Granite-MoE and OLMoE their mixtures): the
tensors' names are the gguf package's for their architecture (transformers maps them), Granite's and SmolLM3's
query and key rows are permuted as Llama's are (their converters are Llama's), OLMo 2's and Gemma's are not, and
Gemma's norms are stored plus one (as Gemma 2's and 3's, which transformers reads). SmolLM3's files do not say which
layers skip the rope: llama.cpp takes every fourth, as transformers' default does. Gemma's files hold no head: it
is tied to the embedding, as the model's own is. Where a file says more than its architecture's settings
(OLMo 3 written as olmo2, EXAONE 4's sliding layers, Llama 3's rope as a tensor of divisors), `configured` reads it.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import torch

from spec_cli.core.errors import SpecError

LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}

# architecture -> (its metadata's keys -> the configuration's, the architecture whose tensor processor it takes)
TAUGHT = {
    "granite": ({**LLAMA_KEYS, "attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                 "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}, "llama"),
    "smollm3": (LLAMA_KEYS, "llama"),
    "olmo2": (LLAMA_KEYS, None),
    "gemma": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
               "attention.value_length": None}, "gemma2"),
    "exaone4": ({**LLAMA_KEYS, "attention.sliding_window": "sliding_window"}, None),
    # mixtures: their experts split by `gguf.build` (OLMoE's named as Qwen's, Granite's by `_llama_experts`)
    "granitemoe": ({**LLAMA_KEYS, "attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                    "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling",
                    "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"}, "llama"),
    "olmoe": ({**LLAMA_KEYS, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}, "qwen2moe"),
}

# architectures transformers reads, and settings their files hold that it does not: StarCoder2's rope base (1e5-1e6
# in its releases: read as 10,000 without this), StableLM's, Qwen3's head width (128 in every release, its default),
# the Qwen mixtures' experts' widths (Qwen3-30B-A3B's 768 is the default; Qwen3-235B-A22B's 1,536 is not)
ADDED_KEYS = {
    "starcoder2": {"rope.freq_base": "rope_theta"},
    "stablelm": {"rope.freq_base": "rope_theta"},
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}


def teach() -> None:
    """Add TAUGHT and ADDED_KEYS to transformers' GGUF tables (idempotent; an architecture it reads itself is left
    as it reads it, but for the keys it lacks)."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    read = hf_gguf.GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for architecture, keys in ADDED_KEYS.items():
        for key, setting in keys.items():
            read.get(architecture, {}).setdefault(key, setting)
    if not hasattr(hf_gguf.TENSOR_PROCESSORS.get("qwen2moe"), "wide"):
        hf_gguf.TENSOR_PROCESSORS["qwen2moe"] = _shared_gate(hf_gguf)
    if not hasattr(hf_gguf.TENSOR_PROCESSORS["llama"], "experts"):
        hf_gguf.TENSOR_PROCESSORS["llama"] = _llama_experts(hf_gguf)
    for architecture, (keys, processor) in TAUGHT.items():
        if architecture in hf_gguf.GGUF_SUPPORTED_ARCHITECTURES:
            continue
        hf_gguf.GGUF_TO_TRANSFORMERS_MAPPING["config"][architecture] = keys
        hf_gguf.GGUF_SUPPORTED_ARCHITECTURES.append(architecture)
        if processor is not None:
            hf_gguf.TENSOR_PROCESSORS[architecture] = hf_gguf.TENSOR_PROCESSORS[processor]


def _shared_gate(hf_gguf):
    """Qwen2-MoE's tensor processor, but a shared expert's gate already [1, width] (as the converter writes it in
    float32) kept so: transformers widens every one, as it would a quantized [width], to [1, 1, width], which no
    model takes (Qwen1.5-MoE's and Qwen2-57B-A14B's files failed to load)."""

    class SharedGate(hf_gguf.TENSOR_PROCESSORS["qwen2moe"]):
        wide = True

        def process(self, weights, name, **kwargs):
            if "ffn_gate_inp_shexp" in name and weights.ndim == 2:
                return hf_gguf.GGUFTensor(weights, name, {})
            return super().process(weights, name, **kwargs)

    return SharedGate


# a mixture's tensors transformers' names do not find in the gguf package's table: (the model's name, the file's
# names); Granite-MoE's router and experts are named otherwise there (`router.layer`, `experts.down`)
EXPERTS_NAMES = re.compile(r"model\.layers\.(?P<bid>\d+)\.(?:mlp|block_sparse_moe)\."
                           r"(?P<part>experts\.gate_up_proj|experts\.down_proj|router\.weight)")
FILE_NAMES = {"experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "experts.down_proj": ("ffn_down_exps",),
              "router.weight": ("ffn_gate_inp.weight",)}


def _llama_experts(hf_gguf):
    """Llama's tensor processor, which also finds where a mixture's router and experts go: Mixtral's (llama.cpp
    writes Mixtral as llama with experts: each of their gate, up and down one tensor, as Qwen's mixtures'; spec's
    `gguf.build` splits them) and Granite-MoE's (read with Llama's processor, as Granite's)."""

    class LlamaExperts(hf_gguf.TENSOR_PROCESSORS["llama"]):
        experts = True

        def perform_fallback_tensor_mapping(self, gguf_to_hf_name_map, suffix, qual_name, hf_name):
            if found := EXPERTS_NAMES.fullmatch(hf_name):
                for name in FILE_NAMES[found["part"]]:
                    gguf_to_hf_name_map[f"blk.{found['bid']}.{name}"] = qual_name + hf_name

    return LlamaExperts


def configured(config, reader, architecture: str):
    """The configuration a file describes where its metadata says more than transformers reads from it: an olmo2
    file with a sliding window is OLMo 3's (llama.cpp's converter writes both as olmo2), its window and which
    layers slide in the file; a file with a `rope_freqs` tensor has Llama 3's rope (llama.cpp's converter stores
    it as each frequency's divisor, no setting: read without it, Llama 3.1-3.3's files rotated otherwise); a
    scaled rope (linear: Gemma 3's global layers; YaRN: long-context Qwen files; Phi-3's long rope, its factors
    as tensors) is read from the file's `rope.scaling` settings (transformers reads them for gpt-oss alone);
    Gemma 2's and 3's attention scale is llama.cpp's (`GEMMA_27B`)."""
    if config.model_type == "olmo2" and "olmo2.attention.sliding_window" in reader.fields:
        config = _olmo3(config, reader)
    if config.model_type == "llama" and (_field(reader, "llama.expert_count") or 0) > 0:
        config = _mixtral(config, reader)
    if config.model_type == "exaone4" and "exaone4.attention.sliding_window_pattern" in reader.fields:
        config.layer_types = _sliding(reader, "exaone4")
    if config.model_type in GEMMA_27B:
        config = _gemma_scale(config)
    factors = _tensor(reader, "rope_freqs.weight")
    if factors is not None:
        return _llama3_rope(config, factors)
    return _rope_scaling(config, reader, architecture)


# Gemma 2's and 3's files hold no attention scale: llama.cpp takes 1 / sqrt(head width), but for their 27B models
# (known by their layers) 1 / sqrt(width / heads), as their own configurations say (144 and 168, not 128); the
# default transformers takes, 256, fits neither 27B nor a head width other than 256
GEMMA_27B = {"gemma2": 46, "gemma3_text": 62}


def _gemma_scale(config):
    big = config.num_hidden_layers == GEMMA_27B[config.model_type]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim
    return config


def _tensor(reader, name: str) -> torch.Tensor | None:
    found = next((t for t in reader.tensors if t.name == name), None)
    return None if found is None else torch.from_numpy(np.array(found.data, dtype=np.float32)).reshape(-1)


def _field(reader, key: str):
    from transformers.modeling_gguf_pytorch_utils import read_field

    return read_field(reader, key)[0] if key in reader.fields else None


def _rope_scaling(config, reader, architecture: str):
    """`config` with the file's rope scaling, on its global layers' rope where they have their own (Gemma 3)."""
    setting = f"{architecture}.rope.scaling."
    kind, long = _field(reader, setting + "type"), _tensor(reader, "rope_factors_long.weight")
    if long is not None:
        original = int(_field(reader, setting + "original_context_length"))
        scaling = dict(rope_type="longrope", long_factor=long.tolist(), original_max_position_embeddings=original,
                       short_factor=_tensor(reader, "rope_factors_short.weight").tolist())
        if hasattr(config, "original_max_position_embeddings"):  # (Phi-3 keeps it beside its rope too)
            config.original_max_position_embeddings = original
    elif kind in ("linear", "yarn"):
        scaling = dict(rope_type=kind, factor=float(_field(reader, setting + "factor")))
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = int(_field(reader, setting + "original_context_length"))
            for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                              ("yarn_beta_slow", "beta_slow")):
                if (value := _field(reader, setting + key)) is not None:
                    scaling[name] = float(value)
    else:
        return config
    rope = copy.deepcopy(config.rope_parameters)
    (rope["full_attention"] if "full_attention" in rope else rope).update(scaling)
    config.rope_parameters = rope
    return config


def _sliding(reader, architecture: str) -> list[str]:
    """Each layer's attention from the file's sliding window pattern (a flag a layer)."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    pattern = read_field(reader, f"{architecture}.attention.sliding_window_pattern")
    return ["sliding_attention" if s else "full_attention" for s in pattern]


def _olmo3(config, reader):
    from transformers import Olmo3Config

    settings = {k: v for k, v in config.to_dict().items()
                if k not in ("model_type", "architectures", "transformers_version", "sliding_window", "layer_types")}
    return Olmo3Config(**settings, sliding_window=int(_field(reader, "olmo2.attention.sliding_window")),
                       layer_types=_sliding(reader, "olmo2"))


def _mixtral(config, reader):
    """A llama file with experts is Mixtral's (llama.cpp writes it so): its experts' count and how many a token
    takes from the file."""
    from transformers import MixtralConfig

    settings = {k: v for k, v in config.to_dict().items()
                if k not in ("model_type", "architectures", "transformers_version", "mlp_bias", "head_dim",
                             "pretraining_tp")}
    return MixtralConfig(**settings, num_local_experts=int(_field(reader, "llama.expert_count")),
                         num_experts_per_tok=int(_field(reader, "llama.expert_used_count")))


def _llama3_rope(config, factors: torch.Tensor):
    """`config` with the Llama 3 rope whose frequencies are the file's (the base ones over `factors`): its factor
    is the largest divisor, its low and high frequency factors Llama 3's (1 and 4), its original context the one
    of 2^4..2^20 that gives every frequency; none does: refused in one line (read otherwise, it would rotate
    otherwise)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    wanted = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim) / factors
    for original in (2 ** k for k in range(4, 21)):
        rope = dict(rope_type="llama3", rope_theta=theta, factor=float(factors.max()), low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=original)
        trial = copy.deepcopy(config)
        trial.rope_parameters = rope
        frequencies, _ = ROPE_INIT_FUNCTIONS["llama3"](trial, "cpu")
        if frequencies.shape == wanted.shape and torch.allclose(frequencies, wanted, rtol=1e-5, atol=0):
            return trial
    raise SpecError("the file's rope frequencies (its rope_freqs tensor) are not those of a Llama 3 rope spec can "
                    "read (factor, low and high frequency factors 1 and 4, an original context of a power of two)")
