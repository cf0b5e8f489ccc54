"""Write a Llama-shaped GGUF file with random weights, for loading and memory measurements at sizes beyond the
fixtures (its tokenizer and chat template are SmolLM2's, copied from ../shared).

    python benchmarks/scripts/random_gguf.py OUT.gguf [--hidden 2048 --layers 16 --ffn 8192 --heads 32
        --kv-heads 8] [--kind Q4_0]

The defaults are Llama 3.2 1B's shape with SmolLM2's 49,152-word vocabulary (about 1.0B weights).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SMOL = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    import gguf
    from gguf.quants import quantize

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--kind", default="Q4_0")
    args = parser.parse_args()
    source = gguf.GGUFReader(str(SMOL))
    writer = gguf.GGUFWriter(args.out, "llama")
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, kind, sub_type=sub)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(args.hidden // args.heads)
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[args.kind]

    def add(name, rows, columns, kind=qtype):
        weight = (rng.standard_normal((rows, columns), dtype=np.float32) * 0.02)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weight)
        else:
            writer.add_tensor(name, quantize(weight, kind), raw_dtype=kind)

    head_dim = args.hidden // args.heads
    add("token_embd.weight", vocab, args.hidden)
    writer.add_tensor("output_norm.weight", np.ones(args.hidden, dtype=np.float32))
    for i in range(args.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(args.hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(args.hidden, dtype=np.float32))
        add(f"blk.{i}.attn_q.weight", args.hidden, args.hidden)
        add(f"blk.{i}.attn_k.weight", args.kv_heads * head_dim, args.hidden)
        add(f"blk.{i}.attn_v.weight", args.kv_heads * head_dim, args.hidden)
        add(f"blk.{i}.attn_output.weight", args.hidden, args.hidden)
        add(f"blk.{i}.ffn_gate.weight", args.ffn, args.hidden)
        add(f"blk.{i}.ffn_up.weight", args.ffn, args.hidden)
        add(f"blk.{i}.ffn_down.weight", args.hidden, args.ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
