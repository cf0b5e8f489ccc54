"""A causal LM over a static KV cache that knows about trees.

The cache holds a committed prefix (slots 0..committed-1, position = slot) followed by scratch slots:
speculative tokens whose KV entries were written by a forward but not yet accepted. Each scratch slot has a
parent slot; a new token attends to the committed prefix and to its own ancestors only, at position
parent + 1. `keep(path)` makes an accepted path of scratch slots committed (gathering its entries to the
end of the prefix) and drops every other scratch entry: rejection is just overwriting slots.

Two ways to run the model, both with the model's own weights and modules (the numbers are the model's):
- any supported family: the Hugging Face model's own forward, handed per-token position ids, an explicit
  attention mask (tree, causal and sliding-window structure in one) and a cache object whose `update`
  writes at the slots we chose and reads back the attended span;
- GPT-2 and the Llama family, the models most people run: a lean loop over the same modules that skips
  Hugging Face's per-layer plumbing, which costs a tenth of a small model's forward on a CPU.
Shapes are static where it matters: token counts are padded to a few buckets (padding rows write to
reserve slots past the capacity and attend to slot 0 only), and on a GPU the attended span is the whole
capacity, so a new prompt meets kernels that have already run.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from spec_cli.errors import SpecError

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
    "phi3": "Phi-3, Phi-3.5",
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
}
SUPPORTED = tuple(FAMILIES)
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")  # run by the lean loop, with GPT-2
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


def power_buckets(limit: int = 64) -> tuple[int, ...]:
    """1, 2, 4, ..., limit: the token counts of speculation (longer runs pad to a multiple of `limit`)."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


@dataclass(frozen=True)
class Shapes:
    """How forwards are shaped. `tokens`: the counts a forward is padded up to (empty: never padded; past the
    largest, to a multiple of it); `span`: the attended cache length is rounded up to a multiple of this
    (0: always the whole capacity, 1: exactly what is filled)."""

    tokens: tuple[int, ...] = ()
    span: int = 1

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> "Shapes":
        if device.type == "cuda":  # one kernel plan per bucket; cuDNN attention plans per sequence length
            return cls(power_buckets(), 0)
        from spec_cli.loading import cpu_has_fast_bf16

        if dtype != torch.float32 and cpu_has_fast_bf16():  # AMX: oneDNN builds its kernels per shape
            return cls(power_buckets(), 1)
        return cls((), 1)  # measured: no cold shapes in float32, and padding costs compute

    def pad(self, n: int) -> int:
        if not self.tokens:
            return n
        for size in self.tokens:
            if size >= n:
                return size
        largest = self.tokens[-1]
        return -(-n // largest) * largest

    def attended(self, end: int, capacity: int) -> int:
        if self.span == 0:
            return capacity
        return min(capacity, -(-end // self.span) * self.span)


class _GPT2:
    """GPT-2 for the lean loop: learned positions, fused QKV (Conv1D), pre-norm blocks."""

    def __init__(self, model):
        config, self.t = model.config, model.transformer
        self.layers, self.head = self.t.h, model.lm_head
        self.heads = self.kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        self.scales = [scale / (i + 1) if config.scale_attn_by_inverse_layer_idx else scale
                       for i in range(len(self.layers))]

    def embed(self, ids, positions):
        return self.t.wte(ids) + self.t.wpe(positions), None

    def qkv(self, layer, x, rope):
        n = x.shape[1]
        q, k, v = layer.attn.c_attn(layer.ln_1(x)).split(self.heads * self.head_dim, dim=2)
        return (t.view(1, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))

    def out(self, layer, a):
        return layer.attn.c_proj(a)

    def mlp(self, layer, x):
        return layer.mlp(layer.ln_2(x))

    def logits(self, x):
        return self.head(self.t.ln_f(x))


class _Llama:
    """Llama, Mistral, Qwen2, Qwen3 for the lean loop: rotary positions, separate projections, RMSNorm."""

    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        config, self.m = model.config, model.model
        self.layers, self.head, self.rope = self.m.layers, model.lm_head, apply_rotary_pos_emb
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scales = [getattr(layer.self_attn, "scaling", self.head_dim**-0.5) for layer in self.layers]

    def embed(self, ids, positions):
        x = self.m.embed_tokens(ids)
        return x, self.m.rotary_emb(x, positions)

    def qkv(self, layer, x, rope):
        n, attn = x.shape[1], layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, n, -1, self.head_dim)
        k = attn.k_proj(h).view(1, n, -1, self.head_dim)
        v = attn.v_proj(h).view(1, n, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), *rope)
        return q, k, v

    def out(self, layer, a):
        return layer.self_attn.o_proj(a)

    def mlp(self, layer, x):
        return layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x):
        return self.head(self.m.norm(x))


