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
gpt-oss transformers claims but could not read (`_rope_scaling_unread`); its window, head width and experts' names
are taught here, its experts' blocks (MXFP4) and biases read by `gguf.build`.
"""

from __future__ import annotations

import contextlib
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
    # mixtures: their experts split by `gguf.build` (OLMoE's named as Qwen's, Granite's by `_with_experts`)
    "granitemoe": ({**LLAMA_KEYS, "attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                    "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling",
                    "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"}, "llama"),
    "olmoe": ({**LLAMA_KEYS, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}, "qwen2moe"),
    # DeepSeek-V2 (Lite, Coder-V2): latent attention (its kv_b split by llama.cpp's converter into k_b and v_b, which
    # `gguf.build` joins again), experts and shared experts; widths the file gives in its own terms (`_deepseek`)
    "deepseek2": ({**LLAMA_KEYS, "rope.dimension_count": "qk_rope_head_dim", "attention.head_count_kv": None,
                   "attention.key_length": None, "attention.value_length": None, "attention.key_length_mla": None,
                   "attention.value_length_mla": "v_head_dim", "attention.kv_lora_rank": "kv_lora_rank",
                   "attention.q_lora_rank": "q_lora_rank", "leading_dense_block_count": "first_k_dense_replace",
                   "expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
                   "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
                   "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
                   "expert_group_count": "n_group", "expert_group_used_count": "topk_group"}, None),
    # Command R and Aya (23, Expanse): layer norms without biases, attention and MLP side by side, a logit scale
    "command-r": ({**LLAMA_KEYS, "attention.layer_norm_rms_epsilon": None,
                   "attention.layer_norm_epsilon": "layer_norm_eps", "logit_scale": "logit_scale",
                   "rope.scaling.type": None}, None),
    # Phi-2: layer norms with biases, attention and MLP side by side, a partial rope (`configured`)
    "phi2": ({**LLAMA_KEYS, "attention.layer_norm_rms_epsilon": None, "attention.layer_norm_epsilon": "layer_norm_eps",
              "rope.dimension_count": None}, None),
    # Seed-OSS (36B): q, k and v with biases, heads of their own width; Arcee's AFM (a ReLU-squared MLP without a
    # gate; its q and k rows permuted as Llama's); Hunyuan's dense models (0.5B-7B: q and k heads normed; their
    # NTK alpha rope is the file's base, as llama.cpp's converter computes it)
    "seed_oss": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                  "attention.value_length": None}, None),
    "arcee": ({**LLAMA_KEYS, "attention.key_length": None, "attention.value_length": None}, "llama"),
    "hunyuan-dense": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                       "attention.value_length": None}, None),
    # GLM-4-0414 and GLM-Z1 (9B, 32B): heads of their own width, a partial rope (`configured`), gate and up one
    # tensor, sandwich norms
    "glm4": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
              "attention.value_length": None}, None),
    # GLM-4.5(-Air), GLM-4.6: GLM-4's partial rope, q, k and v biases (Qwen3-style q and k norms where the file has
    # them), experts chosen by a sigmoid with a bias (as DeepSeek-V3's), a shared expert, dense first layers
    "glm4moe": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                 "attention.value_length": None, "expert_count": "n_routed_experts",
                 "expert_used_count": "num_experts_per_tok", "expert_group_count": "n_group",
                 "expert_group_used_count": "topk_group", "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_count": "n_shared_experts", "leading_dense_block_count": "first_k_dense_replace",
                 "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
                 "expert_gating_func": None, "nextn_predict_layers": None}, "deepseek2"),
    # Mistral Small 3.x, Ministral 3 and Devstral (llama.cpp's mistral3): Llama's shape and permuted rows, heads of
    # their own width; Ministral 3's YaRN and attention temperature by position (`configured`)
    "mistral3": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                  "attention.value_length": None}, "llama"),
    # Apertus (8B, 70B): Llama 3's rope (its rope_freqs), q and k norms, rows as they are, a gateless MLP whose
    # xIELU's parameters the file holds as settings (`metadata_tensors`)
    "apertus": ({**LLAMA_KEYS, "attention.key_length": None, "attention.value_length": None}, None),
    # ERNIE 4.5 (0.3B): Llama's shape, heads of their own width, its rows as they are
    "ernie4_5": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                  "attention.value_length": None}, None),
    # ERNIE 4.5's mixture (21B-A3B): a dense first layer, then experts and shared ones; the experts' choice biased
    # by a correction (exp_probs_b), their weights not
    "ernie4_5-moe": ({**LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                      "attention.value_length": None, "expert_count": "moe_num_experts", "expert_used_count": "moe_k",
                      "interleave_moe_layer_step": "moe_layer_interval",
                      "leading_dense_block_count": "moe_layer_start_index",
                      "expert_feed_forward_length": "moe_intermediate_size",
                      "expert_shared_count": "moe_num_shared_experts",
                      "expert_shared_feed_forward_length": None}, "deepseek2"),
}
# architectures whose files name them otherwise than transformers' model types
RENAMED = {"deepseek2": "deepseek_v2", "command-r": "cohere", "phi2": "phi", "hunyuan-dense": "hunyuan_v1_dense",
           "ernie4_5-moe": "ernie4_5_moe", "glm4moe": "glm4_moe", "mistral3": "mistral"}

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
    # gpt-oss: its window (128 in its releases, the default) and its head width (64, not width / heads)
    "gpt_oss": {"attention.sliding_window": "sliding_window", "attention.key_length": "head_dim",
                "expert_feed_forward_length": "intermediate_size"},
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
        hf_gguf.TENSOR_PROCESSORS["llama"] = _with_experts(hf_gguf.TENSOR_PROCESSORS["llama"], "LlamaExperts")
    hf_gguf.TENSOR_PROCESSORS.setdefault("deepseek2", _with_experts(hf_gguf.TensorProcessor, "Experts"))
    hf_gguf.TENSOR_PROCESSORS.setdefault("gpt-oss", _with_experts(hf_gguf.TensorProcessor, "GptOssExperts"))
    if not hasattr(hf_gguf.load_gguf_checkpoint, "renamed"):
        hf_gguf.load_gguf_checkpoint = _renamed(hf_gguf.load_gguf_checkpoint)
    for architecture, (keys, processor) in TAUGHT.items():
        if architecture in hf_gguf.GGUF_SUPPORTED_ARCHITECTURES:
            continue
        hf_gguf.GGUF_TO_TRANSFORMERS_MAPPING["config"][architecture] = keys
        hf_gguf.GGUF_SUPPORTED_ARCHITECTURES.append(architecture)
        if processor is not None:
            hf_gguf.TENSOR_PROCESSORS[architecture] = hf_gguf.TENSOR_PROCESSORS[processor]


def _renamed(load):
    """transformers' `load_gguf_checkpoint` (which takes a file's architecture for its model type), the model types
    of `RENAMED` architectures as transformers names them."""

    def load_gguf_checkpoint(*args, **kwargs):
        with _rope_scaling_unread():
            parsed = load(*args, **kwargs)
        config = parsed.get("config", {})
        if config.get("model_type") in RENAMED:
            config["model_type"] = RENAMED[config["model_type"]]
        return parsed

    load_gguf_checkpoint.renamed = True
    return load_gguf_checkpoint


@contextlib.contextmanager
def _rope_scaling_unread():
    """Within it, gpt-oss files' rope scaling settings are hidden from transformers' reader: it reads them for
    gpt-oss alone, as each setting's first part (an array, not the value: every gpt-oss file failed to load);
    `configured` reads them."""
    import gguf

    reader = gguf.GGUFReader

    class Reader(reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith("gpt-oss.rope.scaling.")]:
                del self.fields[key]

    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = reader


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
# names), for `_with_experts`; Granite-MoE's router and experts are named otherwise there (`router.layer`,
# `experts.down`)
EXPERTS_NAMES = re.compile(r"model\.layers\.(?P<bid>\d+)\.(?:mlp|block_sparse_moe)\."
                           r"(?P<part>experts\.gate_up_proj|experts\.down_proj|router\.weight"
                           r"|gate\.(?:moe_statics\.)?e_score_correction_bias)")
FILE_NAMES = {"experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "experts.down_proj": ("ffn_down_exps",),
              "router.weight": ("ffn_gate_inp.weight",),
              "gate.moe_statics.e_score_correction_bias": ("exp_probs_b.bias",),  # (ERNIE's; DeepSeek-V3's below)
              "gate.e_score_correction_bias": ("exp_probs_b.bias",)}


def _with_experts(base, name: str):
    """A tensor processor `base` that also finds where a mixture's router and experts go: Mixtral's (llama.cpp
    writes Mixtral as llama with experts: each of their gate, up and down one tensor, as Qwen's mixtures'; spec's
    `gguf.build` splits them), Granite-MoE's (read with Llama's processor, as Granite's) and DeepSeek's."""

    class WithExperts(base):
        experts = True

        def perform_fallback_tensor_mapping(self, gguf_to_hf_name_map, suffix, qual_name, hf_name):
            if found := EXPERTS_NAMES.fullmatch(hf_name):
                for file_name in FILE_NAMES[found["part"]]:
                    gguf_to_hf_name_map[f"blk.{found['bid']}.{file_name}"] = qual_name + hf_name

    WithExperts.__name__ = WithExperts.__qualname__ = name
    return WithExperts


def configured(config, reader, architecture: str):
    """The configuration a file describes where its metadata says more than transformers reads from it: an olmo2
    file with a sliding window is OLMo 3's (llama.cpp's converter writes both as olmo2), its window and which
    layers slide in the file; a file with a `rope_freqs` tensor has Llama 3's rope (llama.cpp's converter stores
    it as each frequency's divisor, no setting: read without it, Llama 3.1-3.3's files rotated otherwise); a
    scaled rope (linear: Gemma 3's global layers; YaRN: long-context Qwen files; Phi-3's long rope, its factors
    as tensors) is read from the file's `rope.scaling` settings (transformers reads them for gpt-oss alone);
    Gemma 2's and 3's attention scale is llama.cpp's (`GEMMA_27B`)."""
    # multi-token prediction layers (GLM-4.5's, GLM-4.7-Flash's) counted in the file's layers, after the decoder's:
    # left out (`gguf.build`)
    config.num_hidden_layers -= int(_field(reader, f"{architecture}.nextn_predict_layers") or 0)
    if config.model_type == "olmo2" and "olmo2.attention.sliding_window" in reader.fields:
        config = _olmo3(config, reader)
    if config.model_type == "llama" and (_field(reader, "llama.expert_count") or 0) > 0:
        config = _mixtral(config, reader)
    if config.model_type == "deepseek_v2":
        config = _deepseek(config, reader)
    if config.model_type == "ernie4_5_moe":  # (llama.cpp takes every layer past the dense ones)
        config.moe_layer_end_index = config.num_hidden_layers - 1
    if config.model_type == "cohere":
        config.use_qk_norm = _holds(reader, "attn_q_norm.weight")  # (Command R+)
    if config.model_type in ("phi", "phi3") and f"{architecture}.rope.dimension_count" in reader.fields:
        rotated = int(_field(reader, f"{architecture}.rope.dimension_count"))  # (Phi-4-mini's: 96 of 128)
        config.rope_parameters = {**config.rope_parameters,
                                  "partial_rotary_factor": rotated / (config.hidden_size // config.num_attention_heads)}
    if config.model_type == "mistral" and "mistral3.attention.temperature_scale" in reader.fields:
        config = _ministral3(config, reader)
    if config.model_type in ("glm4", "glm4_moe") and f"{architecture}.rope.dimension_count" in reader.fields:
        rotated = int(_field(reader, f"{architecture}.rope.dimension_count"))
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotated / config.head_dim}
    if config.model_type == "glm4_moe":
        if (_field(reader, "glm4moe.expert_gating_func") or 2) != 2:
            raise SpecError("a GLM-4.5-style file whose experts are chosen otherwise than by a sigmoid, which spec "
                            "does not read")
        config.use_qk_norm = _holds(reader, "attn_q_norm.weight")
        config.attention_bias = _holds(reader, "attn_q.bias")
        config.norm_topk_prob = bool(_field(reader, "glm4moe.expert_weights_norm"))
    if config.model_type == "exaone4" and "exaone4.attention.sliding_window_pattern" in reader.fields:
        config.layer_types = _sliding(reader, "exaone4")
    if config.model_type == "gemma2":  # (transformers keeps its defaults, 50 and 30: Gemma 2's own, not every file's)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"gemma2.{key}" in reader.fields:
                setattr(config, key, float(_field(reader, f"gemma2.{key}")))
    if config.model_type in GEMMA_27B:
        config = _gemma_scale(config)
    factors = _tensor(reader, "rope_freqs.weight")
    if factors is not None:
        return _llama3_rope(config, factors)
    config = _rope_scaling(config, reader, architecture)
    return _yarn_scale(config, reader, architecture) if config.model_type.startswith("deepseek_v") else config


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


def _holds(reader, suffix: str) -> bool:
    """Whether a tensor of the file (any layer's) has a name ending in `suffix`."""
    return any(t.name.endswith(suffix) for t in reader.tensors)


def _recast(config, cls, drop: tuple = (), **settings):
    """`config`'s settings, less `drop`, as the configuration class `cls` (its own model type), with `settings`:
    a file whose architecture is another model's (OLMo 3 written as olmo2, Mixtral as llama, ...)."""
    kept = {k: v for k, v in config.to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version", *drop, *settings)}
    return cls(**kept, **settings)


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


def _ministral3(config, reader):
    """A mistral3 file with an attention temperature is Ministral 3's (Devstral 2's): its YaRN (read by
    `_rope_scaling`) with the mscale llama.cpp's converter wrote as its log multiplier, and Llama 4's scaling of
    each query by its position (its beta the file's temperature scale)."""
    from transformers import Ministral3Config

    scale = float(_field(reader, "mistral3.rope.scaling.yarn_log_multiplier") or 1.0)
    rope = dict(rope_type="default", rope_theta=config.rope_parameters["rope_theta"], mscale=scale,
                mscale_all_dim=scale, llama_4_scaling_beta=float(_field(reader, "mistral3.attention.temperature_scale")))
    return _recast(config, Ministral3Config, rope_parameters=rope)


# Apertus's xIELU: each layer's parameters and buffers, which llama.cpp's converter writes as settings (a value a
# layer): the model's name for each, and its shape ([1] parameters, scalar buffers)
XIELU = {"alpha_n": (1,), "alpha_p": (1,), "beta": (), "eps": ()}


def metadata_tensors(reader, config) -> dict[str, torch.Tensor]:
    """Tensors a file holds as settings rather than tensors (Apertus's xIELU parameters), by the model's names."""
    found = {}
    if all(f"xielu.{name}" in reader.fields for name in XIELU):
        for name, shape in XIELU.items():
            values = reader.fields[f"xielu.{name}"].contents()
            if len(values) != config.num_hidden_layers:
                raise SpecError(f"the file's xielu.{name} has {len(values)} values for {config.num_hidden_layers} "
                                "layers")
            for i, value in enumerate(values):
                found[f"model.layers.{i}.mlp.act_fn.{name}"] = torch.tensor(float(value)).reshape(shape)
    return found


def _olmo3(config, reader):
    from transformers import Olmo3Config

    return _recast(config, Olmo3Config, sliding_window=int(_field(reader, "olmo2.attention.sliding_window")),
                   layer_types=_sliding(reader, "olmo2"))


def _deepseek(config, reader):
    """DeepSeek-V2's widths from its file: the file's key and value widths are its latent attention's as llama.cpp
    computes it (the latent and the rope's part); the heads' own are `_mla` (older files: the plain ones). Every head
    its own keys (no grouping), no low-rank queries where the file has no rank for them (Lite), routing limited to
    groups where the file has groups. A file whose experts are chosen by a sigmoid with a bias (DeepSeek-V3, R1,
    Moonlight, GLM-4.7-Flash, which llama.cpp writes as deepseek2 too) is DeepSeek-V3's model; its multi-token
    prediction layers (past the file's decoder layers, where it holds them) are left out."""
    gating = _field(reader, "deepseek2.expert_gating_func")
    biased = _holds(reader, "exp_probs_b.bias")
    if gating is None:  # (GLM-4.7-Flash's files say none: llama.cpp knows them by their shape, spec by the bias)
        gating = 2 if biased else 1
    if gating not in (1, 2) or (gating == 2) != biased:
        raise SpecError("a DeepSeek-style file whose experts are chosen otherwise than by a softmax (V2) or a sigmoid "
                        "with a bias (V3), which spec does not read")
    key = _field(reader, "deepseek2.attention.key_length_mla") or _field(reader, "deepseek2.attention.key_length")
    value = _field(reader, "deepseek2.attention.value_length_mla") or _field(reader, "deepseek2.attention.value_length")
    config.qk_nope_head_dim = int(key) - config.qk_rope_head_dim
    config.v_head_dim = int(value)
    config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    config.head_dim = config.qk_rope_head_dim
    config.num_key_value_heads = config.num_attention_heads
    if "deepseek2.attention.q_lora_rank" not in reader.fields:
        config.q_lora_rank = None
    if "deepseek2.expert_shared_count" not in reader.fields:
        config.n_shared_experts = None
    routed = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}
    if routed:  # (the dense layers before the first with experts, as the file holds them: GLM-4.7-Flash's say 0)
        config.first_k_dense_replace = min(routed)
    if gating == 2:
        from transformers import DeepseekV3Config

        return _recast(config, DeepseekV3Config, drop=("mlp_bias", "topk_method"), n_group=config.n_group or 1,
                       topk_group=config.topk_group or 1, norm_topk_prob=bool(config.norm_topk_prob),
                       num_nextn_predict_layers=0, routed_scaling_factor=config.routed_scaling_factor or 1.0)
    if config.n_group:
        config.topk_method = "group_limited_greedy"
    return config


def _yarn_scale(config, reader, architecture: str):
    """`config` with YaRN's attention scale as the file holds it (llama.cpp's log multiplier, 0.1 x
    mscale_all_dim, which DeepSeek's attention scales by as its configurations' mscale and mscale_all_dim do)."""
    multiplier = _field(reader, f"{architecture}.rope.scaling.yarn_log_multiplier")
    if multiplier is not None and config.rope_parameters.get("rope_type") == "yarn":
        scale = float(multiplier) / 0.1
        config.rope_parameters = {**config.rope_parameters, "mscale": scale, "mscale_all_dim": scale}
    return config


def _mixtral(config, reader):
    """A llama file with experts is Mixtral's (llama.cpp writes it so): its experts' count and how many a token
    takes from the file."""
    from transformers import MixtralConfig

    return _recast(config, MixtralConfig, drop=("mlp_bias", "head_dim", "pretraining_tp"),
                   num_local_experts=int(_field(reader, "llama.expert_count")),
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
