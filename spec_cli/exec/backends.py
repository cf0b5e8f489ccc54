"""How a model's layers are run over spec's cache.

- Lean: GPT-2, the Llama family, Gemma 3 and gpt-oss (the models most people run), a loop over the model's own modules
  that skips Hugging Face's per-layer plumbing (a tenth of a small model's forward on a CPU).
- Hugging Face: any other supported family, through the model's own forward, handed per-token positions,
  one mask per attention window and a cache object that writes where spec says; wrappers on each attention
  and MLP sublayer skip it (zeros: the identity on the residual) or hand it its window's mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from spec_cli.core.errors import SpecError
from spec_cli.core.families import (
    ATTENTION_NAMES,
    MLP_NAMES,
    NO_SKIP,
    Skip,
    num_layers,
    sliding_windows,
)
from spec_cli.exec import packing, quant


def hooked(module: torch.nn.Module) -> bool:
    """Whether something hooks into `module`'s forward (then it must run as the module itself)."""
    from torch.nn.modules import module as modules

    return bool(module._forward_hooks or module._forward_pre_hooks or modules._global_forward_hooks
                or modules._global_forward_pre_hooks or hasattr(module, "_hf_hook"))  # (accelerate's: offloaded)


def direct(module: torch.nn.Module):
    """`module`'s own forward, called without `Module.__call__`'s dispatch (on a small model on a CPU, a
    sizable share of a step), unless something hooks into it when the runner is built (then the module itself)."""
    return module if hooked(module) else module.forward


def never(modules) -> bool:
    return False


def projection(*modules: torch.nn.Module, pack: Callable = never) -> Callable:
    """The projections `modules` of one input as one callable: packed and fused where `pack` says so (one
    output, side by side), else each module's own forward (a tuple of outputs when there are several). Quantized
    ones are always fused."""
    if not any(map(hooked, modules)) and quant.fusable(modules):
        return quant.product(*modules)
    if not any(map(hooked, modules)) and quant.runs(modules) is not None:  # (quantized, in several formats)
        return quant.side_by_side(*modules)
    if not any(map(hooked, modules)) and pack(modules):
        return packing.linear(modules)
    calls = [direct(m) for m in modules]
    if len(calls) == 1:
        return calls[0]
    return lambda x: tuple(call(x) for call in calls)


class GPT2Block(NamedTuple):
    ln_1: Callable
    qkv: Callable
    out: Callable
    ln_2: Callable
    up: Callable
    act: Callable
    down: Callable


class GPT2:
    """Learned positions, fused QKV (Conv1D), pre-norm blocks."""

    def __init__(self, model, pack: Callable = never, glue=None, blocks=None):
        """`glue`: `native_glue(...)` where eager steps should run its attention (its norm and activation are
        torch's); `blocks`: `native_blocks(...)` where each block should be one call."""
        config, t = model.config, model.transformer
        self.glue = self.attention = glue  # (`attention`: spec's own, where it runs: `own_attention`)
        self.layers = [GPT2Block(direct(b.ln_1), projection(b.attn.c_attn, pack=pack),
                                 projection(b.attn.c_proj, pack=pack), direct(b.ln_2),
                                 projection(b.mlp.c_fc, pack=pack), direct(b.mlp.act),
                                 projection(b.mlp.c_proj, pack=pack)) for b in t.h]
        self.wte, self.wpe, self.ln_f = (direct(m) for m in (t.wte, t.wpe, t.ln_f))
        self.head = projection(model.lm_head, pack=pack)
        self.heads = self.kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        self.scales = [scale / (i + 1) if config.scale_attn_by_inverse_layer_idx else scale
                       for i in range(len(self.layers))]
        self.blocks = blocks  # (a bfloat16 block attends as glue does: one call only where glue runs the loop)
        if blocks is not None and (glue is not None or t.wte.weight.dtype == torch.float32):
            self.fused = [self.fuse(block, layer) for block, layer in zip(t.h, self.layers)]
        else:
            self.fused = None
        self.stack = None

    @staticmethod
    def fuse(block, layer: GPT2Block):
        """A block's weights as `native/layer.cpp`'s gpt2_layer takes them (one call a block), where its products
        are packed, its own Conv1Ds or spec's quantized ones (in bfloat16) and its norms and activation are
        GPT-2's own; else None (part by part)."""
        products = [GPT2.product(p) for p in (layer.qkv, layer.out, layer.up, layer.down)]
        norms = (block.ln_1, block.ln_2)
        if (None in products or hooked(block.mlp.act) or type(block.mlp.act).__name__ != "NewGELUActivation"
                or any(map(hooked, norms)) or not all(type(n).__name__ == "LayerNorm" and n.weight is not None
                                                      and n.bias is not None for n in norms)
                or any(p[2] >= 2 for p in products) and block.ln_1.weight.dtype != torch.bfloat16):
            return None
        (qkv, out, up, down) = (p[:2] for p in products)
        weights = [block.ln_1.weight, block.ln_1.bias, *qkv, *out, block.ln_2.weight, block.ln_2.bias, *up, *down,
                   *(p[3] for p in products)]
        return weights, [p[2] for p in products], block.ln_1.eps, block.ln_2.eps

    @staticmethod
    def product(call):
        """(weight, bias, kind, scales) of a product as gpt2_layer takes it: kind 0 packed, 1 the model's own
        Conv1D, 2, 3 and 4 spec's int4, 8-bit and 6-bit products (`quant.product`'s `native`; scales empty but
        for them), 5 bfloat16 on spec's kernel (`packing.own_product`)."""
        quantized = getattr(call, "native", None)
        if quantized is not None:
            values, scales, bias, bits = quantized
            return values, bias, {4: 2, 8: 3, 6: 4, 16: 5}[bits], scales
        packed, bias = getattr(call, "onednn", (None, None))
        if bias is not None:
            return packed, bias, 0, bias.new_empty(0)
        conv = getattr(call, "__self__", None)  # (`direct`: the module's own forward)
        if type(conv).__name__ == "Conv1D" and conv.bias is not None and call == conv.forward:
            return conv.weight, conv.bias, 1, conv.bias.new_empty(0)
        return None

    def run_fused(self, i, x, rope, keys, values, first, slots, span, mask, attention, mlp):
        weights, kinds, eps_1, eps_2 = self.fused[i]
        return self.blocks.gpt2_layer(x, weights, kinds, eps_1, eps_2, self.heads, keys, values, first, slots, span,
                                      mask, self.scales[i], attention, mlp)

    def run_fused_parts(self, i, x, rope, attended, attention, mlp):
        weights, kinds, eps_1, eps_2 = self.fused[i]
        return self.blocks.gpt2_layer_parts(x, weights, kinds, eps_1, eps_2, self.heads, *attended, self.scales[i],
                                            attention, mlp)

    def embed(self, ids, positions):
        return self.wte(ids) + self.wpe(positions), None

    def qkv(self, layer, x, rope):
        n = x.shape[1]
        q, k, v = layer.qkv(layer.ln_1(x)).split(self.heads * self.head_dim, dim=2)
        return (t.view(1, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))

    def out(self, layer, a):
        return layer.out(a)

    def mlp(self, layer, x):  # (the model's dropouts are left out: inference)
        return layer.down(layer.act(layer.up(layer.ln_2(x))))

    def normed(self, x):
        """What the head reads: the last layer's output, normed."""
        return self.ln_f(x)

    def logits(self, x):
        return self.head(self.normed(x))


