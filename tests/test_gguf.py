"""GGUF files: a real one (SmolLM2-135M-Instruct, Q4_1) read once at its own quantization and shared by the
module; spec on it equals Hugging Face's generate on the same model; a second load reads the cache; one line
for each bad file."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED
from helpers import assert_clean_error, spec

from spec_cli.core.events import Token
from spec_cli.core.settings import Decoding, ModelRef, Profile, SelfDraft
from spec_cli.draft2.fit import fit_from_corpus
from spec_cli.engine import Engine
from spec_cli.models import gguf as spec_gguf
from spec_cli.models.loading import load, load_tokenizer

ARCHS = Path(__file__).resolve().parent / "gguf_archs"  # (tests/gguf_archs/make.py)
SMOL = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None or not SMOL.is_file(),
                                reason="needs the gguf package and ../shared's SmolLM2 file")
SKIP = SelfDraft(skip_attention=tuple(range(20, 30, 2)), skip_mlp=tuple(range(21, 30, 2)))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The fixture read once, its float tensors in float32 (into a cache shared by this module's tests), timed."""
    folder = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPEC_CACHE_DIR", str(folder))
        said = []
        start = time.perf_counter()
        loaded = load(ModelRef(str(SMOL)), torch.device("cpu"), torch.float32, say=said.append)
        seconds = time.perf_counter() - start
    print(f"\nfirst load of {SMOL.name}: {seconds:.1f} s")
    return loaded, folder, seconds, said


def tokens_of(events) -> list[int]:
    return [e.token for e in events if isinstance(e, Token) and e.output]


@needs_gguf
def test_a_real_gguf_file_runs_exactly_and_loads_from_the_cache_the_second_time(smol, monkeypatch):
    loaded, folder, first_seconds, said = smol
    assert loaded.model.config.model_type == "llama" and loaded.model.config.num_hidden_layers == 30
    assert type(loaded.model.model.layers[0].mlp.down_proj).__name__ == "Quantized"  # no float copy of Q4_1
    assert "reading it at its own quantization once" in said[0] and "Q4_1" in said[0]
    converted = list((folder / "gguf").glob("*-float32-file-v*"))
    assert len(converted) == 1 and converted[0].name.startswith(spec_gguf.sha256(SMOL)[:16])
    # the second load: no conversion, no hashing, seconds; the copy marked used (what `spec cache` shows)
    os.utime(converted[0], (1e9, 1e9))
    monkeypatch.setenv("SPEC_CACHE_DIR", str(folder))
    monkeypatch.setattr(spec_gguf, "build", lambda *a: pytest.fail("read twice"))
    profile = Profile(name="smol", source="test", oracle=ModelRef(str(SMOL)), draft=ModelRef("self"),
                      self_draft=SKIP)
    engine = Engine(profile, device="cpu", dtype="float32")
    print(f"second load: {engine.load_seconds:.1f} s (first {first_seconds:.1f} s)")
    assert converted[0].stat().st_mtime > time.time() - 600
    assert engine.load_seconds < first_seconds / 2
    # the tokenizer and chat template come from the file
    template = engine.tokenizer.chat_template
    assert template and "<|im_start|>" in template
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    prompt = engine.encode(text)
    # spec's greedy baseline equals Hugging Face's generate on the same model (its int4 projections too)
    expected = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                     eos_token_id=sorted(engine.eos))[0, len(prompt):].tolist()
    plan = engine.plan(Decoding(method="baseline", max_new_tokens=24))
    baseline = tokens_of(engine.events(prompt, plan))
    assert baseline == [t for t in expected if t not in engine.eos] and len(baseline) > 10
    assert "def" in engine.tokenizer.decode(baseline)
    # self-speculative, and speculative with a self draft, are token-identical to it
    for method in ("self", "speculative"):
        events = list(engine.events(prompt, plan.replace(settings=Decoding(method=method, max_new_tokens=24))))
        assert tokens_of(events) == baseline, method


@needs_gguf
@pytest.mark.slow
def test_spec_chat_on_a_gguf_file_uses_its_template(smol, monkeypatch, tmp_path):
    _, folder, _, _ = smol
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    run = spec("chat", "--oracle", str(SMOL), "--draft", "none", "-m", "baseline", "--dtype", "float32",
               "-n", "40", stdin="Write a Python function that reverses a string.\n",
               env={"SPEC_CACHE_DIR": str(folder)})
    assert run.returncode == 0, run.stderr
    assert "template tokenizer" in run.stderr and "def " in run.stdout and "[::-1]" in run.stdout


@needs_gguf
def test_fit_draft2_on_files_for_a_gguf_oracle_tokenizes_with_the_files_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "def reverse(text):\n    return text[::-1]\n"
    (corpus / "a.py").write_text(text * 20)
    profile = Profile(name="smol", source="test", oracle=ModelRef(str(SMOL)), draft=None)
    trigram = fit_from_corpus(profile, [corpus])  # (it took the oracle for a folder: "model folder not found")
    tokenizer = load_tokenizer(ModelRef(str(SMOL)))
    ids = tokenizer(text)["input_ids"]
    assert trigram.vocab_size == len(tokenizer) == 49152 and len(ids) > 8
    assert trigram.propose(ids[:4], len(ids) - 4) == ids[4:]  # the corpus's continuation, in the file's own ids


def test_without_the_gguf_package_a_hint_in_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(spec_gguf.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else
                        real(name, *a))
    assert_clean_error(spec("generate", "--oracle", str(SMOL), "hi"),
                       "reading GGUF files needs the gguf package: pip install 'spec-cli[gguf]'")


def write_gguf(path, architecture, tensors):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@needs_gguf
def test_bad_files_are_one_line_naming_what_is_supported(tmp_path):
    assert_clean_error(spec("generate", "--oracle", str(tmp_path / "missing.gguf"), "hi"), "GGUF file not found")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(4096))
    assert_clean_error(spec("generate", "--oracle", str(garbage), "hi"), "not a readable GGUF file")
    truncated = tmp_path / "truncated.gguf"
    with SMOL.open("rb") as f:
        truncated.write_bytes(f.read(3 << 20))
    assert_clean_error(spec("generate", "--oracle", str(truncated), "hi"), "not a readable GGUF file")
    weights = {"token_embd.weight": np.ones((8, 4), dtype=np.float32)}
    rwkv = write_gguf(tmp_path / "rwkv.gguf", "rwkv6", weights)
    assert_clean_error(spec("generate", "--oracle", str(rwkv), "hi"),
                       "a GGUF 'rwkv6' model, which spec cannot read (GGUF architectures it reads: llama, "
                       "mistral, qwen2")
    ints = write_gguf(tmp_path / "ints.gguf", "llama", {"token_embd.weight": np.ones((8, 4), dtype=np.int32)})
    assert_clean_error(spec("generate", "--oracle", str(ints), "hi"),
                       "tensors quantized as I32, which the gguf package cannot dequantize (it can: BF16, F16, F32")


# file -> (the model type it is read as, its rope's type): tests/gguf_archs/make.py made each
READ_AS = {"granite": ("granite", "default"), "smollm3": ("smollm3", "default"), "olmo2": ("olmo2", "default"),
           "olmo3": ("olmo3", "default"), "gemma": ("gemma", "default"), "llama3": ("llama", "llama3"),
           "starcoder2": ("starcoder2", "default"), "qwen3": ("qwen3", "default"), "qwen2_yarn": ("qwen2", "yarn"),
           "gemma3_linear": ("gemma3_text", "linear"), "phi3_longrope": ("phi3", "longrope"),
           "phi3_partial": ("phi3", "default"), "gemma2": ("gemma2", "default"),
           "qwen3_moe": ("qwen3_moe", "default"), "qwen2_moe": ("qwen2_moe", "default"),
           "exaone4": ("exaone4", "default"), "mixtral": ("mixtral", "default"),
           "granitemoe": ("granitemoe", "default"), "olmoe": ("olmoe", "default"),
           "deepseek_v2": ("deepseek_v2", "default"), "deepseek_v2_yarn": ("deepseek_v2", "yarn"),
           "cohere": ("cohere", "default"), "cohere_qk": ("cohere", "default"), "phi2": ("phi", "default"),
           "gpt_oss": ("gpt_oss", "yarn"), "seed_oss": ("seed_oss", "default"), "arcee": ("arcee", "default"),
           "hunyuan_v1_dense": ("hunyuan_v1_dense", "default"), "ernie4_5": ("ernie4_5", "default"),
           "ernie4_5_moe": ("ernie4_5_moe", "default"), "glm4": ("glm4", "default"),
           "deepseek_v3": ("deepseek_v3", "default"), "glm4_moe_lite": ("deepseek_v3", "default"),
           "glm4_moe": ("glm4_moe", "default"), "ministral3": ("ministral3", "yarn"), "apertus": ("apertus", "llama3")}


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
@pytest.mark.parametrize("name", list(READ_AS))
def test_files_llama_cpp_wrote_are_read_as_the_models_they_were_made_from(name):
    """Files that llama.cpp's own converter wrote from tiny models (tests/gguf_archs/make.py): of Granite, SmolLM3,
    OLMo 2 and 3, Gemma, EXAONE 4, Command R (and R+'s q and k norms), Phi-2, Seed-OSS, Arcee's AFM, Hunyuan's
    dense models, Ministral 3 (its YaRN and attention temperature by position), Apertus (its xIELU's parameters
    as the file's settings), GLM-4-0414 (its partial rope
    from the file) and ERNIE 4.5 (and its mixture, its experts' choice
    biased), which transformers' GGUF loader
    refuses, and of families it reads but not wholly (Llama
    3's rope, which llama.cpp stores as a tensor; StarCoder2's rope base; Qwen3's head width; YaRN, Gemma 3's
    linear scaling on its global layers, Phi-3's long rope and Phi-4-mini's partial one, Gemma 2's softcaps; Qwen3-MoE's experts' width and Qwen2-MoE's shared
    expert's gate), and mixtures (Qwen's, Mixtral's, written as llama with experts, Granite-MoE's, OLMoE's, DeepSeek-V2's
    with its kv_b split in two and its YaRN scale, DeepSeek-V3's (written as deepseek2 too: its experts chosen by a
    sigmoid with a bias, in groups) and GLM-4.7-Flash's (written so, its file saying neither how its experts are
    chosen nor that its first layer is dense), GLM-4.5's (its multi-token prediction layer in the file, left out); gpt-oss's with biases, sinks and its own YaRN settings), whose
    experts spec splits itself. spec reads each into the model it was made from: the
    same logits in float32 over more tokens than OLMo 3's and Gemma 3's windows (a permutation of rows skipped or
    made, a norm not stored plus one, a multiplier dropped, OLMo 3 read as the OLMo 2 its file names, a rope setting
    dropped fail here), with the file's own tokenizer."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(ARCHS / name, dtype=torch.float32)
    loaded = load(ModelRef(str(ARCHS / f"{name}.gguf")), torch.device("cpu"), torch.float32)
    model_type, rope_type = READ_AS[name]
    rope = loaded.model.config.rope_parameters
    assert loaded.model.config.model_type == model_type
    assert rope.get("full_attention", rope)["rope_type"] == rope_type
    ids = torch.tensor([[2, 17, 42, 99, 5, 250, 7, 64, 128, 33, 201, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    assert loaded.tokenizer.decode(loaded.tokenizer("def fib(n):", add_special_tokens=False)["input_ids"]) == \
        "def fib(n):"


def rewritten(source: Path, target: Path, keys: dict, extra_layer: int | None = None) -> Path:
    """A copy of a GGUF file with `keys` set ({name: (value, GGUFValueType)}) and, with `extra_layer`, that layer's
    tensors once more as the layer after the last (where llama.cpp's converter puts multi-token prediction layers)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in keys:
            kind = field.types[0]
            writer.add_key_value(name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, (value, kind) in keys.items():
        writer.add_key_value(name, value, kind)
    layers = reader.fields[f"{reader.fields['general.architecture'].contents()}.block_count"].contents()
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    if extra_layer is not None:
        for tensor in reader.tensors:
            if tensor.name.startswith(f"blk.{extra_layer}."):
                writer.add_tensor(tensor.name.replace(f"blk.{extra_layer}.", f"blk.{layers}.", 1), tensor.data,
                                  raw_dtype=tensor.tensor_type)
        writer.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_deepseek_files_of_other_expert_choices_are_refused(tmp_path):
    """llama.cpp writes DeepSeek-V2 (a softmax), V3 and its kin (a sigmoid with a bias: read as V3, above) as
    deepseek2; a file whose experts are chosen otherwise (another gating function, or a sigmoid without its bias)
    would be another model: one line instead."""
    import gguf

    from spec_cli.core.errors import SpecError

    uint32 = gguf.GGUFValueType.UINT32
    for source, gating in (("deepseek_v2", 3), ("deepseek_v2", 2), ("deepseek_v3", 1)):
        path = rewritten(ARCHS / f"{source}.gguf", tmp_path / f"{source}-{gating}.gguf",
                         {"deepseek2.expert_gating_func": (gating, uint32)})
        with pytest.raises(SpecError, match="chosen otherwise"):
            load(ModelRef(str(path)), torch.device("cpu"), torch.float32)


def test_a_deepseek_files_multi_token_prediction_layers_are_left_out(tmp_path):
    """GLM-4.7-Flash's files (written as deepseek2) hold its multi-token prediction layer after its decoder layers,
    counted in the file's layers: spec reads the decoder's alone (the logits of the file without it), and says
    what it left out."""
    import gguf

    uint32 = gguf.GGUFValueType.UINT32
    path = rewritten(ARCHS / "deepseek_v3.gguf", tmp_path / "mtp.gguf",
                     {"deepseek2.block_count": (3, uint32), "deepseek2.nextn_predict_layers": (1, uint32)},
                     extra_layer=1)
    said = []
    with_mtp = load(ModelRef(str(path)), torch.device("cpu"), torch.float32, say=said.append).model
    plain = load(ModelRef(str(ARCHS / "deepseek_v3.gguf")), torch.device("cpu"), torch.float32).model
    assert with_mtp.config.num_hidden_layers == plain.config.num_hidden_layers == 2
    assert any("left out (multi-token prediction layers)" in line for line in said)
    ids = torch.tensor([[2, 17, 42, 99, 5, 250, 7, 64]])
    with torch.no_grad():
        assert torch.equal(with_mtp(ids).logits, plain(ids).logits)


def test_rope_frequencies_of_no_llama_3_rope_are_refused():
    """A rope_freqs tensor that no Llama 3 rope gives (its divisors as llama.cpp stores them) is one line, not a
    model rotated otherwise; Llama 3.1's own (factor 8, original context 8192) are read back to its settings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from spec_cli.core.errors import SpecError
    from spec_cli.models import gguf_archs

    llama31 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=llama31)
    frequencies, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(rope_theta=500000.0))
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)
    assert gguf_archs._llama3_rope(plain, base / frequencies).rope_parameters == llama31
    with pytest.raises(SpecError, match="not those of a Llama 3 rope"):
        gguf_archs._llama3_rope(plain, 1 + torch.rand(64))


def test_gemma_files_take_llama_cpp_s_attention_scale():
    """Gemma 2's and 3's files hold no attention scale: 1 / sqrt(head width) as llama.cpp takes it, but for their
    27B models (46 and 62 layers) 1 / sqrt(width / heads), which their own configurations say (144, 168)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from spec_cli.models import gguf_archs

    gemma2_27b = Gemma2Config(hidden_size=4608, num_attention_heads=32, head_dim=128, num_hidden_layers=46)
    gemma3_27b = Gemma3TextConfig(hidden_size=5376, num_attention_heads=32, head_dim=128, num_hidden_layers=62)
    gemma3_4b = Gemma3TextConfig(hidden_size=2560, num_attention_heads=8, head_dim=256, num_hidden_layers=34)
    assert [gguf_archs._gemma_scale(c).query_pre_attn_scalar for c in (gemma2_27b, gemma3_27b, gemma3_4b)] == \
        [144, 168, 256]


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
def test_spec_generate_runs_a_granite_file_as_its_model_does(tmp_path):
    """End to end on a Granite file (an architecture spec teaches transformers to read): every method's text is
    the model's own greedy decoding (Hugging Face's generate on the folder it was converted from)."""
    import json

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(ARCHS / "granite", dtype=torch.float32)
    tokenizer = load_tokenizer(ModelRef(str(ARCHS / "granite.gguf")))
    ids = tokenizer("def fib(n):", return_tensors="pt")["input_ids"]
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    for method in ("baseline", "staged"):
        done = spec("generate", "--oracle", str(ARCHS / "granite.gguf"), "-m", method, "-n", "12", "--dtype",
                    "float32", "--json", "def fib(n):", env={"SPEC_CACHE_DIR": str(tmp_path / "cache")})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tokens"] == expected, method


def test_profiles_name_gguf_files_by_path_or_in_a_repository(tmp_path):
    from spec_cli.models import profiles

    (tmp_path / "a.toml").write_text('oracle = "models/x.gguf"\n')
    (tmp_path / "b.toml").write_text('oracle = { model = "org/repo-GGUF", gguf_file = "x.Q4_K_M.gguf" }\n'
                                     'draft = "self"\n')
    a, b = profiles.load(str(tmp_path / "a.toml")), profiles.load(str(tmp_path / "b.toml"))
    assert a.oracle == ModelRef(str(tmp_path / "models" / "x.gguf")) and spec_gguf.is_gguf(a.oracle)
    assert b.oracle == ModelRef("org/repo-GGUF", gguf_file="x.Q4_K_M.gguf") and spec_gguf.is_gguf(b.oracle)
    assert profiles.select(None, oracle="y.gguf").oracle.model == str((tmp_path.cwd() / "y.gguf").resolve())


@needs_gguf
def test_spec_check_passes_a_real_quantized_file_held_to_its_own_sensitivity(smol, monkeypatch):
    """SmolLM2's Q4_1 file: every tree node is bitwise its path on spec's runner, 4e-2 of a logit off the model's own
    forward, which moves as much for one rounding in a thousandth of its inputs (8-bit activations). The check
    passes on that floor; held to the fixed tolerance alone it fails, as `spec check` did before."""
    import random

    from spec_cli.models import conformance

    loaded = smol[0]
    limits = (conformance.tolerance(torch.float32), conformance.tolerance(torch.bfloat16))
    result = conformance._tree(loaded.model, loaded.tokenizer, 3, random.Random(0), limits)
    assert result.ok and "0.0e+00 against each path alone" in result.detail, result.detail
    with monkeypatch.context() as m:
        m.setattr(conformance, "_nudged", lambda *a: None)
        m.setattr(conformance, "_stepped", lambda *a: None)
        assert not conformance._tree(loaded.model, loaded.tokenizer, 3, random.Random(0), limits).ok


class MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(name, __import__("ctypes").c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo() -> MallInfo2 | None:
    """glibc's statistics (`hblks`: allocations served by mappings of their own, `fordblks`: the heap's free
    bytes); None: no mallinfo2 here."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return None
    return libc.mallinfo2()


def mapped_while_held(size: int) -> int:
    """How many of enough `size`-byte tensors, held at once, to outgrow the heap's free memory came from mappings
    of their own."""
    before = mallinfo()
    held = [torch.empty(size, dtype=torch.uint8) for _ in range(before.fordblks // size + 3)]
    mapped = mallinfo().hblks - before.hblks
    del held
    return mapped


@needs_gguf
def test_a_gguf_files_tokenizer_alone_comes_from_its_load_in_the_cache(smol, monkeypatch, tmp_path):
    """`load_tokenizer` of a GGUF file (what `spec fit-draft2` tokenizes a corpus with) reads the tokenizer its
    load kept in the cache, the one decoding encodes with, not the file again; without a load, the file's. (The
    two can differ in rare cases: Qwen2.5-Coder's on 4 of Python's 1,790 library files, 'ιι' and 'naïve'.)"""
    import sysconfig

    from spec_cli.models.loading import load_tokenizer

    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "empty"))
    from_file = load_tokenizer(ModelRef(str(SMOL)))
    assert Path(from_file.name_or_path) == SMOL.resolve().parent
    monkeypatch.setenv("SPEC_CACHE_DIR", str(smol[1]))
    cached = load_tokenizer(ModelRef(str(SMOL)))
    assert Path(cached.name_or_path).parent == smol[1] / "gguf"
    assert len(cached) == len(from_file) and cached.chat_template == from_file.chat_template
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:40]:
        text = path.read_text(errors="replace")
        assert cached(text)["input_ids"] == from_file(text)["input_ids"], path


@needs_gguf
def test_after_a_gguf_load_a_forwards_transient_tensors_come_from_the_heap(smol, monkeypatch):
    """Loading maps allocations of 1 MiB and up (a lower peak); decoding, after it, must not: a forward's logits and
    activations mapped afresh fault in every page, every forward (the real pair staged: 7-9% of its time)."""
    if mallinfo() is None:
        pytest.skip("needs glibc's mallinfo2")
    monkeypatch.setenv("SPEC_CACHE_DIR", str(smol[1]))
    with spec_gguf.allocations_for_loading():
        assert mapped_while_held(2 << 20) >= 3
    loaded = load(ModelRef(str(SMOL)), torch.device("cpu"), torch.float32, say=lambda line: None)
    assert type(loaded.model.model.layers[0].mlp.down_proj).__name__ == "Quantized"
    for size in (2 << 20, 10 << 20):  # (a 16-row forward's logits over 151,936 words: 9.7 MB)
        assert mapped_while_held(size) == 0, size
    assert mapped_while_held(64 << 20) >= 3  # (a long prompt's read: still mappings of their own, given back)


def test_auto_is_bfloat16_on_a_cpu_where_the_files_products_run_on_spec_s_kernels(monkeypatch):
    """On a CPU without fast bfloat16 (AVX2), "auto" still picks bfloat16 for a GGUF file or an int4/int8 model
    where spec's integer kernels run (they take bfloat16 activations; its glue runs in bfloat16 only), and for a
    float model where its bfloat16 products are built (`mm16`); float32 where the kernels do not run, or did not
    build; the tuned settings' key agrees."""
    from spec_cli.core import hardware
    from spec_cli.exec import native
    from spec_cli.models import tuned
    from spec_cli.models.loading import dtype_for

    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(native, "variant", lambda: "avx2")
    monkeypatch.delenv("SPEC_NATIVE", raising=False)
    file, folder = ModelRef(model="models/m.gguf"), ModelRef(model="models/m")
    assert dtype_for(file, "auto", cpu, None) == torch.bfloat16
    monkeypatch.setattr(native, "int4", lambda say=None: object())  # (built)
    assert dtype_for(folder, "auto", cpu, None) == torch.bfloat16
    monkeypatch.setattr(native, "int4", lambda say=None: None)  # (no compiler: torch's bfloat16 product is slow)
    assert dtype_for(folder, "auto", cpu, None) == torch.float32
    assert dtype_for(folder, "auto", cpu, "int4") == torch.bfloat16
    assert dtype_for(file, "auto", cpu, "none") == torch.float32  # (dequantized to float)
    assert dtype_for(file, "float32", cpu, None) == torch.float32
    profile = Profile(name="p", source="test", oracle=file)
    assert tuned.resolve_key(profile, "cpu", None).endswith("-bfloat16")
    monkeypatch.setattr(native, "variant", lambda: None)
    assert dtype_for(file, "auto", cpu, None) == torch.float32
    assert tuned.resolve_key(profile, "cpu", None).endswith("-float32")
    monkeypatch.setattr(native, "variant", lambda: "avx2")
    monkeypatch.setenv("SPEC_NATIVE", "0")
    assert dtype_for(file, "auto", cpu, None) == torch.float32