@dataclass
class _Driver:
    """Per model, for running the model's own forward: wrappers on each attention and MLP sublayer that skip
    it (zeros: the identity on the residual) or hand it its window's mask while a runner drives a forward."""

    layers: torch.nn.ModuleList
    windows: list[int | None]
    mlp: list[torch.nn.Module | None] = field(default_factory=list)
    keeps_logits: bool = True
    active: bool = False
    skip: Skip = NO_SKIP
    masks: dict = field(default_factory=dict)  # window -> this forward's additive mask (None: attend to all)
    outputs: dict = field(default_factory=dict)  # sublayer kind -> length of its output tuple (None: a tensor)
    masked: set = field(default_factory=set)  # attention layers seen taking `attention_mask` by keyword


def _driver(model: torch.nn.Module) -> _Driver:
    driver = getattr(model, "_spec_driver", None)
    if driver is None:
        config = model.config
        count = num_layers(config)
        layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), None)
        if layers is None:
            raise SpecError(f"cannot find the {count} decoder layers of this {config.model_type} model")
        driver = _Driver(layers, sliding_windows(config, count))
        for i, layer in enumerate(layers):
            attention = next((getattr(layer, n) for n in ATTENTION_NAMES if hasattr(layer, n)), None)
            if attention is None:
                raise SpecError(f"cannot find the attention of layer {i} of this {config.model_type} model")
            mlp = next((getattr(layer, n) for n in MLP_NAMES if hasattr(layer, n)), None)
            driver.mlp.append(mlp)
            _wrap(attention, "attention", i, driver)
            if mlp is not None:
                _wrap(mlp, "mlp", i, driver)
        driver.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        model._spec_driver = driver
    return driver


def _wrap(module: torch.nn.Module, kind: str, layer: int, driver: _Driver) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        if driver.active:
            if layer in (driver.skip.attention if kind == "attention" else driver.skip.mlp):
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                width = module.out_features if isinstance(module, torch.nn.Linear) else x.shape[-1]
                zeros = x.new_zeros(*x.shape[:-1], width)
                length = driver.outputs.get(kind)
                return zeros if length is None else (zeros,) + (None,) * (length - 1)
            if kind == "attention" and "attention_mask" in kwargs:
                driver.masked.add(layer)
                kwargs["attention_mask"] = driver.masks[driver.windows[layer]]
        out = inner(*args, **kwargs)
        driver.outputs[kind] = len(out) if isinstance(out, tuple) else None
        return out

    module.forward = forward


