"""A draft drafting from part of the vocabulary (FR-Spec): its head computes those words' logits only, at the
bits the whole head gives them (spec's int4 kernel, and a float head), the rest -inf; every method stays
identical to baseline, greedy and coupled top-k; the words are the most frequent in Python's library."""

from __future__ import annotations

import pytest
import torch
from conftest import load_pair
from helpers import assert_clean_error, spec

from spec_cli.completion import complete
from spec_cli.core.errors import SpecError
from spec_cli.core.settings import Decoding
from spec_cli.exec import Runner, native
from spec_cli.exec.quant import quantize_model
from spec_cli.models import vocabulary


@pytest.mark.parametrize("kind", ["float", "int4"])
def test_a_cut_head_gives_its_words_the_whole_heads_bits(tiny_dir, kind):
    _, draft = load_pair(tiny_dir, "llama", dtype=torch.float32 if kind == "float" else torch.bfloat16)
    if kind == "int4":
        if native.int4() is None:
            pytest.skip(f"spec's kernels: {native.status()}")
        quantize_model(draft, "int4")
    words = torch.tensor(sorted({3, 7, 8, 20, 41, 42, 100, 250, 299} | set(range(120, 140))))
    whole = Runner(draft, capacity=128).forward(list(range(5, 40)), commit=35, last=None).logits
    cut = Runner(draft, capacity=128, words=words)
    assert cut.words is not None
    part = cut.forward(list(range(5, 40)), commit=35, last=None).logits
    outside = torch.ones(part.shape[-1], dtype=torch.bool)
    outside[words] = False
    assert torch.isinf(part[:, outside]).all() and (part[:, outside] < 0).all()
    assert torch.equal(part[:, words], whole[:, words])


def test_every_method_stays_exact_with_a_cut_draft(tiny_dir, tmp_path, monkeypatch):
    from spec_cli.engine import Engine
    from spec_cli.models import profiles

    monkeypatch.setenv("SPEC_DRAFT_WORDS", "64")
    monkeypatch.setattr(vocabulary, "CORPUS_BYTES", 200_000)
    profile = tmp_path / "p.toml"
    profile.write_text(f'oracle = "{tiny_dir / "llama-oracle"}"\ndraft = "{tiny_dir / "llama-draft"}"\n'
                       'dtype = "float32"\n[decoding]\nmax_new_tokens = 24\n')
    engine = Engine(profiles.load(str(profile)), dtype="float32", need_draft=True)
    ids = engine.encode("def fib(n):\n    return")
    for sampled in (False, True):
        settings = Decoding(max_new_tokens=24, temperature=1.0 if sampled else 0.0, top_k=40 if sampled else 0,
                            seed=3)
        base = complete(engine, ids, settings.replace(method="baseline")).tokens
        for method in ("speculative", "staged"):
            assert complete(engine, ids, settings.replace(method=method)).tokens == base, (method, sampled)
    runner = engine._runners["draft"][0]
    assert runner.words is not None and len(runner.words) == 64


def test_the_words_are_the_most_frequent_in_pythons_library(tiny_dir, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(vocabulary, "CORPUS_BYTES", 200_000)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    ranking = vocabulary.ranked(tokenizer)
    assert sorted(ranking.tolist()) == list(range(len(tokenizer)))  # every word, once
    assert ranking[0] == tokenizer.eos_token_id  # (special tokens first)
    space = tokenizer.convert_tokens_to_ids("Ġ")
    assert space in vocabulary.frequent(tokenizer, 20).tolist()  # a space: among the commonest in code
    assert torch.equal(vocabulary.ranked(tokenizer), ranking)  # (read back from the cache)


def test_any_count_under_the_vocabulary_cuts_the_draft_and_a_bad_one_is_one_line(tiny_dir, tmp_path, monkeypatch):
    from spec_cli.engine import Engine
    from spec_cli.models import profiles

    monkeypatch.setattr(vocabulary, "CORPUS_BYTES", 200_000)
    profile = tmp_path / "p.toml"
    profile.write_text(f'oracle = "{tiny_dir / "llama-oracle"}"\ndraft = "{tiny_dir / "llama-draft"}"\n'
                       'dtype = "float32"\n[decoding]\nmax_new_tokens = 8\n')
    engine = Engine(profiles.load(str(profile)), dtype="float32", need_draft=True)
    words = engine.draft.model.config.vocab_size
    for count, cut in ((words // 2, words // 2), (words - 1, words - 1), (words, None), (0, None)):
        monkeypatch.setenv("SPEC_DRAFT_WORDS", str(count))  # (half the words: once silently all of them)
        got = engine._draft_words("draft", engine.draft.model)
        assert (None if got is None else len(got)) == cut, count
    for bad in ("many", "-3"):
        monkeypatch.setenv("SPEC_DRAFT_WORDS", bad)
        with pytest.raises(SpecError, match="SPEC_DRAFT_WORDS: a number of words"):
            engine._draft_words("draft", engine.draft.model)
    monkeypatch.setenv("SPEC_DRAFT_WORDS", "many")
    assert_clean_error(spec("generate", "-p", str(profile), "-m", "staged", "-n", "4", "def f():",
                            env={"SPEC_DRAFT_WORDS": "many"}), "SPEC_DRAFT_WORDS: a number of words")
