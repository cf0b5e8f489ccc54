"""A causal LM with a static KV cache that knows about trees.

The cache holds a committed prefix (slots 0..committed-1, position = slot) followed by scratch slots:
speculative tokens whose KV entries were written by a forward but not yet accepted. Each scratch slot has a
parent slot; a new token attends to the committed prefix and to its own ancestors only, at position
parent + 1. `keep(path)` makes an accepted path of scratch slots committed (gathering its entries to the
end of the prefix) and drops every other scratch entry: rejection is just overwriting slots.

The forward reuses the Hugging Face model's own modules (weights, norms, MLPs, rotary embedding), so the
numbers are the model's; only the cache and the attention mask are ours. Supported: GPT-2 and the Llama
family (Llama, Mistral, Qwen2, Qwen3).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from spec_cli.errors import SpecError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = ("gpt2",) + LLAMA_LIKE


def num_layers(config) -> int:
    return getattr(config, "n_layer", None) or config.num_hidden_layers


def context_length(config) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


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


class Runner:
    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, capacity: int | None = None,
                 skip: Skip = NO_SKIP):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise SpecError(
                f"model type '{config.model_type}' is not supported yet (supported: {', '.join(SUPPORTED)})"
            )
        self.model = model
        self.kind = "gpt2" if config.model_type == "gpt2" else "llama"
        self.context = context_length(config)
        self.capacity = min(capacity or self.context, self.context)
        self.vocab_size = vocab_size or config.vocab_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.kind == "gpt2":
            self.layers = model.transformer.h
            self.n_heads = self.n_kv_heads = config.n_head
            self.head_dim = config.n_embd // config.n_head
        else:
            self.layers = model.model.layers
            self.n_heads = config.num_attention_heads
            self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
            self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
            self.apply_rope = sys.modules[type(model.model).__module__].apply_rotary_pos_emb
        self.scales = [self._scale(i) for i in range(len(self.layers))]
        self.skip = skip.check(len(self.layers))  # a self-draft: the oracle's own modules with these sublayers left out
        shape = (len(self.layers), 1, self.n_kv_heads, self.capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.reset()

    def _scale(self, layer: int) -> float:
        config = self.model.config
        if self.kind == "gpt2":
            scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
            return scale / (layer + 1) if config.scale_attn_by_inverse_layer_idx else scale
        return getattr(self.layers[layer].self_attn, "scaling", self.head_dim**-0.5)

    def reset(self) -> None:
        self.committed = 0
        self.tokens: list[int] = []  # the committed tokens, slot by slot
        self.scratch: list[int] = []  # the token in each scratch slot
        self.parents: list[int] = []  # parent slot of each scratch slot (-1: the last committed token)
        self.depths: list[int] = []  # depth below the committed prefix of each scratch slot (1 = child of it)

    def reuse(self, sequence: list[int]) -> int:
        """Keep the committed prefix `sequence` starts with (all but its last token at most); drop the rest.

        The prefix cache of a conversation: a new turn only runs the tokens the cache does not hold.
        Returns how many slots were kept.
        """
        n = 0
        limit = min(len(self.tokens), len(sequence) - 1)
        while n < limit and self.tokens[n] == sequence[n]:
            n += 1
        self.committed = n
        del self.tokens[n:]
        self.scratch, self.parents, self.depths = [], [], []
        return n

    @property
    def length(self) -> int:
        return self.committed + len(self.parents)

    def room(self) -> int:
        """How many more slots the cache (and the model's positions) can take."""
        return self.capacity - self.length

    def position(self, slot: int) -> int:
        if slot < self.committed:
            return slot
        return self.committed - 1 + self.depths[slot - self.committed]

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], commit: int = 0, parents: list[int] | None = None, last: int | None = None,
        skip: Skip | None = None,
    ) -> torch.Tensor:
        """Run `tokens` through the model, returning float32 logits for each token (or the `last` few).

        The first `commit` tokens extend the committed prefix (the cache must hold no scratch then); the
        rest become scratch slots. `parents[i]` is the slot that scratch token i follows (-1 for the last
        committed token); by default each follows the slot before it. `skip` overrides the runner's own
        skipped sublayers for this forward (a self-draft sharing the oracle's cache; a skipped attention
        sublayer writes no cache entry, so such tokens must stay scratch and be overwritten by a full forward).
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("forward of no tokens")
        if n > self.room():
            raise SpecError("the model's context window is full")
        start = self.length
        if commit:
            assert not self.parents, "commit with scratch pending"
        self.committed += commit
        self.tokens.extend(tokens[:commit])
        self.scratch.extend(tokens[commit:])
        for i in range(commit, n):
            parent = parents[i - commit] if parents is not None else start + i - 1
            if parent < self.committed:
                assert parent in (-1, self.committed - 1), "a speculative token must follow the last committed one"
                parent = -1
            self.parents.append(parent)
            self.depths.append(1 if parent < 0 else self.depths[parent - self.committed] + 1)
        chain = all(p == (self.committed + j - 1 if j else -1) for j, p in enumerate(self.parents))
        positions = torch.tensor(
            [self.position(s) for s in range(start, start + n)], device=self.device, dtype=torch.long
        )
        mask = None if chain and n == 1 else self._mask(start, n, chain)
        try:
            return self._run(torch.tensor(tokens, device=self.device), positions, start, mask, last,
                             self.skip if skip is None else skip)
        except BaseException:  # interrupted mid-write (Ctrl-C): the cache can no longer be trusted
            self.reset()
            raise

    def _mask(self, start: int, n: int, chain: bool) -> torch.Tensor:
        """Causal for tokens being committed; committed prefix plus own ancestors for scratch tokens."""
        total = start + n
        mask = torch.ones(n, total, dtype=torch.bool).tril(start)
        if not chain:
            first_scratch = max(self.committed - start, 0)
            mask[first_scratch:, self.committed :] = False
            rows, cols = [], []
            for row in range(first_scratch, n):
                slot = start + row
                while slot >= self.committed:
                    rows.append(row)
                    cols.append(slot)
                    slot = self.parents[slot - self.committed]
            mask[rows, cols] = True
        return mask.to(self.device)

    def keep(self, path: list[int]) -> None:
        """Commit the scratch slots in `path` (a chain starting below the prefix), drop all other scratch."""
        if path:
            src = torch.tensor(path, device=self.device)
            dst = self.committed + len(path)
            if path != list(range(self.committed, dst)):
                try:
                    self.keys[:, :, :, self.committed : dst] = self.keys[:, :, :, src]
                    self.values[:, :, :, self.committed : dst] = self.values[:, :, :, src]
                except BaseException:
                    self.reset()
                    raise
        self.tokens.extend(self.scratch[s - self.committed] for s in path)
        self.committed += len(path)
        self.scratch, self.parents, self.depths = [], [], []

    def _run(self, ids, positions, start, mask, last, skip=NO_SKIP):
        n = ids.shape[0]
        end = start + n
        if self.kind == "gpt2":
            t = self.model.transformer
            x = t.wte(ids) + t.wpe(positions)
            cos_sin = None
        else:
            x = self.model.model.embed_tokens(ids)
            cos_sin = self.model.model.rotary_emb(x[None], positions[None])
        x = x[None]
        for i, layer in enumerate(self.layers):
            if i not in skip.attention:
                x = self._attention(i, layer, x, n, start, end, cos_sin, mask)
            if i not in skip.mlp:
                if self.kind == "gpt2":
                    x = x + layer.mlp(layer.ln_2(x))
                else:
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x, last)

    def _attention(self, i, layer, x, n, start, end, cos_sin, mask):
        if self.kind == "gpt2":
            h = layer.ln_1(x)
            q, k, v = layer.attn.c_attn(h).split(self.n_heads * self.head_dim, dim=2)
            q, k, v = (t.view(1, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        else:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, -1, self.head_dim)
            k = attn.k_proj(h).view(1, n, -1, self.head_dim)
            v = attn.v_proj(h).view(1, n, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), *cos_sin)
        self.keys[i, :, :, start:end] = k
        self.values[i, :, :, start:end] = v
        a = F.scaled_dot_product_attention(
            q,
            self.keys[i, :, :, :end],
            self.values[i, :, :, :end],
            attn_mask=mask,
            scale=self.scales[i],
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        a = a.transpose(1, 2).reshape(1, n, -1)
        return x + (layer.attn.c_proj(a) if self.kind == "gpt2" else attn.o_proj(a))

    def _logits(self, x, last):
        if last is not None:
            x = x[:, -last:]
        x = self.model.transformer.ln_f(x) if self.kind == "gpt2" else self.model.model.norm(x)
        logits = self.model.lm_head(x)[0].float()
        if logits.shape[-1] < self.vocab_size:
            logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        elif logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits
