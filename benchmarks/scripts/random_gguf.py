"""Write a GGUF file with random weights, for loading, memory and speed measurements at sizes beyond the fixtures.

    python benchmarks/scripts/random_gguf.py OUT.gguf [--family llama] [--hidden 2048 --layers 16 --ffn 8192
        --heads 32 --kv-heads 8] [--kind Q4_0]
    python benchmarks/scripts/random_gguf.py OUT.gguf --family gemma3 [--kind Q4_0|Q4_1|Q8_0]
    python benchmarks/scripts/random_gguf.py OUT.gguf --family qwen3 [--kind Q4_0]
    python benchmarks/scripts/random_gguf.py OUT.gguf --family qwen3moe [--layers 48] [--kind Q4_0]
    python benchmarks/scripts/random_gguf.py OUT.gguf --family granite [--kind Q4_0]
    python benchmarks/scripts/random_gguf.py OUT.gguf --family gpt-oss [--layers 24] [--kind Q8_0]
    python benchmarks/scripts/random_gguf.py OUT.gguf --family phi3|phi4-mini [--layers 32] [--kind Q4_0]

llama: Llama 3.2 1B's shape with SmolLM2's 49,152-word vocabulary and tokenizer (about 1.0B weights), copied from
../shared. gemma3: Gemma 3 270M's shape (hidden 640, 18 layers, 5 sliding : 1 global, head_dim 256, a tied
262,144-word embedding) with a made-up sentencepiece vocabulary, a file both transformers and llama.cpp load;
`gemma3()` writes other shapes (the tests' tiny ones). qwen3: Qwen3 0.6B's shape (hidden 1024, 28 layers, 16 heads
of 128 over 8 kv heads, q and k heads normed) with SmolLM2's vocabulary (its real one has 151,936 words).
granite: the llama shape with Granite 3's multipliers. qwen3moe: Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 32 heads of 128 over 4 kv heads, 128 experts of 768, 8 a
token), SmolLM2's vocabulary; `--layers` fewer for a file that fits (each layer ~0.3 GiB in Q4_0). gpt-oss:
gpt-oss-20b's shape (hidden 2880, 24 layers alternating 128-token windows and full attention, 64 heads of 64 over 8
kv heads, attention sinks, 32 experts of 2880, 4 a token, with biases, YaRN) with its experts in MXFP4 (random
blocks) as its releases hold them and the rest in `--kind`, SmolLM2's vocabulary (its own has 201,088 words);
each layer ~0.4 GiB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SMOL = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN3_06B = dict(hidden=1024, layers=28, ffn=3072, heads=16, kv_heads=8, head_dim=128)
QWEN3_30B_A3B = dict(hidden=2048, layers=48, ffn=768, heads=32, kv_heads=4, head_dim=128, experts=128, used=8)
GEMMA3_270M = dict(hidden=640, layers=18, ffn=2048, heads=4, kv_heads=1, head_dim=256, vocab=262144, window=512)
PHI35_MINI = dict(hidden=3072, layers=32, ffn=8192, heads=32, kv_heads=32)
PHI4_MINI = dict(hidden=3072, layers=32, ffn=8192, heads=24, kv_heads=8, rope_dims=96, tied=True)  # (a rope over 96
                                                                                               # of 128)
GPT_OSS_20B = dict(hidden=2880, layers=24, ffn=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4)
KINDS = ("Q4_0", "Q4_1", "Q8_0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--family", choices=("llama", "gemma3", "qwen3", "qwen3moe", "granite", "gpt-oss", "phi3",
                                                   "phi4-mini"),
                        default="llama")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--kind")
    args = parser.parse_args()
    shape = {k: v for k, v in vars(args).items() if k in ("hidden", "layers", "ffn", "heads", "kv_heads")
             and v is not None}
    args.kind = args.kind or ("Q8_0" if args.family == "gpt-oss" else "Q4_0")
    if args.family == "gemma3":
        gemma3(args.out, kind=args.kind, **{**GEMMA3_270M, **shape})
    elif args.family == "qwen3":
        llama(args.out, kind=args.kind, arch="qwen3", **{**QWEN3_06B, **shape})
    elif args.family == "qwen3moe":
        llama(args.out, kind=args.kind, arch="qwen3moe", **{**QWEN3_30B_A3B, **shape})
    elif args.family == "granite":
        llama(args.out, kind=args.kind, arch="granite", **shape)
    elif args.family == "gpt-oss":
        llama(args.out, kind=args.kind, arch="gpt-oss", **{**GPT_OSS_20B, **shape})
    elif args.family in ("phi3", "phi4-mini"):
        llama(args.out, kind=args.kind, arch="phi3", **{**(PHI35_MINI if args.family == "phi3" else PHI4_MINI),
                                                        **shape})
    else:
        llama(args.out, kind=args.kind, **shape)
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**20:.0f} MiB")


def llama(out, hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, kind="Q4_0", arch="llama",
          head_dim=None, experts=0, used=0, rope_dims=None, tied=False) -> None:
    """A Llama (or, with arch "qwen3", a Qwen3: q and k heads normed, `head_dim` wide; "qwen3moe": and `experts`
    of `ffn` wide, `used` a token, in place of the MLP; "phi3": q, k and v one tensor, gate and up one, an untied
    head)."""
    import gguf
    from gguf.quants import quantize

    source = gguf.GGUFReader(str(SMOL))
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            value_type = field.types[0]
            sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, value_type, sub_type=sub)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    head_dim = head_dim or hidden // heads
    writer.add_rope_dimension_count(rope_dims or head_dim)
    if arch.startswith("qwen3") or arch == "gpt-oss":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gpt-oss":  # (its releases' settings, as llama.cpp's converter writes them)
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
        writer.add_rope_scaling_yarn_beta_fast(32.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
    if arch == "granite":  # (Granite 3's multipliers, as its 2B's configuration has them)
        writer.add_float32("granite.attention.scale", 0.015625)
        writer.add_float32("granite.embedding_scale", 12.0)
        writer.add_float32("granite.residual_scale", 0.22)
        writer.add_float32("granite.logit_scale", 8.0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(ffn)
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[kind]

    def add(name, rows, columns, as_type=qtype):
        weight = (rng.standard_normal((rows, columns), dtype=np.float32) * 0.02)
        if as_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weight)
        else:
            writer.add_tensor(name, quantize(weight, as_type), raw_dtype=as_type)

    def vector(name, width, std=0.02):
        writer.add_tensor(name, rng.standard_normal(width, dtype=np.float32) * std)

    def mxfp4(rows, columns):  # (random blocks: an exponent byte near 2^-8, then 16 bytes of 4-bit indices)
        blocks = rng.integers(0, 256, (rows, columns // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(118, 122, (rows, columns // 32), dtype=np.uint8)
        return blocks.reshape(rows, -1)

    add("token_embd.weight", vocab, hidden)
    if arch == "gpt-oss" or (arch == "phi3" and not tied):
        add("output.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        norm = "post_attention_norm" if arch == "gpt-oss" else "ffn_norm"
        writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        if arch == "phi3":  # (as llama.cpp's converter writes Phi-3's: its fused projections kept whole)
            add(f"blk.{i}.attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, hidden)
            add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
            add(f"blk.{i}.ffn_up.weight", 2 * ffn, hidden)
            add(f"blk.{i}.ffn_down.weight", hidden, ffn)
            continue
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        if arch == "gpt-oss":  # (biases, sinks, the router's bias; experts in MXFP4 with biases)
            for part, width in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim),
                                ("output", hidden)):
                vector(f"blk.{i}.attn_{part}.bias", width)
            vector(f"blk.{i}.attn_sinks.weight", heads, 1.0)
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                              rng.standard_normal((experts, hidden), dtype=np.float32) * 0.02)
            vector(f"blk.{i}.ffn_gate_inp.bias", experts)
            for name, rows, columns in (("gate", ffn, hidden), ("up", ffn, hidden), ("down", hidden, ffn)):
                writer.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", np.stack([mxfp4(rows, columns)
                                                                             for _ in range(experts)]),
                                  raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                writer.add_tensor(f"blk.{i}.ffn_{name}_exps.bias",
                                  rng.standard_normal((experts, rows), dtype=np.float32) * 0.02)
            continue
        if arch.startswith("qwen3"):
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        if experts:  # (the router in float32, as llama.cpp's converter writes it; each expert a piece of one tensor)
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                              rng.standard_normal((experts, hidden), dtype=np.float32) * 0.02)
            for name, rows, columns in (("gate", ffn, hidden), ("up", ffn, hidden), ("down", hidden, ffn)):
                parts = [quantize(rng.standard_normal((rows, columns), dtype=np.float32) * 0.02, qtype)
                         for _ in range(experts)]
                writer.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", np.stack(parts), raw_dtype=qtype)
            continue
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# a made-up sentencepiece vocabulary: Gemma's special tokens, the 256 byte tokens, single characters, then pieces
# of common words (with every prefix, so that each piece can be merged from the ones before it)
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
WORDS = ("the and of to in is it that for on with as was he she you we they this an be are or not at by from "
         "his her but have had one all there were when what which their said if do will each about how up out "
         "them then many some so these would other into has more two like time could no make than first been "
         "its who now people my made over did down only way find use may long day get come call water once "
         "upon hello world def return else elif while import class self print None True False range len fib "
         "function Python string list int value name data result").split()
PIECES = ("ing", "er", "ed", "es", "re", "on", "at", "en", "or", "ion", "ly", "):", "()", "(n", "(self", "==", "+=",
          "->", "__", "\"\"\"", "▁▁", "▁▁▁▁", "▁▁▁▁▁▁▁▁", "▁=", "▁+", "▁-", "▁(", "▁#", ",▁", ".▁", ":\n")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
                 "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                 "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of `size` entries: pieces best first (scores falling with their place, which is
    how transformers' Gemma converter orders merges and what llama.cpp's sentencepiece tokenizer ranks by),
    padded with <unusedN> pieces."""
    from gguf import TokenType

    tokens = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.BYTE] * 256
    types[SPECIALS.index("<unk>")] = TokenType.UNKNOWN
    singles = ["▁", "\n", "\t"] + [chr(c) for c in range(33, 127)]
    pieces = set(PIECES)
    for word in WORDS:
        for spelled in (word, "▁" + word):
            pieces.update(spelled[:end] for end in range(2, len(spelled) + 1))
    normal = singles + sorted(pieces - set(singles), key=lambda p: (len(p), p))
    normal = normal[: max(0, size - len(tokens))]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(normal))]
    tokens += normal
    types += [TokenType.NORMAL] * len(normal)
    unused = size - len(tokens)
    tokens += [f"<unused{i}>" for i in range(unused)]
    scores += [-1e9] * unused
    types += [TokenType.UNUSED] * unused
    return tokens[:size], scores[:size], [int(t) for t in types[:size]]


