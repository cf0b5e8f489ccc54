"""draft2 = "auto": prompt lookup, and a trigram once one is fitted (a draft's sampled in the background, once per
draft; a tokenizer's on a corpus, on a CPU at a first use, for a model alone and for a pair alike)."""

import json
import os
import shutil
import time

import pytest
from helpers import spec

from spec_cli.core.settings import ModelRef, Profile
from spec_cli.draft2 import trigrams
from spec_cli.draft2.fit import standard_library
from spec_cli.draft2.ngram import KatzTrigram, LookupOrTrigram, PromptLookup
from spec_cli.engine import Engine, load_draft2
from spec_cli.models import profiles
from spec_cli.models.loading import load_tokenizer


def corpus_of(model: str):
    """Where the corpus trigram of `model`'s tokenizer is kept."""
    return trigrams.corpus_path(load_tokenizer(ModelRef(model)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_draft_is_known_by_its_files(tiny_dir, tmp_path):
    copy = tmp_path / "draft"
    shutil.copytree(tiny_dir / "gpt2-draft", copy)
    ref = ModelRef(str(copy))
    key = trigrams.draft_key(ref)
    assert trigrams.draft_key(ModelRef(str(copy))) == key
    assert trigrams.draft_key(ModelRef(str(tiny_dir / "gpt2-draft"))) != key  # another folder
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")  # retrained: fitted again
    assert trigrams.draft_key(ref) != key
    assert trigrams.draft_key(ModelRef("org/model")) != trigrams.draft_key(ModelRef("org/model", revision="v2"))


def test_auto_is_lookup_until_a_trigram_is_fitted_a_drafts_for_a_pair_a_tokenizers_for_a_model_alone(tiny_dir, cache):
    oracle, draft = ModelRef(str(tiny_dir / "gpt2-oracle")), ModelRef(str(tiny_dir / "gpt2-draft"))
    pair, alone = Profile("pair", "", oracle, draft), Profile("alone", "", oracle, None)
    tokenizer = load_tokenizer(oracle)
    assert trigrams.ready(pair, tokenizer) is None and trigrams.ready(alone, tokenizer) is None
    assert isinstance(load_draft2("auto", None, 300, None), PromptLookup)
    assert isinstance(load_draft2(None, profiles.DEFAULT_DRAFT2, 300, None), PromptLookup)
    corpus = trigrams.corpus_path(tokenizer)
    corpus.parent.mkdir(parents=True)
    KatzTrigram.fit([[1, 2, 3, 4] * 10], vocab_size=300).save(corpus)
    assert corpus == trigrams.corpus_path(load_tokenizer(draft))  # one tokenizer: one corpus trigram for both
    assert trigrams.ready(alone, tokenizer) == corpus == trigrams.ready(self_drafted(alone), tokenizer)
    assert trigrams.ready(pair, tokenizer) is None  # (a pair drafted no faster with it: the draft's own only)
    sampled = trigrams.sampled_path(draft)
    KatzTrigram.fit([[1, 2, 5, 6] * 10], vocab_size=300).save(sampled)
    assert trigrams.ready(pair, tokenizer) == sampled and trigrams.ready(alone, tokenizer) == corpus
    both = load_draft2("auto", None, 300, trigrams.ready(pair, tokenizer))
    assert isinstance(both, LookupOrTrigram) and both.propose([9, 1, 2], 2) == [5, 6]
    other = tokenizer.__class__.from_pretrained(tiny_dir / "gpt2-oracle")
    assert trigrams.corpus_path(other) == corpus
    other.add_tokens(["<extra>"])
    assert trigrams.corpus_path(other) != corpus  # another vocabulary (the same object, grown): another trigram


def self_drafted(alone: Profile) -> Profile:
    """`alone` with a self-draft: still one model, whose trigram is its tokenizer's."""
    return Profile("self", "", alone.oracle, ModelRef("self"))


def test_one_model_alone_uses_its_tokenizers_fitted_trigram(tiny_dir, cache, monkeypatch):
    oracle = ModelRef(str(tiny_dir / "gpt2-oracle"))
    alone = Profile("alone", "", oracle, None)
    engine = Engine(alone, dtype="float32")
    settings = alone.decoding.replace(method="staged")
    assert isinstance(engine.plan(settings).draft2, PromptLookup)
    path = corpus_of(str(tiny_dir / "gpt2-oracle"))
    path.parent.mkdir(parents=True)
    KatzTrigram.fit([[1, 2, 3, 4] * 10], vocab_size=300).save(path)
    later = Engine(alone, dtype="float32")
    assert isinstance(later.plan(settings).draft2, LookupOrTrigram)
    path.unlink()  # fitted at a first use, on a CPU: the plan that fitted it uses it
    first = Engine(alone, dtype="float32", fit_draft2=True)
    corpus = path.parent / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    monkeypatch.setenv("SPEC_DRAFT2_CORPUS", str(corpus))
    monkeypatch.delenv("SPEC_BACKGROUND_FIT")
    assert isinstance(first.plan(settings).draft2, LookupOrTrigram) and path.is_file()


def test_a_cpu_fits_in_the_background_only_when_asked(tiny_dir, cache, monkeypatch):
    """On a CPU the child would compete with the decoding threads for the cores."""
    draft = ModelRef(str(tiny_dir / "gpt2-draft"))
    monkeypatch.delenv("SPEC_BACKGROUND_FIT", raising=False)
    assert not trigrams.fit_in_background(draft, "cpu")
    assert not trigrams.sampled_path(draft).with_suffix(".lock").exists()


def test_a_failed_fit_is_not_retried_on_every_run(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("SPEC_BACKGROUND_FIT", "1")
    missing = tmp_path / "no-such-draft"
    missing.mkdir()
    draft = ModelRef(str(missing))
    assert trigrams.fit_in_background(draft)
    path = trigrams.sampled_path(draft)
    deadline = time.time() + 120
    while path.with_suffix(".lock").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert path.with_suffix(".failed").is_file() and not path.is_file()
    assert path.with_suffix(".log").read_text()  # why, for whoever looks
    assert not trigrams.fit_in_background(draft)  # not again at once
    old = time.time() - trigrams.RETRY - 1
    os.utime(path.with_suffix(".failed"), (old, old))
    assert trigrams.fit_in_background(draft)  # a day later, once more


def test_the_trigram_is_fitted_once_in_the_background_and_then_used(profile, cache, monkeypatch):
    monkeypatch.setenv("SPEC_BACKGROUND_FIT", "1")
    monkeypatch.setenv("SPEC_DRAFT2_TOKENS", "4096")
    chosen = profiles.load(str(profile))
    engine = Engine(chosen, dtype="float32", fit_draft2=True)
    settings = chosen.decoding.replace(method="staged")
    assert isinstance(engine.plan(settings).draft2, PromptLookup)  # nobody waits for it
    assert engine.note and "background" in engine.note
    assert not trigrams.fit_in_background(chosen.draft)  # one fit per draft at a time
    path = trigrams.sampled_path(chosen.draft)
    deadline = time.time() + 120
    while not path.is_file() and time.time() < deadline:
        time.sleep(0.2)
    assert path.is_file(), (path.with_suffix(".log").read_text() if path.with_suffix(".log").exists() else "")
    while path.with_suffix(".lock").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not path.with_suffix(".lock").exists()
    fitted = KatzTrigram.load(path)
    assert fitted.unigram_counts.sum() >= 4096
    later = Engine(chosen, dtype="float32", fit_draft2=True)
    assert isinstance(later.plan(settings).draft2, LookupOrTrigram) and later.note is None
    assert not trigrams.fit_in_background(chosen.draft)  # fitted: nothing more to do


def test_generate_says_it_fits_in_the_background_and_the_flag_turns_it_off(profile, cache, monkeypatch):
    monkeypatch.setenv("SPEC_BACKGROUND_FIT", "1")
    monkeypatch.setenv("SPEC_DRAFT2_TOKENS", "1024")
    run = spec("generate", "-p", str(profile), "-m", "staged", "--draft2", "prompt-lookup", "-n", "4", "x")
    assert run.returncode == 0 and "background" not in run.stderr
    run = spec("generate", "-p", str(profile), "-m", "staged", "-n", "4", "x")
    assert run.returncode == 0, run.stderr
    assert "fitting draft2's trigram" in run.stderr
    deadline = time.time() + 120
    draft = profiles.load(str(profile)).draft
    while trigrams.sampled_path(draft).with_suffix(".lock").exists() and time.time() < deadline:
        time.sleep(0.2)  # leave no child behind


def test_prompt_lookup_copies_after_the_latest_match_of_the_longest_suffix():
    """PromptLookup against a plain reading of its rule, on random texts, among them tokens whose bytes make
    false matches across token boundaries (its search runs over the text's bytes)."""
    import random

    def rule(context, n, longest, shortest):
        tokens = list(context[-4096:])
        for size in range(longest, shortest - 1, -1):
            starts = [i for i in range(len(tokens) - size) if tokens[i : i + size] == tokens[-size:]]
            if len(tokens) > size and starts:
                copied, start = [], starts[-1] + size
                while len(copied) < n:  # beyond the text: the copy repeats itself
                    copied.append(tokens[start + len(copied)] if start + len(copied) < len(tokens)
                                  else copied[len(copied) - (len(tokens) - start)])
                return copied
        return []

    rng = random.Random(0)
    for trial in range(3000):
        alphabet = rng.choice([[0, 1], list(range(7)), [1, 256, 65536, 0x01000000, 0x00010100], list(range(9000))])
        context = [rng.choice(alphabet) for _ in range(rng.choice([0, 1, 2, 3, 5, 9, 40, 200]))]
        longest = rng.choice([1, 2, 3, 4])
        shortest = rng.randint(1, longest)
        n = rng.randrange(0, 10)
        assert PromptLookup(longest, shortest).propose(context, n) == rule(context, n, longest, shortest)


def test_a_lone_oracle_fits_its_trigram_at_its_first_use_on_a_cpu(tiny_dir, cache, monkeypatch, tmp_path):
    """On a CPU a lone oracle's first staged run fits its trigram in its own process (a child would take the
    decoding threads' cores), on SPEC_DRAFT2_CORPUS (else Python's library), and uses it at once; later runs find
    it. SPEC_BACKGROUND_FIT=0: only told how; 1: in a child, as on a GPU."""
    oracle = str(tiny_dir / "gpt2-oracle")
    path = corpus_of(oracle)
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    monkeypatch.setenv("SPEC_DRAFT2_CORPUS", str(corpus))
    monkeypatch.setenv("SPEC_BACKGROUND_FIT", "0")
    run = spec("generate", "--oracle", oracle, "-n", "4", "x")
    assert run.returncode == 0 and "spec fit-draft2" in run.stderr and not path.exists(), run.stderr
    monkeypatch.delenv("SPEC_BACKGROUND_FIT")
    run = spec("generate", "--oracle", oracle, "-n", "4", "-m", "baseline", "x")
    assert "trigram" not in run.stderr and not path.exists()  # (no trigram asked for)
    path.parent.mkdir(parents=True)
    path.with_suffix(".lock").write_text("999999999\n")  # a fit that died: its lock taken over
    run = spec("generate", "--oracle", oracle, "-n", "4", "--json", "def add(a, b):")
    assert run.returncode == 0 and "fitting draft2's trigram for this tokenizer on your corpus" in run.stderr, run.stderr
    assert path.is_file() and not path.with_suffix(".lock").exists()
    assert KatzTrigram.load(path).unigram_counts.sum() > 100
    run = spec("generate", "--oracle", oracle, "-n", "4", "x")
    assert run.returncode == 0 and "trigram" not in run.stderr  # fitted: nothing more to say
    path.unlink()
    monkeypatch.setenv("SPEC_BACKGROUND_FIT", "1")
    run = spec("generate", "--oracle", oracle, "-n", "4", "x")
    assert run.returncode == 0 and "fitting draft2's trigram from a corpus in the background" in run.stderr, run.stderr
    deadline = time.time() + 120
    while path.with_suffix(".lock").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert path.is_file(), path.with_suffix(".log").read_text()


def test_a_first_use_fit_that_fails_says_so_in_one_line_and_waits_a_day(tiny_dir, cache, monkeypatch, tmp_path):
    oracle = str(tiny_dir / "gpt2-oracle")
    monkeypatch.delenv("SPEC_BACKGROUND_FIT", raising=False)
    monkeypatch.setenv("SPEC_DRAFT2_CORPUS", str(tmp_path / "missing"))
    run = spec("generate", "--oracle", oracle, "-n", "4", "x")
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "was not fitted" in line]
    assert len(lines) == 1 and "corpus path not found" in lines[0] and "Traceback" not in run.stderr, run.stderr
    failed = corpus_of(oracle).with_suffix(".failed")
    assert failed.is_file()
    run = spec("generate", "--oracle", oracle, "-n", "4", "x")
    assert run.returncode == 0 and "fitting" not in run.stderr  # not again within a day
    os.utime(failed, (time.time() - trigrams.RETRY - 1,) * 2)
    run = spec("generate", "--oracle", oracle, "-n", "4", "x")
    assert "fitting draft2's trigram" in run.stderr  # a day later, once more


def test_a_ctrl_c_while_fitting_says_so_in_one_line_and_writes_nothing(tiny_dir, cache, tmp_path, monkeypatch):
    import spec_cli.draft2.fit as fit

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fit, "fit_from_corpus", interrupted)
    run = spec("fit-draft2", str(tmp_path / "x.npz"), "--oracle", str(tiny_dir / "gpt2-oracle"))
    assert run.returncode == 130 and run.stderr.strip() == "interrupted", run.stderr
    assert not list(tmp_path.glob("x.npz*"))


def test_the_standard_library_corpus_is_pythons_own_code():
    files = standard_library()
    names = {f.name for f in files}
    assert {"os.py", "functools.py", "typing.py"} <= names
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_fit_draft2_with_no_file_fits_a_lone_oracles_trigram_into_the_cache(tiny_dir, cache, tmp_path, monkeypatch):
    """`spec fit-draft2 --oracle X` (no draft, no file): a corpus trigram in the cache, used by `auto` from then
    on; by default on Python's library (here three of its files, so the test is quick)."""
    import spec_cli.draft2.fit as fit

    picked = standard_library()[:3]
    monkeypatch.setattr(fit, "standard_library", lambda: picked)
    oracle = str(tiny_dir / "gpt2-oracle")
    result = spec("fit-draft2", "--oracle", oracle)
    path = corpus_of(oracle)
    assert result.returncode == 0 and path.is_file(), result.stderr
    assert str(path) in result.stderr and "auto" in result.stderr
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # (no part left beside it)
    fitted = KatzTrigram.load(path)
    assert fitted.unigram_counts.sum() > 1000
    run = spec("generate", "--oracle", oracle, "-n", "24", "--json", "def f(x):")
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["method"] == "staged" and record["stats"]["forwards"].get("draft", 0) == 0
    baseline = json.loads(spec("generate", "--oracle", oracle, "-n", "24", "--json", "-m", "baseline",
                               "def f(x):").stdout)
    assert record["tokens"] == baseline["tokens"]