class LlamaBlock(NamedTuple):
    norm_1: Callable
    qkv: Callable  # one tensor (packed, fused) or a tuple of q, k and v
    q_norm: Callable | None
    k_norm: Callable | None
    out: Callable
    norm_2: Callable
    mlp: Callable


# down(act(gate(x)) * up(x)), read in their source
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP", "GraniteMLP",
              "SmolLM3MLP", "Gemma2MLP", "MinistralMLP", "SeedOssMLP")  # (Seed-OSS's: a dropout, none in eval)
# mixtures whose forward is a router's choice of experts (and Qwen2-MoE's gated shared expert), read in source
SPARSE_MLPS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "GraniteMoeMoE",
               "GptOssMLP")


def mlp_of(layer, pack: Callable, glue=None) -> Callable:
    """A layer's MLP (Granite-MoE's `block_sparse_moe`) as `sparse_mlp` or `gated_mlp` runs it."""
    mlp = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
    return (sparse_mlp if hasattr(mlp, "experts") else gated_mlp)(mlp, pack, glue)


def sparse_mlp(mlp, pack: Callable, glue=None) -> Callable:
    """A mixture's MLP as one callable: its router and a shared expert's gate (`quant.Routed`), its experts
    (`quant.Experts`: a GGUF file's) and a shared expert as `gated_mlp` runs it; else (transformers' own experts)
    the module's own forward."""
    if type(mlp).__name__ not in SPARSE_MLPS or not isinstance(mlp.experts, quant.Experts) or hooked(mlp):
        own = direct(mlp)
        if type(mlp).__name__ == "GptOssMLP":  # (its forward returns its routing weights beside its output)
            return lambda x: own(x)[0]
        return own
    route, experts = direct(getattr(mlp, "gate", None) or mlp.router), mlp.experts
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        shared, shared_gate = gated_mlp(shared, pack, glue), direct(mlp.shared_expert_gate)  # (`quant.Routed`)

    def forward(x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = route(flat)
        y = experts(flat, index, weights)
        if shared is not None:
            y = y + F.sigmoid(shared_gate(flat)) * shared(flat)
        return y.reshape(x.shape)

    return forward


def gated_mlp(mlp, pack: Callable, glue=None) -> Callable:
    """The MLP as one callable: where `pack` says so, its gate and up projections fused into one packed product;
    with `glue` (`native_glue`), SiLU times up in one call."""
    parts = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not (type(mlp).__name__ in GATED_MLPS and not any(map(hooked, (mlp, *parts)))):
        return direct(mlp)
    if quant.fusable(parts[:2]):
        gate_up, down = quant.product(*parts[:2]), projection(parts[2], pack=pack)
    elif pack(parts):
        gate_up = packing.linear(parts[:2])
        down = direct(parts[2]) if packing.on_gpu(parts) else packing.linear(parts[2:])
    else:
        return direct(mlp)
    return _gated(gate_up, down, mlp.act_fn, mlp.gate_proj.out_features, glue)


def _gated(gate_up: Callable, down: Callable, act: Callable, width: int, glue=None) -> Callable:
    """down(act(gate) * up) where gate_up's output is the gate's `width` columns, then the up's."""
    silu_mul = glue.silu_mul if glue is not None and type(act).__name__ in SILUS else None
    act = direct(act)

    def forward(x):
        both = gate_up(x)
        if silu_mul is not None:
            return down(silu_mul(both))
        gate, up = both.split(width, dim=-1)
        return down(act(gate) * up)

    if hasattr(gate_up, "packed"):
        forward.packed = gate_up.packed
    if silu_mul is not None and hasattr(gate_up, "native") and hasattr(down, "native"):
        forward.native = (gate_up.native, down.native)
    return forward


def fused_mlp(mlp, pack: Callable, glue=None) -> Callable:
    """Phi-3's MLP (gate and up one projection, `gate_up_proj`: up x act(gate), the same product either way) as
    `gated_mlp` runs one."""
    parts = (mlp.gate_up_proj, mlp.down_proj)
    if type(mlp).__name__ != "Phi3MLP" or any(map(hooked, (mlp, *parts))):
        return direct(mlp)
    gate_up, down = projection(parts[0], pack=pack), projection(parts[1], pack=pack)
    return _gated(gate_up, down, mlp.activation_fn, parts[0].out_features // 2, glue)


def rows_of_head(head: torch.nn.Module, words: torch.Tensor, pack: Callable = never) -> Callable | None:
    """The head's product for `words` only (their logits side by side, at the head's own values); None where
    the head cannot be cut (a head hooked, or of another kind)."""
    if hooked(head):
        return None
    words = words.to(torch.long)
    if isinstance(head, quant.Quantized):
        part = head.rows(words)
        return None if part is None else quant.product(part)
    if type(head).__name__ != "Linear":
        return None
    part = torch.nn.Linear(head.in_features, len(words), bias=head.bias is not None, dtype=head.weight.dtype,
                           device=head.weight.device)
    with torch.no_grad():
        part.weight.copy_(head.weight[words.to(head.weight.device)])
        if head.bias is not None:
            part.bias.copy_(head.bias[words.to(head.weight.device)])
    return projection(part, pack=pack)


def part_of_head(head: torch.nn.Module, words: torch.Tensor, vocab_size: int, pack: Callable = never):
    """A head computing the logits of `words` only (the rest -inf): a draft drafting from part of the
    vocabulary (FR-Spec), whose head is a large share of its forward. The oracle verifies over every word and
    a draft's q is the distribution it drafted from, so every method stays exact. None where the head cannot
    be cut (`rows_of_head`)."""
    product = rows_of_head(head, words, pack)
    if product is None:
        return None
    where = words.to(torch.long).to(head.values.device if isinstance(head, quant.Quantized) else head.weight.device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        some = product(x)
        full = some.new_full((*some.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, where, some)

    forward.words = where
    return forward


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm", "Qwen2MoeRMSNorm",
             "Qwen3MoeRMSNorm", "GraniteRMSNorm", "GraniteMoeRMSNorm", "Phi3RMSNorm", "SmolLM3RMSNorm", "MinistralRMSNorm",
             "SeedOssRMSNorm")  # their forward,
# read in source: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), which torch.rms_norm computes in one call,
# bit for bit


SILUS = ("SiLU", "SiLUActivation")


def native_glue(device: torch.device, dtype: torch.dtype):
    """spec's own small operations (`native/glue.cpp`) for a bfloat16 model on a CPU with AVX-512: each saves
    the dispatch of torch's several operations, and its attention sums a row's attended keys alone, in slot
    order, so a row's bits are its own whatever shares the forward (trees exact, no attended length or row
    count to pad for). For eager steps: a compiled step traces torch's operations (the runner builds its lean
    loop without them)."""
    from spec_cli.exec import native

    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    return native.int4()


def own_attention(device: torch.device, dtype: torch.dtype, quantized: bool):
    """spec's own attention (`native/glue.cpp`'s attend) for a lean loop whose other operations are torch's: a
    quantized model in float32 on a CPU. Its products compute in bfloat16 whatever the dtype, so where torch's
    float32 attention groups a row's sums by how many rows and slots the forward has, a flipped bfloat16
    rounding grows through the layers into another token; spec's sums a row's attended keys alone, in slot
    order (a Qwen2.5 GGUF's verified chain was 0.19 of a logit off its one-row forward)."""
    from spec_cli.exec import native

    if not quantized or device.type != "cpu" or dtype != torch.float32:
        return None
    return native.int4()


ATTENDS_ALONE = "spec"  # the attention a model's own forward runs while spec drives it (`model_attention`)


def model_attention(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, quantized: bool):
    """spec's own attention for a model that runs its own forward (registered with transformers as
    `ATTENDS_ALONE`, `attend_alone`), where the lean loop would attend with it (`native_glue`,
    `own_attention`) and the model's attention is one it computes: keys as wide as the queries, softcapped or
    not (Gemma 2's), no sinks; else None. A row's bits are then its own, as in the lean loop: a verified
    chain's rows have the bits of one-token steps (torch's CPU kernel rounds one row otherwise than several in
    bfloat16: a tiny OPT's chains differed from its steps there), and trees are exact."""
    config = model.config
    own = native_glue(device, dtype) or own_attention(device, dtype, quantized)
    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if own is None or any(getattr(m, "config", config) is not config for m in attentions):  # (its own settings)
        return None
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENDS_ALONE, attend_alone)
    return own


def attend_alone(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers' attention function for `model_attention`: queries [1, heads, rows, d] over the keys and
    values the cache view gave [1, kv heads, span, d] (values may be narrower), under the runner's additive mask
    (0 and -inf)."""
    from spec_cli.exec import native

    if dropout or query.shape[0] != 1 or value.shape[-1] > query.shape[-1]:
        raise SpecError(f"spec's attention does not compute this {type(module).__name__}'s")
    width = value.shape[-1]
    if width < query.shape[-1]:  # (DeepSeek's narrower values, padded with zeros: each output's sum its own)
        value = F.pad(value, (0, query.shape[-1] - width))
    mask = None if attention_mask is None else attention_mask[0, 0]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = native.int4().attend(query, key, value, mask, scale, None, softcap or 0.0)
    return out.view(1, query.shape[2], query.shape[1], query.shape[3])[..., :width], None


def native_blocks(device: torch.device, dtype: torch.dtype):
    """spec's native module where a GPT-2 block can run as one call (`native/layer.cpp`'s gpt2_layer): eager
    steps on a CPU, in float32 or bfloat16."""
    from spec_cli.exec import native

    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return native.int4()


def rms_norm(module, glue=None) -> Callable:
    if type(module).__name__ not in RMS_NORMS or hooked(module):
        return direct(module)
    weight, eps, width = module.weight, module.variance_epsilon, (module.weight.shape[-1],)
    if glue is not None and weight.dtype == torch.bfloat16:
        def native(x):
            return glue.rms_norm(x, weight, eps)

        native.native = (weight, eps)
        return native

    def forward(x):
        return weight * torch.rms_norm(x.float(), width, None, eps).to(x.dtype)

    return forward


class Llama:
    """Llama, Mistral (and Ministral), Qwen2, Qwen3, Seed-OSS and the mixtures (Mixtral, Qwen2-MoE, Qwen3-MoE): rotary
    positions, separate projections, RMSNorm, grouped-query attention."""

    def __init__(self, model, pack: Callable = never, glue=None):
        """`glue`: `native_glue(...)` where eager steps should run it."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        config, m = model.config, model.model
        self.glue = self.attention = glue  # (`attention`: spec's own, where it runs: `own_attention`)
        self.layers = [self.block(layer, pack, glue) for layer in m.layers]
        self.embed_tokens, self.rotary, self.norm = direct(m.embed_tokens), direct(m.rotary_emb), rms_norm(m.norm, glue)
        self.head, self.rope = projection(model.lm_head, pack=pack), apply_rotary_pos_emb
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.widths = [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2
        self.scales = [getattr(layer.self_attn, "scaling", self.head_dim**-0.5) for layer in m.layers]
        fuses = type(self) is Llama or getattr(self, "fuses", False)
        self.fused = [self.fuse(layer) for layer in self.layers] if glue is not None and fuses else None
        self.stack = None  # every layer fused: all of them one call a forward
        if self.fused is not None and all(f is not None for f in self.fused):
            self.stack = glue.Layers([f[0] for f in self.fused], [f[1] for f in self.fused],
                                     [f[2] for f in self.fused], self.scales, self.heads, self.kv_heads)

    @staticmethod
    def fuse(layer: LlamaBlock):
        """A layer's weights as `native/layer.cpp` takes them (one call a layer), where every part of it runs on
        spec's kernels; else None (the layer runs part by part)."""
        parts = (layer.norm_1, layer.out, layer.norm_2, layer.mlp)
        qkv_parts = [layer.qkv.native] if hasattr(layer.qkv, "native") else getattr(layer.qkv, "parts", [])
        if not all(hasattr(part, "native") for part in parts) or len(qkv_parts) not in (1, 2):
            return None
        (w1, eps), (w2, eps2) = layer.norm_1.native, layer.norm_2.native
        norms = Llama.head_norms(layer)
        if eps != eps2 or norms is False or (norms is not None and norms[2] != eps):
            return None
        qkv, out, (gate_up, down) = qkv_parts[0], layer.out.native, layer.mlp.native
        empty = w1.new_empty(0)
        weights = [w1, *qkv[:3], *out[:3], w2, *gate_up[:3], *down[:3], *(norms[:2] if norms else (empty, empty))]
        bits = [qkv[3], out[3], gate_up[3], down[3]]
        for extra in qkv_parts[1:]:  # (q and k in one format, v in another: two products side by side)
            weights, bits = weights + list(extra[:3]), bits + [extra[3]]
        return weights, bits, eps

    def run_fused(self, i, x, rope, keys, values, first, slots, span, mask, attention, mlp):
        weights, bits, eps = self.fused[i]
        return self.glue.layer(x, weights, bits, rope[0][0], rope[1][0], self.heads, self.kv_heads, keys, values,
                               first, slots, span, mask, self.scales[i], eps, attention, mlp)

    def run_fused_parts(self, i, x, rope, attended, attention, mlp):
        weights, bits, eps = self.fused[i]
        return self.glue.layer_parts(x, weights, bits, rope[0][0], rope[1][0], self.heads, self.kv_heads, *attended,
                                     self.scales[i], eps, attention, mlp)

    @staticmethod
    def head_norms(layer: LlamaBlock):
        """(q's weight, k's weight, eps) where a layer's q and k heads are normed natively (Qwen3), None where
        they are not normed, False where they are normed otherwise."""
        if layer.q_norm is None:
            return None
        q, k = (getattr(norm, "native", None) for norm in (layer.q_norm, layer.k_norm))
        if q is None or k is None or q[1] != k[1]:
            return False
        return q[0], k[0], q[1]

    @staticmethod
    def block(layer, pack: Callable, glue=None) -> LlamaBlock:
        attn = layer.self_attn
        norms = (None, None)
        if hasattr(attn, "q_norm"):  # Qwen3's q and k head norms
            norms = (rms_norm(attn.q_norm, glue), rms_norm(attn.k_norm, glue))
        return LlamaBlock(rms_norm(layer.input_layernorm, glue),
                          projection(attn.q_proj, attn.k_proj, attn.v_proj, pack=pack), *norms,
                          projection(attn.o_proj, pack=pack), rms_norm(layer.post_attention_layernorm, glue),
                          mlp_of(layer, pack, glue))

    def embed(self, ids, positions):
        x = self.embed_tokens(ids)
        cos, sin = self.rotary(x, positions)
        return x, (cos, sin, cos[:, None], sin[:, None])  # (the last two as every head takes them)

    def qkv(self, layer, x, rope):
        n = x.shape[1]
        qkv = layer.qkv(layer.norm_1(x))
        norms = self.head_norms(layer)
        if isinstance(qkv, torch.Tensor) and self.glue is not None and norms is not False:  # one product, one call
            if norms is not None:
                qkv = self.glue.head_norms(qkv, norms[0], norms[1], self.heads, self.kv_heads, norms[2])
            return self.glue.rope(qkv, rope[0][0], rope[1][0], self.heads, self.kv_heads)
        if isinstance(qkv, torch.Tensor) and layer.q_norm is None:  # one product: q and k rotated together
            heads = self.heads + self.kv_heads
            qk = qkv[..., : heads * self.head_dim].view(1, n, heads, self.head_dim).transpose(1, 2)
            qk = qk * rope[2] + rotate_half(qk) * rope[3]  # apply_rotary_pos_emb's arithmetic, element for element
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            v = qkv[..., heads * self.head_dim:].view(1, n, -1, self.head_dim).transpose(1, 2)
            return q, k, v
        q, k, v = qkv.split(self.widths, dim=2) if isinstance(qkv, torch.Tensor) else qkv
        q, k = q.view(1, n, -1, self.head_dim), k.view(1, n, -1, self.head_dim)
        v = v.view(1, n, -1, self.head_dim).transpose(1, 2)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), *rope[:2])
        return q, k, v

    def unrotated(self, layer, x):
        """A layer's q, k and v [1, heads, rows, head_dim] as its projection gives them: no norm, no rope."""
        n, qkv = x.shape[1], layer.qkv(layer.norm_1(x))
        parts = qkv.split(self.widths, dim=2) if isinstance(qkv, torch.Tensor) else qkv
        return tuple(t.view(1, n, -1, self.head_dim).transpose(1, 2) for t in parts)

    def out(self, layer, a):
        return layer.out(a)

    def mlp(self, layer, x):
        return layer.mlp(layer.norm_2(x))

    def normed(self, x):
        """What the head reads: the last layer's output, normed."""
        return self.norm(x)

    def logits(self, x):
        return self.head(self.normed(x))


class Phi3(Llama):
    """Phi-3, Phi-3.5 and Phi-4-mini: Llama's layers with q, k and v one projection and gate and up one, and (Phi-4-mini)
    a rope over part of each head (the rest passed through), its model's own arithmetic for it."""

    def __init__(self, model, pack: Callable = never, glue=None):
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

        config = model.config
        width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.partial = model.model.rotary_emb.inv_freq.numel() * 2 != width  # (its tables' width: the rotated part)
        self.fuses = not self.partial  # (its layers as Llama's: one native call each)
        super().__init__(model, pack, glue)
        self.rope = apply_rotary_pos_emb

    @staticmethod
    def block(layer, pack: Callable, glue=None) -> LlamaBlock:
        attn = layer.self_attn
        return LlamaBlock(rms_norm(layer.input_layernorm, glue), projection(attn.qkv_proj, pack=pack), None, None,
                          projection(attn.o_proj, pack=pack), rms_norm(layer.post_attention_layernorm, glue),
                          fused_mlp(layer.mlp, pack, glue))

    def qkv(self, layer, x, rope):
        if not self.partial:
            return super().qkv(layer, x, rope)
        q, k, v = self.unrotated(layer, x)
        return *self.rope(q, k, *rope[:2]), v


class SmolLM3(Llama):
    """SmolLM3: Llama's layers, every fourth without rope (its `no_rope_layers`)."""

    def __init__(self, model, pack: Callable = never, glue=None):
        super().__init__(model, pack, glue)
        self.without_rope = {id(block) for block, rotated in zip(self.layers, model.config.no_rope_layers)
                             if not rotated}

    def qkv(self, layer, x, rope):
        return self.unrotated(layer, x) if id(layer) in self.without_rope else super().qkv(layer, x, rope)


def head_then(product: Callable, after: Callable) -> Callable:
    """A head's product, then `after` on its logits, keeping what the runner asks of a head's product."""
    def head(x):
        return after(product(x))

    for kept in ("packed", "onednn"):
        if hasattr(product, kept):
            setattr(head, kept, getattr(product, kept))
    return head


def unhooked(model) -> bool:
    """Whether nothing hooks into a layer, its attention or its MLP (a lean loop would run past the hook)."""
    return not any(hooked(m) for layer in model.model.layers for m in (layer, layer.self_attn, layer.mlp))


class Granite(Llama):
    """Granite and Granite-MoE: Llama's layers with IBM's multipliers: the embedding scaled, each sublayer's output
    scaled before the residual, the logits divided (in the head itself, so that a head cut to part of the
    vocabulary divides too). Its layers run part by part (layer.cpp's fused layer has no multipliers)."""

    def __init__(self, model, pack: Callable = never, glue=None):
        config = model.config
        self.embedding_multiplier, self.residual_multiplier = config.embedding_multiplier, config.residual_multiplier
        self.logits_scaling = config.logits_scaling
        super().__init__(model, pack, glue)

    @property
    def head(self):
        return self._scaled

    @head.setter
    def head(self, product):
        self._scaled = head_then(product, lambda logits: logits / self.logits_scaling)

    def embed(self, ids, positions):
        x, rope = super().embed(ids, positions)
        return x * self.embedding_multiplier, rope

    def out(self, layer, a):
        return layer.out(a) * self.residual_multiplier

    def mlp(self, layer, x):
        return layer.mlp(layer.norm_2(x)) * self.residual_multiplier


GEMMA_NORMS = ("Gemma3RMSNorm", "Gemma2RMSNorm")  # its forward, read in source: (x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)).to(dtype)


def gemma_norm(module) -> Callable:
    if type(module).__name__ not in GEMMA_NORMS or hooked(module):
        return direct(module)
    scale, eps, width = 1.0 + module.weight.detach().float(), module.eps, (module.weight.shape[-1],)

    def forward(x):
        return (torch.rms_norm(x.float(), width, None, eps) * scale).to(x.dtype)

    return forward


class Gemma3Block(NamedTuple):
    norm_1: Callable
    qkv: Callable
    q_norm: Callable
    k_norm: Callable
    out: Callable
    post_attention: Callable  # (Gemma's sandwich: the sublayers' outputs normed before the residual)
    norm_2: Callable
    mlp: Callable
    post_mlp: Callable
    kind: str  # the layer's type: sliding or full attention, each with its own rope


class Gemma3(Llama):
    """Gemma 3 (text): a scaled embedding, RMSNorms of (1 + weight), QK norms, sandwich norms, a rope per layer
    type (local for sliding layers, global for full ones)."""

    ROPES = ("default", "linear")  # tables fixed per position

    @classmethod
    def fits(cls, model) -> bool:
        """Whether the lean loop computes what this model's own forward does (else it runs that)."""
        config = model.config
        if config.attn_logit_softcapping or config.final_logit_softcapping or config.use_bidirectional_attention:
            return False
        if any((config.rope_parameters.get(kind) or {}).get("rope_type") not in cls.ROPES
               for kind in set(config.layer_types)):
            return False
        return unhooked(model)

    def __init__(self, model, pack: Callable = never, glue=None):
        super().__init__(model, pack, glue)
        self.norm, self.kinds = gemma_norm(model.model.norm), sorted(set(model.config.layer_types))

    @staticmethod
    def block(layer, pack: Callable, glue=None) -> Gemma3Block:
        attn = layer.self_attn
        return Gemma3Block(gemma_norm(layer.input_layernorm),
                           projection(attn.q_proj, attn.k_proj, attn.v_proj, pack=pack), gemma_norm(attn.q_norm),
                           gemma_norm(attn.k_norm), projection(attn.o_proj, pack=pack),
                           gemma_norm(layer.post_attention_layernorm), gemma_norm(layer.pre_feedforward_layernorm),
                           gated_mlp(layer.mlp, pack, glue), gemma_norm(layer.post_feedforward_layernorm),
                           attn.layer_type)

    def embed(self, ids, positions):
        x = self.embed_tokens(ids)
        return x, {kind: self.rotary(x, positions, kind) for kind in self.kinds}

    def qkv(self, layer, x, rope):
        return super().qkv(layer, x, rope[layer.kind])

    def out(self, layer, a):
        return layer.post_attention(layer.out(a))

    def mlp(self, layer, x):
        return layer.post_mlp(layer.mlp(layer.norm_2(x)))


class Gemma2(Gemma3):
    """Gemma 2: Gemma 3's layers without q and k norms, one rope for every layer, each attention score softcapped
    (spec's attention only: `needs_own_attention`) and the logits too (in the head itself, as Granite divides
    them, a head cut to part of the vocabulary keeping its other words' -inf)."""

    needs_own_attention = True

    @classmethod
    def fits(cls, model) -> bool:
        return unhooked(model)

    def __init__(self, model, pack: Callable = never, glue=None):
        config = model.config
        self.softcap, self.logit_cap = config.attn_logit_softcapping or 0.0, config.final_logit_softcapping
        super().__init__(model, pack, glue)

    @property
    def head(self):
        return self._capped

    @head.setter
    def head(self, product):
        cap = self.logit_cap
        self._capped = product if not cap else head_then(product, lambda logits: torch.where(
            logits == float("-inf"), logits, torch.tanh(logits / cap) * cap))

    @staticmethod
    def block(layer, pack: Callable, glue=None) -> Gemma3Block:
        attn = layer.self_attn
        return Gemma3Block(gemma_norm(layer.input_layernorm),
                           projection(attn.q_proj, attn.k_proj, attn.v_proj, pack=pack), None, None,
                           projection(attn.o_proj, pack=pack), gemma_norm(layer.post_attention_layernorm),
                           gemma_norm(layer.pre_feedforward_layernorm), gated_mlp(layer.mlp, pack, glue),
                           gemma_norm(layer.post_feedforward_layernorm), "all")

    def embed(self, ids, positions):
        return Llama.embed(self, ids, positions)

    def qkv(self, layer, x, rope):
        return Llama.qkv(self, layer, x, rope)


class GptOss(Llama):
    """gpt-oss: q, k, v and o with biases, each head's attention sink (a logit of no key in its softmax, which
    spec's own attention takes: `own_attention` or the glue must run, else its model's own forward does), its rope
    on tables of half the head's width (widened here: the same arithmetic as its own), every other layer sliding,
    its mixture (`sparse_mlp`: biases and its clamped SwiGLU in `quant.Experts`)."""

    needs_own_attention = True

    @classmethod
    def fits(cls, model) -> bool:
        return unhooked(model)

    def __init__(self, model, pack: Callable = never, glue=None):
        super().__init__(model, pack, glue)
        self.sinks = [layer.self_attn.sinks.detach().float().contiguous() for layer in model.model.layers]

    def embed(self, ids, positions):
        x = self.embed_tokens(ids)
        cos, sin = self.rotary(x, positions)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # (x1 c - x2 s, x2 c + x1 s: its own)
        return x, (cos, sin, cos[:, None], sin[:, None])


LEAN = {"gpt2": GPT2, "llama": Llama, "mistral": Llama, "qwen2": Llama, "qwen3": Llama, "gemma3_text": Gemma3,
        "mixtral": Llama, "qwen2_moe": Llama, "qwen3_moe": Llama, "granite": Granite, "granitemoe": Granite,
        "gpt_oss": GptOss, "phi3": Phi3, "smollm3": SmolLM3, "gemma2": Gemma2, "ministral": Llama, "seed_oss": Llama}


def lean_kind(model):
    """The lean loop that runs `model` (None: its own forward does)."""
    kind = LEAN.get(model.config.model_type)
    return kind if kind is not None and getattr(kind, "fits", lambda model: True)(model) else None


# SDPA's own CPU kernel, called directly (SDPA's dispatch costs about the kernel's own time for one row of a
# small model); it takes an additive mask in the query's dtype (`additive`)
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FEWEST = 4  # in bfloat16 it rounds 1 query row otherwise than 2 or more on a Xeon, 1 to 3 otherwise than 4 or more on a
            # Zen 4: fewer rows run padded to this many
Q_BLOCK = 32  # ... and it takes queries in blocks of this many: a last block of fewer than FEWEST (33 queries: 32 and
              # one) rounds otherwise too (a Xeon: one last row in a hundred), so it is padded to FEWEST as well


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the kernel takes it: 0 where it allows, -inf where it does not, in `dtype`."""
    return None if mask is None else torch.where(mask, mask.new_zeros((), dtype=dtype), float("-inf"))


def folded(mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """A mask [1, 1, rows, span] for grouped queries folded into the row axis (`attend`): each query head of a
    group has the rows' mask. Made once a forward, not once a layer (each repeat costs time, layer after layer)."""
    if mask is None or group == 1:
        return mask
    return mask.expand(-1, -1, group, -1) if mask.shape[2] == 1 else mask.repeat(1, 1, group, 1)


def attend(q, keys, values, mask, scale, folded_mask: bool = False):
    """Attention of q [1, heads, rows, d] over keys/values [1, kv heads, span, d], under a mask [1, 1, rows,
    span] (None: everything; additive on a CPU or CUDA, elsewhere boolean; `folded` already where
    `folded_mask`). Grouped queries are folded into the row axis, so that every device runs its fast kernels:
    SDPA's `enable_gqa` with a mask falls back to the math kernel on CUDA."""
    heads, kv = q.shape[1], keys.shape[1]
    group, rows = heads // kv, q.shape[2]
    if q.device.type == "cpu" and CPU_FLASH is not None:
        if group > 1:  # a query head's rows beside its group's: one kv head, group x rows queries
            q = q.reshape(1, kv, group * rows, q.shape[-1])
            if not folded_mask:
                mask = folded(mask, group)
        queries = q.shape[2]
        tail = queries % Q_BLOCK if queries > Q_BLOCK else queries
        if 0 < tail < FEWEST and q.dtype != torch.float32:  # the kernel rounds fewer rows otherwise than more
            q = torch.cat([q] + [q[:, :, -1:]] * (FEWEST - tail), dim=2)  # (in float32 two rows round otherwise
            if mask is not None:  # than three, and products one row otherwise than two: not made exact)
                mask = mask.expand(-1, -1, queries, -1) if mask.shape[2] == 1 else mask
                mask = torch.cat([mask] + [mask[:, :, -1:]] * (FEWEST - tail), dim=2)
        a = CPU_FLASH(q, keys, values, 0.0, False, attn_mask=mask, scale=scale)[0][:, :, :queries]
        return a.reshape(1, heads, rows, values.shape[-1])
    if heads == kv:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    grouped = q.reshape(1, kv, group * rows, q.shape[-1])
    if mask is not None and not folded_mask:
        mask = mask.repeat(1, 1, group, 1)
    a = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return a.reshape(1, heads, rows, values.shape[-1])


def lean_forward(lean, store, ids, positions, masks, windows, skip: Skip, cache=None):
    """Hidden states after the last layer of rows `ids` [1, rows]; `store(layer, k, v)` writes the new
    entries and returns the attended keys and values. `cache`: (keys, values, where, span, stacked) as `store`
    has them (`stacked`: the caches of all layers in one tensor each, or None), for layers that run as one call
    (`Llama.fuse`)."""
    x, rope = lean.embed(ids, positions)
    fused = getattr(lean, "fused", None) if cache is not None else None
    if fused is not None:
        cached_keys, cached_values, where, span, stacked = cache  # (`keys` below: a layer's attended ones)
        first, slots = (where.start, None) if isinstance(where, slice) else (0, where)
        if lean.stack is not None and stacked is not None:
            return lean.stack.run(x, rope[0][0], rope[1][0], *stacked, first, slots, span,
                                  [masks[w] for w in windows],
                                  sorted(skip.attention), sorted(skip.mlp))
    rows = x.shape[1]
    own, sinks, cap = lean.attention, getattr(lean, "sinks", None), getattr(lean, "softcap", 0.0)
    fold = own is None and (x.device.type == "cuda" or (x.device.type == "cpu" and CPU_FLASH is not None))
    if fold:
        masks = {w: folded(m, lean.heads // lean.kv_heads) for w, m in masks.items()}
    for i, layer in enumerate(lean.layers):
        if fused is not None and fused[i] is not None and cached_keys[i] is not None:
            x = lean.run_fused(i, x, rope, cached_keys[i], cached_values[i], first, slots, span, masks[windows[i]],
                               i not in skip.attention, i not in skip.mlp)
            continue
        if i not in skip.attention:
            q, k, v = lean.qkv(layer, x, rope)
            keys, values = store(i, k, v)
            if own is not None:  # (its output as the projection takes it; a row's bits its own: trees exact)
                a = own.attend(q, keys, values, masks[windows[i]], lean.scales[i],
                               None if sinks is None else sinks[i], cap)
            else:
                a = attend(q, keys, values, masks[windows[i]], lean.scales[i], folded_mask=fold)
                a = a.transpose(1, 2).reshape(1, rows, -1)
            x = x + lean.out(layer, a)
        if i not in skip.mlp:
            x = x + lean.mlp(layer, x)
    return x


class Part(NamedTuple):
    """One sequence's rows in a grouped forward: ids and positions [1, rows], `store(layer, k, v)` (writes them to
    its cache, returns its attended keys and values), its masks by window (as `lean_forward` takes them), how
    many of its last rows the head takes (None: all) and its cache as `store` has it: (keys and values by
    layer, where the rows go: the first slot or the slots, the span attended)."""

    ids: torch.Tensor
    positions: torch.Tensor
    store: Callable
    masks: dict
    last: int | None
    cache: tuple | None = None


def grouped_forward(lean, parts: list[Part], windows, skip: Skip) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits of several sequences' rows in one forward: every product runs once over all their rows, each
    sequence's attention over its own cache under its own masks (its rows see nothing of the others'). Each
    part's logits [its `last` rows, vocab] and what the head read of them (the normed rows [`last`, width]), in
    order. The layers run part by part (a fused layer call takes one cache); in bfloat16 each row gets the bits a
    runner's own forward gives it."""
    sizes = [p.ids.shape[1] for p in parts]
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    x, rope = lean.embed(torch.cat([p.ids for p in parts], dim=1), torch.cat([p.positions for p in parts], dim=1))
    own, sinks, cap = lean.attention, getattr(lean, "sinks", None), getattr(lean, "softcap", 0.0)
    fold = own is None and (x.device.type == "cuda" or (x.device.type == "cpu" and CPU_FLASH is not None))
    group = lean.heads // lean.kv_heads
    masks = [{w: folded(m, group) for w, m in p.masks.items()} if fold else p.masks for p in parts]
    native = own is not None and all(p.cache is not None for p in parts)  # (one call a layer for every part)
    if native:
        where = [p.cache[2] for p in parts]
        firsts = [w.start if isinstance(w, slice) else 0 for w in where]
        slots = [None if isinstance(w, slice) else w for w in where]
        spans = [p.cache[3] for p in parts]
    fused = getattr(lean, "fused", None) if native else None
    for i, layer in enumerate(lean.layers):
        if fused is not None and fused[i] is not None:  # (one call a layer for every part: the same operations)
            attended = ([p.cache[0][i] for p in parts], [p.cache[1][i] for p in parts], sizes, firsts, slots, spans,
                        [m[windows[i]] for m in masks])
            x = lean.run_fused_parts(i, x, rope, attended, i not in skip.attention, i not in skip.mlp)
            continue
        if i not in skip.attention and native:
            q, k, v = lean.qkv(layer, x, rope)
            a = own.attend_parts(q, k, v, [p.cache[0][i] for p in parts], [p.cache[1][i] for p in parts], sizes,
                                  firsts, slots, spans, [m[windows[i]] for m in masks], lean.scales[i],
                                  None if sinks is None else sinks[i], cap)
            x = x + lean.out(layer, a)
        elif i not in skip.attention:
            q, k, v = lean.qkv(layer, x, rope)
            outputs = []
            for part, mask, a, b in zip(parts, masks, bounds, bounds[1:]):
                keys, values = part.store(i, k[:, :, a:b], v[:, :, a:b])
                if own is not None:
                    outputs.append(own.attend(q[:, :, a:b], keys, values, mask[windows[i]], lean.scales[i],
                                              None if sinks is None else sinks[i], cap))
                else:
                    out = attend(q[:, :, a:b], keys, values, mask[windows[i]], lean.scales[i], folded_mask=fold)
                    outputs.append(out.transpose(1, 2).reshape(1, b - a, -1))
            x = x + lean.out(layer, torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0])
        if i not in skip.mlp:
            x = x + lean.mlp(layer, x)
    rows = [x[:, b - (p.last or (b - a)):b] for p, a, b in zip(parts, bounds, bounds[1:])]
    normed = lean.normed(torch.cat(rows, dim=1) if len(rows) > 1 else rows[0])
    sizes = [r.shape[1] for r in rows]
    return list(zip(lean.head(normed)[0].split(sizes), normed[0].split(sizes)))


@dataclass
class Driver:
    """Per model, for running the model's own forward: the wrapped sublayers and what this forward hands them."""

    layers: torch.nn.ModuleList
    windows: list[int | None]
    mlp: list[torch.nn.Module | None] = field(default_factory=list)
    keeps_logits: bool = True
    active: bool = False
    skip: Skip = NO_SKIP
    masks: dict = field(default_factory=dict)  # window -> this forward's additive mask (None: attend to all)
    outputs: dict = field(default_factory=dict)  # sublayer kind -> length of its output tuple (None: a tensor)
    masked: set = field(default_factory=set)  # attention layers seen taking `attention_mask` by keyword
    packed: int | None = None  # float projections its forwards run packed (`pack_projections`; None: not asked)


def driver(model: torch.nn.Module) -> Driver:
    found = getattr(model, "_spec_driver", None)
    if found is None:
        config = model.config
        count = num_layers(config)
        layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), None)
        if layers is None:
            raise SpecError(f"cannot find the {count} decoder layers of this {config.model_type} model")
        found = Driver(layers, sliding_windows(config, count))
        for i, layer in enumerate(layers):
            attention = next((getattr(layer, n) for n in ATTENTION_NAMES if hasattr(layer, n)), None)
            if attention is None:
                raise SpecError(f"cannot find the attention of layer {i} of this {config.model_type} model")
            mlp = next((getattr(layer, n) for n in MLP_NAMES if hasattr(layer, n)), None)
            found.mlp.append(mlp)
            _wrap(attention, "attention", i, found)
            if mlp is not None:
                _wrap(mlp, "mlp", i, found)
        found.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        model._spec_driver = found
    return found