class _Cache:
    """What the model's attention layers see as `past_key_values`."""

    def __init__(self, runner: "Runner"):
        self.runner = runner

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.runner._store(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.runner._start


class Runner:
    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, capacity: int | None = None,
                 skip: Skip = NO_SKIP, shapes: Shapes | None = None, lean: bool = True):
        config = model.config
        check_architecture(config, f"this {config.model_type} model", untested=True)
        self.model = model
        self.context = context_length(config)
        self.capacity = min(capacity or self.context, self.context)
        self.vocab_size = vocab_size or config.vocab_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.shapes = shapes or Shapes.for_device(self.device, self.dtype)
        self.reserve = max(self.shapes.tokens, default=0)  # slots past the capacity where padding rows write
        self.layers = num_layers(config)
        self.windows = sliding_windows(config, self.layers)
        self.lean = None
        if lean and config.model_type == "gpt2":
            self.lean = _GPT2(model)
        elif lean and config.model_type in LLAMA_LIKE:
            self.lean = _Llama(model)
        self.driver = None if self.lean else _driver(model)
        self.skip = self.check_skip(skip)  # a self-draft: the model's own sublayers, some left out
        self.keys: torch.Tensor | None = None  # [layers, batch, kv heads, capacity + reserve, head dim]
        self.values: torch.Tensor | None = None
        if self.lean:
            shape = (self.layers, 1, self.lean.kv_heads, self.capacity + self.reserve, self.lean.head_dim)
            self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cache = _Cache(self)
        self._start = self._span = 0
        self._write: torch.Tensor | None = None
        self.reset()

    def warm_up(self, largest: int = 64) -> int:
        """Run each padded token count up to `largest` once, so that kernels built per shape (cuDNN plans,
        oneDNN primitives) exist before anything is timed; leaves the cache empty. Returns the forwards run."""
        sizes = [n for n in self.shapes.tokens if n <= min(largest, self.capacity)]
        for n in sizes:
            self.forward([0] * n, commit=n, last=1)
            self.reset()
        return len(sizes)

    def check_skip(self, skip: Skip) -> Skip:
        skip.check(self.layers)
        config = self.model.config
        if skip and config.model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
            raise SpecError("this OPT model normalises after each residual, so a skipped sublayer would not be "
                            "the identity: it cannot draft for itself")
        if self.driver and any(self.driver.mlp[i] is None for i in skip.mlp):
            raise SpecError(f"cannot find the MLP of every layer of this {config.model_type} model to skip")
        return skip

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
        try:
            logits = self._run(tokens, start, n if last is None else last, self.skip if skip is None else skip)
        except torch.cuda.OutOfMemoryError:
            self.reset()
            raise SpecError(f"out of {self.device} memory running the {self.model.config.model_type} model with a "
                            f"{self.capacity}-token cache: try a shorter prompt or --max-new-tokens, a smaller "
                            f"--dtype (bfloat16, float16) or a smaller model") from None
        except BaseException:  # interrupted mid-write (Ctrl-C): the cache can no longer be trusted
            self.reset()
            raise
        logits = logits.float()
        if logits.shape[-1] < self.vocab_size:
            logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        elif logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits

    def _run(self, tokens: list[int], start: int, last: int, skip: Skip) -> torch.Tensor:
        n = len(tokens)
        end = start + n
        pad = self.shapes.pad(n) - n
        self._start, self._span = start, self.shapes.attended(end, self.capacity)
        # padding rows first (so the real rows end the batch), writing to reserve slots past the capacity
        positions = [0] * pad + [self.position(s) for s in range(start, end)]
        self._write = None if not pad else torch.tensor(
            list(range(self.capacity, self.capacity + pad)) + list(range(start, end)), device=self.device)
        ids = torch.tensor([0] * pad + tokens, device=self.device)[None]
        position_ids = torch.tensor(positions, device=self.device)[None]
        masks = self._masks(start, n, pad, positions[pad:], need=self.lean is None)
        if self.lean:
            return self._run_lean(ids, position_ids, masks, last, skip)
        return self._run_model(ids, position_ids, masks, last, skip)

    def _run_lean(self, ids, positions, masks, last, skip):
        lean = self.lean
        x, rope = lean.embed(ids, positions)
        rows = x.shape[1]
        for i, layer in enumerate(lean.layers):
            if i not in skip.attention:
                q, k, v = lean.qkv(layer, x, rope)
                keys, values = self._store(i, k, v)
                a = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[self.windows[i]],
                                                   scale=lean.scales[i],
                                                   enable_gqa=lean.kv_heads != lean.heads)
                x = x + lean.out(layer, a.transpose(1, 2).reshape(1, rows, -1))
            if i not in skip.mlp:
                x = x + lean.mlp(layer, x)
        return lean.logits(x[:, -last:])[0]

    def _run_model(self, ids, positions, masks, last, skip):
        driver = self.driver
        driver.masks, driver.skip, driver.active = masks, skip, True
        try:
            kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=masks["top"],
                          past_key_values=self._cache, use_cache=True)
            if driver.keeps_logits:
                kwargs["logits_to_keep"] = last
            logits = self.model(**kwargs).logits[0, -last:]
        finally:
            driver.active = False
        unmasked = [i for i in range(self.layers) if i not in driver.masked and i not in skip.attention]
        if unmasked:
            raise SpecError(f"layer {unmasked[0]} of this {self.model.config.model_type} model takes no "
                            f"attention_mask keyword, so spec cannot give it a tree mask")
        return logits

    def _masks(self, start: int, n: int, pad: int, positions: list[int], need: bool) -> dict:
        """Masks [1, 1, pad + n, span] per attention window: causal for tokens being committed, committed
        prefix plus own ancestors for scratch tokens, slot 0 for padding rows; boolean for the lean loop,
        additive when the model's own (maybe eager) attention reads them (`need`, which also wants the "top"
        mask its forward is handed). None where one token may attend to everything (a chain, over exactly
        the filled span, no window)."""
        span = self._span
        masks: dict = {}
        if n == 1 and pad == 0 and span == start + 1 and not any(self.windows) and self._chain():
            masks[FULL] = None
            if need:
                masks["top"] = torch.zeros(1, 1, 1, span, dtype=self.dtype, device=self.device)
            return masks
        allowed = torch.zeros(pad + n, span, dtype=torch.bool)
        allowed[:pad, 0] = True
        real = allowed[pad:]
        real[:, : start + n] = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        first_scratch = max(self.committed - start, 0)
        if first_scratch < n:
            real[first_scratch:, self.committed:] = False
            rows, cols = [], []
            for row in range(first_scratch, n):
                slot = start + row
                while slot >= self.committed:
                    rows.append(row)
                    cols.append(slot)
                    slot = self.parents[slot - self.committed]
            real[rows, cols] = True
        found = {FULL: allowed}
        windows = {w for w in self.windows if w}
        if windows:
            keys = torch.tensor([self.position(s) for s in range(start + n)] + [0] * (span - start - n))
            queries = torch.tensor(positions)[:, None]
            for window in windows:
                windowed = allowed.clone()
                windowed[pad:] &= keys[None, :] > queries - window
                found[window] = windowed
        if not need:  # the lean loop hands boolean masks to SDPA itself
            return {window: m.to(self.device)[None, None] for window, m in found.items()}
        low = torch.finfo(self.dtype).min  # the model's own attention may be eager: additive masks
        for window, m in found.items():
            masks[window] = torch.zeros(m.shape, dtype=self.dtype).masked_fill_(~m, low).to(self.device)[None, None]
        masks["top"] = masks[FULL]
        return masks

    def _chain(self) -> bool:
        """Is every scratch slot the child of the one before (no side branches)?"""
        return all(p == (self.committed + j - 1 if j else -1) for j, p in enumerate(self.parents))

    def _store(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        if self.keys is None or self.keys.shape[1:3] != keys.shape[:2] or self.keys.shape[-1] != keys.shape[-1]:
            shape = (self.layers, keys.shape[0], keys.shape[1], self.capacity + self.reserve, keys.shape[-1])
            self.keys = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
            self.values = torch.zeros(shape[:-1] + (values.shape[-1],), dtype=values.dtype, device=values.device)
        if self._write is None:
            self.keys[layer][:, :, self._start : self._start + keys.shape[2]] = keys
            self.values[layer][:, :, self._start : self._start + keys.shape[2]] = values
        else:
            self.keys[layer].index_copy_(2, self._write, keys)
            self.values[layer].index_copy_(2, self._write, values)
        return self.keys[layer][:, :, : self._span], self.values[layer][:, :, : self._span]

    @torch.inference_mode()
    def keep(self, path: list[int]) -> None:
        """Commit the scratch slots in `path` (a chain starting below the prefix), drop all other scratch."""
        if path:
            dst = self.committed + len(path)
            if path != list(range(self.committed, dst)) and self.keys is not None:
                src = torch.tensor(path, device=self.device)
                try:
                    self.keys[:, :, :, self.committed : dst] = self.keys[:, :, :, src]
                    self.values[:, :, :, self.committed : dst] = self.values[:, :, :, src]
                except BaseException:
                    self.reset()
                    raise
        self.tokens.extend(self.scratch[s - self.committed] for s in path)
        self.committed += len(path)
        self.scratch, self.parents, self.depths = [], [], []
