"""Tiny random models of every architecture spec supports, each exercising what its family does differently."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 12  # shorter than the tests' contexts, so sliding windows really cut
LAYERS = 3
WIDTH = 64
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
# multi-head latent attention (DeepSeek): compressed q and kv, keys of rope + nope parts, narrower values
LATENT = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
              first_k_dense_replace=1)


def configs(vocab_size: int, context: int = 256) -> dict:
    """name -> (config class name, keyword arguments): one tiny model per family, sharing one tokenizer."""
    ids = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    llama_like = dict(ids, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context)
    return {
        "gpt2": ("GPT2Config", dict(ids, n_positions=context, n_embd=WIDTH, n_layer=LAYERS, n_head=4)),
        "llama": ("LlamaConfig", dict(llama_like, tie_word_embeddings=False)),
        "qwen2": ("Qwen2Config", dict(llama_like, use_sliding_window=True, sliding_window=WINDOW,
                                      max_window_layers=1)),  # layers 1.. slide, layer 0 attends in full
        "qwen3": ("Qwen3Config", dict(llama_like, head_dim=16)),
        "mistral": ("MistralConfig", dict(llama_like, sliding_window=WINDOW)),
        # untied heads: with tied ones a tiny random Gemma only repeats its last token
        "gemma": ("GemmaConfig", dict(llama_like, head_dim=16, num_key_value_heads=1, tie_word_embeddings=False)),
        "gemma2": ("Gemma2Config", dict(llama_like, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                        tie_word_embeddings=False,
                                        query_pre_attn_scalar=20)),
        "granite": ("GraniteConfig", dict(llama_like, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.3, logits_scaling=1.5)),
        "gpt_neox": ("GPTNeoXConfig", dict(ids, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                           num_hidden_layers=LAYERS, num_attention_heads=4,
                                           max_position_embeddings=context, rotary_pct=0.25,
                                           use_parallel_residual=True, tie_word_embeddings=False)),
        "gpt_bigcode": ("GPTBigCodeConfig", dict(ids, n_positions=context, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
                                                 multi_query=True)),
        "starcoder2": ("Starcoder2Config", dict(llama_like, sliding_window=WINDOW, use_bias=True)),
        "phi": ("PhiConfig", dict(ids, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, max_position_embeddings=context,
                                  partial_rotary_factor=0.5, qk_layernorm=True)),
        "phi3": ("Phi3Config", dict(llama_like, sliding_window=WINDOW)),
        "stablelm": ("StableLmConfig", dict(llama_like, partial_rotary_factor=0.25, use_parallel_residual=True,
                                            qk_layernorm=True, use_qkv_bias=True)),
        "opt": ("OPTConfig", dict(ids, hidden_size=WIDTH, ffn_dim=2 * WIDTH, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, max_position_embeddings=context,
                                  word_embed_proj_dim=WIDTH)),
        # rope scaling: factors fixed per position (llama3, yarn), or capped where they stay fixed (longrope)
        "llama-rope-llama3": ("LlamaConfig", dict(llama_like, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))),
        "qwen2-rope-yarn": ("Qwen2Config", dict(llama_like, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
        "llama-rope-dynamic": ("LlamaConfig", dict(llama_like, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
        "phi3-rope-longrope": ("Phi3Config", dict(llama_like, max_position_embeddings=4 * 64,
                                                  original_max_position_embeddings=64, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
            short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i for i in range(8)]))),
        "gemma3_text": ("Gemma3TextConfig", dict(llama_like, head_dim=16, num_key_value_heads=1, sliding_window=WINDOW,
                                                 layer_types=ALTERNATING, query_pre_attn_scalar=20,
                                                 tie_word_embeddings=False)),
        "smollm3": ("SmolLM3Config", dict(llama_like, no_rope_layers=[1, 0, 1], tie_word_embeddings=False)),
        "olmo2": ("Olmo2Config", dict(llama_like, tie_word_embeddings=False)),
        "olmo3": ("Olmo3Config", dict(llama_like, sliding_window=WINDOW, layer_types=ALTERNATING,
                                      tie_word_embeddings=False)),
        "mixtral": ("MixtralConfig", dict(llama_like, sliding_window=WINDOW, **EXPERTS)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(llama_like, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(llama_like, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, norm_topk_prob=True)),
        "olmoe": ("OlmoeConfig", dict(llama_like, num_experts=4, num_experts_per_tok=2)),
        "gpt_oss": ("GptOssConfig", dict(llama_like, head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING,
                                         **EXPERTS)),  # attention sinks, yarn rope
        "granitemoe": ("GraniteMoeConfig", dict(llama_like, embedding_multiplier=2.0, residual_multiplier=0.5,
                                                attention_multiplier=0.3, logits_scaling=1.5, **EXPERTS)),
        "phimoe": ("PhimoeConfig", dict(llama_like, sliding_window=WINDOW, **EXPERTS)),
        "cohere": ("CohereConfig", dict(llama_like, use_qk_norm=True, logit_scale=0.5, tie_word_embeddings=False)),
        "cohere2": ("Cohere2Config", dict(llama_like, head_dim=16, sliding_window=WINDOW, logit_scale=0.5,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                          tie_word_embeddings=False)),
        "glm": ("GlmConfig", dict(llama_like, head_dim=32)),  # partial rotary, interleaved
        "glm4": ("Glm4Config", dict(llama_like, head_dim=16)),
        "deepseek_v2": ("DeepseekV2Config", dict(llama_like, **{**LATENT, "q_lora_rank": None},  # V2-Lite: no q lora
                                                 topk_method="greedy")),
        "deepseek_v3": ("DeepseekV3Config", dict(llama_like, **{**LATENT, "kv_lora_rank": 16}, n_group=2,
                                                 topk_group=1)),
        "ministral": ("MinistralConfig", dict(llama_like, head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING)),
        "exaone4": ("Exaone4Config", dict(llama_like, sliding_window=WINDOW, layer_types=ALTERNATING)),
        # families read from GGUF files since session 43: q, k and v biases; ReLU-squared without a gate; q and k
        # heads normed; ERNIE and its mixture (a dense first layer, a shared expert, a biased choice); GLM-4.5's
        # (sigmoid with a bias, partial rope, biases); Ministral 3 (YaRN, Llama 4's temperature by position)
        "seed_oss": ("SeedOssConfig", dict(llama_like, head_dim=16)),
        "arcee": ("ArceeConfig", dict(llama_like, tie_word_embeddings=False)),
        "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(llama_like, head_dim=16, tie_word_embeddings=False)),
        "ernie4_5": ("Ernie4_5Config", dict(llama_like, head_dim=16, tie_word_embeddings=False)),
        "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(llama_like, head_dim=16, moe_num_experts=4, moe_k=2,
                                                    moe_intermediate_size=32, moe_layer_start_index=1,
                                                    moe_num_shared_experts=1, tie_word_embeddings=False)),
        "glm4_moe": ("Glm4MoeConfig", dict(llama_like, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                           n_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1,
                                           n_group=2, topk_group=1, attention_bias=True, use_qk_norm=True,
                                           tie_word_embeddings=False)),
        "apertus": ("ApertusConfig", dict(llama_like, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=12000000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))),
        "ministral3": ("Ministral3Config", dict(llama_like, head_dim=16, tie_word_embeddings=False,
                                                rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0,
                                                                     factor=16.0, original_max_position_embeddings=8,
                                                                     beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                                                     mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
        # Phi-4-mini: a rope over three quarters of each head, the rest passed through
        "phi3-partial": ("Phi3Config", dict(llama_like, head_dim=16, partial_rotary_factor=0.75,
                                            tie_word_embeddings=False)),
    }


ARCHITECTURES = tuple(configs(300))
# the families (and rope scalings) added with the first-load check: the conformance table runs on each by
# default, its costlier variants (padded shapes, a second seed of every method) with -m slow
ADDED = ARCHITECTURES[ARCHITECTURES.index("llama-rope-llama3"):]
ROPES = tuple(n for n in ADDED if "-rope-" in n)  # families tested above, with another rope: positions matter


def make(folder: Path, name: str, vocab_size: int, seed: int = 1, init: float = 0.2, tokenizer=None,
         context: int = 256) -> Path:
    """A tiny random `name` model saved in `folder` (weights large enough that its distributions are peaked)."""
    import transformers

    cls, kwargs = configs(vocab_size, context)[name]
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # experts' weights too (3-d where a family fuses them)
                p.normal_(0, init)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
