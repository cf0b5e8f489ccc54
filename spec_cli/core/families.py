"""The model families spec drives exactly, how to tell them apart, and which sublayers a self-draft skips."""

from __future__ import annotations

import os
from typing import NamedTuple

from spec_cli.core.errors import SpecError

# Families whose Hugging Face implementation this runner is tested against (tests/test_architectures.py).
FAMILIES = {
    "gpt2": "GPT-2",
    "llama": "Llama, CodeLlama, DeepSeek-Coder, SmolLM, Granite-Code, TinyLlama",
    "mistral": "Mistral (sliding window)",
    "qwen2": "Qwen2, Qwen2.5, Qwen2.5-Coder",
    "qwen3": "Qwen3",
    "gemma": "Gemma, CodeGemma",
    "gemma2": "Gemma 2 (soft-capping, alternating sliding window)",
    "granite": "Granite 3",
    "gpt_neox": "GPT-NeoX, Pythia",
    "gpt_bigcode": "GPTBigCode: SantaCoder, StarCoder",
    "starcoder2": "StarCoder2 (sliding window)",
    "phi": "Phi-1, Phi-1.5, Phi-2",
    "phi3": "Phi-3, Phi-3.5, Phi-4-mini",
    "stablelm": "StableLM",
    "opt": "OPT",
    "gemma3_text": "Gemma 3 (text; alternating sliding window, local and global rope)",
    "smollm3": "SmolLM3 (no rope on every fourth layer)",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3 (alternating sliding window)",
    "mixtral": "Mixtral (mixture of experts, sliding window)",
    "qwen2_moe": "Qwen1.5-MoE, Qwen2-MoE (experts with a shared expert)",
    "qwen3_moe": "Qwen3-MoE",
    "olmoe": "OLMoE",
    "gpt_oss": "gpt-oss (attention sinks, alternating sliding window, yarn rope, experts)",
    "granitemoe": "Granite 3 MoE",
    "phimoe": "Phi-3.5-MoE",
    "cohere": "Command R (parallel blocks, QK norms, logit scale)",
    "cohere2": "Command R7B, Command A (alternating sliding window)",
    "glm": "GLM-4 (2024; partial interleaved rotary)",
    "glm4": "GLM-4-0414",
    "deepseek_v2": "DeepSeek-V2, DeepSeek-Coder-V2 (latent attention, experts)",
    "deepseek_v3": "DeepSeek-V3, R1, Kimi K2 (latent attention, grouped expert routing)",
    "ministral": "Ministral",
    "exaone4": "EXAONE 4.0 (alternating sliding window, post-norms)",
    "seed_oss": "Seed-OSS",
    "arcee": "Arcee AFM (ReLU-squared MLP)",
    "hunyuan_v1_dense": "Hunyuan dense (0.5B-7B; QK norms)",
    "ernie4_5": "ERNIE 4.5 (0.3B)",
    "ernie4_5_moe": "ERNIE 4.5 MoE (21B-A3B; biased expert choice)",
    "glm4_moe": "GLM-4.5, GLM-4.5-Air, GLM-4.6 (partial rope, sigmoid expert routing)",
    "ministral3": "Ministral 3, Devstral 2 (yarn, attention temperature by position)",
    "apertus": "Apertus (xIELU MLP, QK norms)",
}
SUPPORTED = tuple(FAMILIES)
# Not a stack of attention layers over a KV cache: nothing to verify a tree with.
RECURRENT = ("mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2", "bamba",
             "xlstm", "lfm2", "qwen3_next", "granitemoehybrid", "falcon_h1", "nemotron_h", "minimax")
ATTENTION_KINDS = ("full_attention", "sliding_attention")
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
# block_sparse_moe: Granite MoE's experts. OPT has no MLP module: zeroing fc2 leaves the residual alone
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "fc2")
FULL = None  # the window of full attention


def num_layers(config) -> int:
    return getattr(config, "n_layer", None) or config.num_hidden_layers


def context_length(config) -> int:
    """The positions spec uses. Longrope picks its rotary factors from the longest position in a forward
    (short up to the original context, long past it), so a tree would not get what one-token steps get: spec
    stays within the original context, where the factors are fixed. (Dynamic NTK rescales only past
    max_position_embeddings, which spec never reaches; llama3 and yarn factors are fixed per position.)"""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3, OLMo 3)
        ropes = list(rope.values())
    else:
        ropes = [rope]
    limits = [r["original_max_position_embeddings"] for r in ropes
              if r.get("rope_type", r.get("type")) == "longrope" and r.get("original_max_position_embeddings")]
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min([value] + limits)
    return min([2048] + limits)


def check_architecture(config, name: str = "the model", untested: bool = False) -> None:
    """One line naming what is missing when a model cannot be driven exactly. A family spec is not tested on
    is refused too, unless `untested` (or SPEC_ALLOW_UNTESTED=1, after `spec check` passed on it)."""
    kind = config.model_type
    supported = ", ".join(SUPPORTED)
    if kind in RECURRENT or getattr(config, "is_encoder_decoder", False):
        what = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "a recurrent/state-space"
        raise SpecError(f"{name} is {what} model ({kind}): speculative trees need a decoder-only transformer "
                        f"with a KV cache (supported: {supported})")
    if kind not in FAMILIES and not untested and os.environ.get("SPEC_ALLOW_UNTESTED") != "1":
        raise SpecError(f"{name} is a '{kind}' model, which spec is not tested on (supported: {supported}); "
                        f"`spec check MODEL` tells whether spec reproduces it exactly")
    odd = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_KINDS))
    if odd:
        raise SpecError(f"{name} has {', '.join(odd)} layers, which spec does not model (only full and "
                        f"sliding-window attention)")


def sliding_windows(config, layers: int) -> list[int | None]:
    """Each layer's attention window in tokens (None: full attention), as the model's own masks have it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[:layers]]
    if window and getattr(config, "use_sliding_window", True) is not False:
        return [window] * layers
    return [None] * layers


class Skip(NamedTuple):
    """Sublayers a forward leaves out (Draft & Verify): a skipped sublayer is the identity on the residual."""

    attention: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    @classmethod
    def of(cls, attention=(), mlp=()) -> "Skip":
        return cls(frozenset(attention), frozenset(mlp))

    def __bool__(self) -> bool:
        return bool(self.attention or self.mlp)

    def check(self, layers: int) -> "Skip":
        beyond = [i for i in self.attention | self.mlp if not 0 <= i < layers]
        if beyond:
            raise SpecError(f"the self-draft skips layer {max(beyond)}, but the oracle has layers 0..{layers - 1}")
        return self


NO_SKIP = Skip()
