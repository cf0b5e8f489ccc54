"""Tiny random models of every architecture spec supports, each exercising what its family does differently."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 12  # shorter than the tests' contexts, so sliding windows really cut
LAYERS = 3
WIDTH = 64


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
    }


ARCHITECTURES = tuple(configs(300))


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
            if p.dim() == 2:
                p.normal_(0, init)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
