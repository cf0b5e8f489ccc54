"""How the files in this folder were made: for each architecture transformers cannot read from GGUF that spec
teaches it, and each file that says more than transformers reads (`spec_cli.models.gguf_archs`), a tiny random model saved as a Hugging Face folder (float16 weights: the
reference) and written as a GGUF file by llama.cpp's own converter (float16, its tensors as that converter names,
permutes and changes them), so that tests/test_gguf.py checks spec's reading against the files people hold.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    pip install sentencepiece      (llama.cpp's converter asks for it; Gemma's tokenizer is a sentencepiece one)
    python tests/gguf_archs/make.py llama_cpp_python-0.3.36/vendor/llama.cpp [NAME ...]   (NAMEs: those alone)

Our tiny BPE tokenizer is not one llama.cpp knows by its hash, so its pre-tokenizer is named "gpt-2" for the
converter; the tests are of the weights and the settings.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tiny import CORPUS, make_tokenizer  # noqa: E402

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, hidden_size=32, intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
MODELS = {  # name -> (config class, its settings): each what its family does differently
    "granite": ("GraniteConfig", dict(SHAPE, num_hidden_layers=2, embedding_multiplier=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.3, logits_scaling=1.5, tie_word_embeddings=False)),
    "smollm3": ("SmolLM3Config", dict(SHAPE, num_hidden_layers=4, tie_word_embeddings=False)),  # layer 3: no rope
    "olmo2": ("Olmo2Config", dict(SHAPE, num_hidden_layers=2, tie_word_embeddings=False)),
    # (llama.cpp writes it as olmo2, with a sliding window and which layers slide; windows of 6: the tests' 12 tokens)
    "olmo3": ("Olmo3Config", dict(SHAPE, num_hidden_layers=4, sliding_window=6, tie_word_embeddings=False)),
    # (its sliding window and which layers slide, read from the file as OLMo 3's are)
    "exaone4": ("Exaone4Config", dict(SHAPE, num_hidden_layers=3, sliding_window=6, tie_word_embeddings=False,
                                      layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # (llama.cpp writes Llama 3's rope as a rope_freqs tensor of each frequency's divisor, and no setting)
    "llama3": ("LlamaConfig", dict(SHAPE, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    # (settings its files hold that transformers does not read: StarCoder2's rope base, Qwen3's head width)
    "starcoder2": ("Starcoder2Config", dict(SHAPE, num_hidden_layers=2, rope_parameters=dict(rope_theta=999999.4),
                                            use_bias=True, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(SHAPE, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False)),
    # (scaled ropes, which transformers reads for gpt-oss alone: YaRN, Gemma 3's linear on its global layers (every
    # sixth), Phi-3's long rope with its factors as tensors)
    "qwen2_yarn": ("Qwen2Config", dict(SHAPE, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=64))),
    "gemma3_linear": ("Gemma3TextConfig", dict(SHAPE, num_hidden_layers=6, head_dim=16, sliding_window=8,
                                               query_pre_attn_scalar=16,  # (as llama.cpp reads a file: its head width)
                                               bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                                               rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0,
                                                                                       rope_theta=1e6),
                                                                "sliding_attention": dict(rope_type="default",
                                                                                          rope_theta=10000.0)})),
    "phi3_longrope": ("Phi3Config", dict(SHAPE, num_hidden_layers=2, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                                         original_max_position_embeddings=64, tie_word_embeddings=False,
                                         rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                              long_factor=[1.0 + 0.5 * i for i in range(4)],
                                                              short_factor=[1.0 + 0.05 * i for i in range(4)],
                                                              original_max_position_embeddings=64))),
    # Phi-4-mini's kind: a rope over three quarters of each head (the file's rope dimension count), a tied head
    "phi3_partial": ("Phi3Config", dict(SHAPE, num_hidden_layers=2, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                                        partial_rotary_factor=0.75, tie_word_embeddings=True)),
    # (a mixture transformers reads and dequantizes: its experts' width from the file, not the default 768; its
    # top-k weights normalized, as in its releases and as transformers takes its files)
    "qwen3_moe": ("Qwen3MoeConfig", dict(SHAPE, num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=True, tie_word_embeddings=False)),
    # (and Qwen2-MoE's: its shared expert's gate as the converter writes it, [1, width])
    "qwen2_moe": ("Qwen2MoeConfig", dict(SHAPE, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=48,
                                         tie_word_embeddings=False)),
    # (llama.cpp writes Mixtral as llama with experts: each of gate, up and down every expert's, one tensor)
    "mixtral": ("MixtralConfig", dict(SHAPE, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False)),
    # (Granite's mixture, its router and experts named otherwise in the gguf package's table; OLMoE's)
    "granitemoe": ("GraniteMoeConfig", dict(SHAPE, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                            embedding_multiplier=2.0, residual_multiplier=0.5,
                                            attention_multiplier=0.3, logits_scaling=1.5, tie_word_embeddings=False)),
    "olmoe": ("OlmoeConfig", dict(SHAPE, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                  tie_word_embeddings=False)),
    # (DeepSeek-V2 Lite's shape: latent attention without low-rank queries, a dense first layer, then experts and a
    # shared one; llama.cpp's converter splits kv_b into k_b and v_b; and with V2's YaRN and its attention scale)
    "deepseek_v2": ("DeepseekV2Config", dict(SHAPE, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                             n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
                                             q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4,
                                             tie_word_embeddings=False)),
    "deepseek_v2_yarn": ("DeepseekV2Config", dict(SHAPE, num_hidden_layers=2, n_routed_experts=4,
                                                  num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                                                  first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                                  num_key_value_heads=4, tie_word_embeddings=False,
                                                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                                       factor=4.0, original_max_position_embeddings=64,
                                                                       mscale=0.707, mscale_all_dim=0.707,
                                                                       beta_fast=32.0, beta_slow=1.0))),
    # (DeepSeek-V3's shape, which llama.cpp writes as deepseek2 too: its experts chosen by a sigmoid with a bias
    # (its configuration's scoring_func, as its releases say), in groups, their weights scaled; low-rank queries)
    "deepseek_v3": ("DeepseekV3Config", dict(SHAPE, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                             n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=16,
                                             first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             num_key_value_heads=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                                             tie_word_embeddings=False)),
    # (GLM-4.7-Flash's model, which llama.cpp writes as deepseek2 (DeepSeek-V3's attention, GLM-4.5's experts):
    # read as DeepSeek-V3; its files say neither how its experts are chosen nor that its first layer is dense, as
    # its converter writes them; the converter wants GLM's chat tokens)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(SHAPE, vocab_size=VOCAB + 3, num_hidden_layers=2, n_routed_experts=4,
                                                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                                                q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                                qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4,
                                                routed_scaling_factor=1.8, tie_word_embeddings=False)),
    # (GLM-4.5-Air's and GLM-4.6's mixture: a partial rope, q, k and v biases, experts chosen by a sigmoid with a
    # bias, a dense first layer, a shared expert; its multi-token prediction layer after the decoder's)
    "glm4_moe": ("Glm4MoeConfig", dict(SHAPE, vocab_size=VOCAB + 3, num_hidden_layers=2, head_dim=16,
                                       n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                       moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
                                       routed_scaling_factor=1.5, attention_bias=True, tie_word_embeddings=False,
                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            partial_rotary_factor=0.5))),
    # (Ministral 3 and Devstral 2, written as mistral3: its YaRN with llama.cpp's log multiplier and Llama 4's
    # attention temperature by position)
    "ministral3": ("Ministral3Config", dict(SHAPE, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False,
                                            rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                                                                 original_max_position_embeddings=4,
                                                                 beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0,
                                                                 mscale=1.0, llama_4_scaling_beta=0.1))),
    # (Command R and Aya, written as command-r, and Command R+ with its q and k norms; Phi-2, as phi2: its
    # converter takes 4 x width for the MLP and every head its own keys, as the real model has)
    "cohere": ("CohereConfig", dict(SHAPE, num_hidden_layers=2, logit_scale=0.5, tie_word_embeddings=True)),
    "cohere_qk": ("CohereConfig", dict(SHAPE, num_hidden_layers=2, logit_scale=0.5, use_qk_norm=True,
                                       tie_word_embeddings=True)),
    "phi2": ("PhiConfig", dict(SHAPE, num_hidden_layers=2, num_key_value_heads=4, intermediate_size=128,
                               partial_rotary_factor=0.5, tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", dict(SHAPE, num_hidden_layers=2, head_dim=16, num_key_value_heads=1, bos_token_id=2,
                                  eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)),  # (its files: tied)
    # Gemma 2: softcaps other than its defaults (the file's, not transformers' 50 and 30), a window the test's tokens pass
    "gemma2": ("Gemma2Config", dict(SHAPE, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                    attn_logit_softcapping=20.0, final_logit_softcapping=10.0, bos_token_id=2,
                                    eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)),
    # (gpt-oss, which transformers claims but could not read: its rope scaling settings, its window, its head width
    # (not width / heads), its attention sinks, its router's bias, its experts' gate and up interleaved and their
    # biases; its biases and sinks random below, not as initialized)
    # (families transformers' loader refuses, each taught its file's keys: ERNIE 4.5 (a sentencepiece tokenizer) and
    # its mixture (a dense first layer, a shared expert, the experts' choice biased), Seed-OSS (q, k and v biases),
    # Arcee's AFM (ReLU-squared, no gate; its q and k rows permuted as Llama's), Hunyuan's dense models (q and k
    # heads normed))
    "ernie4_5": ("Ernie4_5Config", dict(SHAPE, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(SHAPE, num_hidden_layers=2, head_dim=8, moe_num_experts=4, moe_k=2,
                                                moe_intermediate_size=16, moe_layer_start_index=1,
                                                moe_num_shared_experts=1, tie_word_embeddings=False)),
    # (GLM-4-0414 and GLM-Z1: a partial rope on interleaved pairs, sandwich norms, q, k and v biases; its converter
    # wants GLM's chat tokens in the tokenizer)
    "glm4": ("Glm4Config", dict(SHAPE, vocab_size=VOCAB + 1, num_hidden_layers=2, head_dim=16,
                                attention_bias=True, tie_word_embeddings=False,
                                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                     partial_rotary_factor=0.25))),
    "seed_oss": ("SeedOssConfig", dict(SHAPE, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False)),
    "arcee": ("ArceeConfig", dict(SHAPE, num_hidden_layers=2, tie_word_embeddings=False)),
    # (Apertus: its xIELU's parameters as the file's settings, a value a layer; Llama 3's rope)
    "apertus": ("ApertusConfig", dict(SHAPE, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=12000000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(SHAPE, num_hidden_layers=2, head_dim=8,
                                                      tie_word_embeddings=False)),
    "gpt_oss": ("GptOssConfig", dict(SHAPE, num_hidden_layers=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, intermediate_size=16, sliding_window=6,
                                     tie_word_embeddings=False, rope_parameters=dict(
                                         rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=16.0,
                                         beta_slow=2.0, original_max_position_embeddings=64, truncate=False))),
}

RANDOM_1D = ("gpt_oss", "seed_oss", "ernie4_5_moe", "glm4", "glm4_moe_lite", "glm4_moe", "apertus")  # (their biases and sinks random, not as initialized: a dropped one shows)

CONVERT = """import runpy, sys
from pathlib import Path
llama = Path(sys.argv.pop(1))
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = str(llama / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def sentencepiece(folder: Path) -> None:
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=VOCAB,
                                   model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False,
                                   character_coverage=1.0, minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()


def main() -> None:
    llama = Path(sys.argv[1]).resolve()
    chosen = sys.argv[2:] or list(MODELS)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        tokenizer = make_tokenizer(work / "tokenizer", VOCAB)
        (work / "convert.py").write_text(CONVERT)
        for name, (cls, settings) in MODELS.items():
            if name not in chosen:
                continue
            config = getattr(transformers, cls)(**settings)
            torch.manual_seed(7)
            model = transformers.AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                for key, p in model.named_parameters():
                    if p.dim() >= 2 or (name in RANDOM_1D and not key.endswith("norm.weight")):
                        p.normal_(0, 0.2)
                for key, b in model.named_buffers():
                    if key.endswith("e_score_correction_bias"):  # (DeepSeek-V3's: a dropped one shows)
                        b.normal_(0, 0.2)
                    if key.endswith("act_fn.beta"):  # (Apertus's xIELU: other than its default)
                        b.add_(0.25)
            source = work / name
            model.to(torch.float16).save_pretrained(source)
            if name == "deepseek_v3":  # (as its releases' configurations say: the converter reads it)
                settings = json.loads((source / "config.json").read_text())
                (source / "config.json").write_text(json.dumps({**settings, "scoring_func": "sigmoid"}))
            if name.startswith(("gemma", "phi3", "ernie")):  # (sentencepiece tokenizers)
                sentencepiece(source)
            elif name.startswith("glm4"):  # (GLM's chat words, which its converter looks up)
                glm = copy.deepcopy(tokenizer)
                words = ["<|user|>"] if name == "glm4" else ["<|user|>", "[gMASK]", "<|observation|>"]
                glm.add_special_tokens({"additional_special_tokens": words})
                glm.save_pretrained(source)
            else:
                tokenizer.save_pretrained(source)
            target = HERE / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for kept in ("config.json", "model.safetensors"):
                shutil.copy(source / kept, target / kept)
            subprocess.run([sys.executable, str(work / "convert.py"), str(llama), str(source), "--outtype", "f16",
                            "--outfile", str(HERE / f"{name}.gguf")], check=True, capture_output=True)
            print(name, (HERE / f"{name}.gguf").stat().st_size, "bytes")


if __name__ == "__main__":
    main()