def gemma3(out, hidden=640, layers=18, ffn=2048, heads=4, kv_heads=1, head_dim=256, vocab=262144, window=512,
           kind="Q4_0", std=0.02, norm_std=0.1, seed=0, context=32768, tied=True) -> Path:
    """A Gemma 3 text model as llama.cpp's converter writes one: norms F32 and stored as 1 + weight (transformers
    subtracts the 1 back), every 6th layer global (rope base 1e6) and the rest sliding (rope base 1e4: what
    transformers and llama.cpp 0.3.36 take for Gemma 3 whatever the file says, as they do the pattern), attention
    scaled by head_dim^-0.5 (llama.cpp's rule; transformers' is query_pre_attn_scalar, 256 unless a file could say
    otherwise: keep head_dim 256), projections and the embedding quantized to `kind` (Q4_0, Q4_1, Q8_0), the
    embedding's rows of unused pieces zero. `tied` False adds an output head."""
    import gguf
    from gguf.quants import quantize

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    qtype = gguf.GGMLQuantizationType[kind]
    writer = gguf.GGUFWriter(str(out), "gemma3")
    writer.add_name("random Gemma 3")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_freq_base_swa(10_000.0)
    writer.add_sliding_window(window)
    writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])
    tokens, scores, types = gemma_vocabulary(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(SPECIALS.index("<bos>"))
    writer.add_eos_token_id(SPECIALS.index("<eos>"))
    writer.add_unk_token_id(SPECIALS.index("<unk>"))
    writer.add_pad_token_id(SPECIALS.index("<pad>"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def matrix(name, rows, columns, used=None, piece=8192):
        used = rows if used is None else used
        parts = []
        for first in range(0, rows, piece):  # (a large embedding never whole in float32)
            weight = rng.standard_normal((min(piece, rows - first), columns), dtype=np.float32) * std
            weight[max(0, used - first):] = 0  # unused pieces: never predicted, as by a trained model
            parts.append(quantize(weight, qtype))
        writer.add_tensor(name, np.concatenate(parts), raw_dtype=qtype)

    def norm(name, width):
        writer.add_tensor(name, (1 + rng.standard_normal(width, dtype=np.float32) * norm_std).astype(np.float32))

    used = next((i for i, t in enumerate(types) if t == gguf.TokenType.UNUSED), vocab)
    matrix("token_embd.weight", vocab, hidden, used)
    if not tied:
        matrix("output.weight", vocab, hidden, used)
    norm("output_norm.weight", hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        norm(f"blk.{i}.attn_q_norm.weight", head_dim)
        norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        norm(f"blk.{i}.post_attention_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
        norm(f"blk.{i}.post_ffw_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


if __name__ == "__main__":
    main()
