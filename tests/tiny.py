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
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "gpt2":
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
        for p in model.parameters():
            if p.dim() == 2:
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