def _wrap(module: torch.nn.Module, kind: str, layer: int, driver: Driver) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        if driver.active:
            if layer in (driver.skip.attention if kind == "attention" else driver.skip.mlp):
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                width = module.out_features if isinstance(module, torch.nn.Linear) else x.shape[-1]
                zeros = x.new_zeros(*x.shape[:-1], width)
                if kind not in driver.outputs:  # (its output's form not seen yet, a first forward that skips it:
                    out = inner(*args, **kwargs)  # run once to see it; a skipped layer's cache is never read)
                    driver.outputs[kind] = len(out) if isinstance(out, tuple) else None
                length = driver.outputs.get(kind)
                return zeros if length is None else (zeros,) + (None,) * (length - 1)
            if kind == "attention" and "attention_mask" in kwargs:
                driver.masked.add(layer)
                kwargs["attention_mask"] = driver.masks[driver.windows[layer]]
        out = inner(*args, **kwargs)
        driver.outputs[kind] = len(out) if isinstance(out, tuple) else None
        return out

    module.forward = forward


def pack_projections(model: torch.nn.Module, found: Driver, pack: Callable) -> int:
    """The float projections of a model that runs its own forward, each packed where `pack` says, and run so
    while `found` drives a forward (the model called by anything else computes as before); once per model, how
    many. In bfloat16 torch's product gives a row other bits beside others than alone (MKL: a verified chain's
    rows differed from one-token steps in the heads and projections of tiny Phi, OPT, GPT-NeoX and DeepSeek
    models 512 wide), a packed one never (`packing`). A mixture's routers and experts run their own products
    (`quant.Routed`, `quant.Experts`)."""
    if found.packed is None:
        owned = {id(m) for parent in model.modules() if isinstance(parent, (quant.Routed, quant.Experts))
                 for m in parent.modules()}
        found.packed = 0
        for _, _, child in quant.linear_layers(model):
            if id(child) in owned or hooked(child) or not packing.packable(child) or not pack([child]):
                continue
            _while_driven(child, packing.linear([child]), found)
            found.packed += 1
    return found.packed


def _while_driven(module: torch.nn.Module, product: Callable, found: Driver) -> None:
    inner = module.forward

    def forward(x, *args, **kwargs):
        return product(x) if found.active and not args and not kwargs else inner(x, *args, **kwargs)

    module.forward = forward


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` from transformers 5.x (which drops
    `past_key_values` in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output) -> object:
    """The KV cache a transformers model's forward returned (`cache`, or `past_key_values` before 5.x)."""
    return output["cache"] if "cache" in output else output.past_key_values


class CacheView:
    """What the model's attention layers see as their KV cache: writes go where the runner says."""

    def __init__(self, store, length):
        self.store, self.length = store, length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.store(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length
