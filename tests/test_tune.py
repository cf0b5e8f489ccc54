"""`spec tune`: the searches work, their results are saved per machine, and generate picks them up."""

import json
import random
from collections import Counter

import numpy as np
import pytest
from helpers import assert_clean_error, spec
from tiny import CORPUS

from spec_cli.core.settings import Decoding
from spec_cli.draft2.ngram import KatzTrigram
from spec_cli.tune import (
    HammingGP,
    SkipSearch,
    decode_skip,
    encode_skip,
    propose_skip,
    successive_halving,
)


@pytest.fixture()
def data_home(tmp_path):
    """Keep tuning records out of the user's real data dir."""
    return {"XDG_DATA_HOME": str(tmp_path / "data")}


@pytest.fixture(scope="module")
def tiny_profile(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune")
    path = folder / "tinytune.toml"
    path.write_text(f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "{tiny_dir / "gpt2-draft"}"\n'
                    'dtype = "float32"\n[decoding]\nmax_new_tokens = 20\n')
    prompts = []
    for i, text in enumerate(CORPUS[:3]):
        prompts.append(folder / f"prompt{i}.txt")
        prompts[-1].write_text(text[:30])
    return path, prompts


def test_gp_interpolates_and_expected_improvement_prefers_the_unknown_near_the_best():
    rng = random.Random(0)
    xs = list({tuple(rng.randint(0, 1) for _ in range(8)) for _ in range(20)})
    ys = [sum(x[:4]) - sum(x[4:]) for x in xs]
    gp = HammingGP(xs, ys)
    mean, std = gp.predict(xs)
    np.testing.assert_allclose(mean.numpy(), ys, atol=0.35)
    best = (1, 1, 1, 1, 0, 0, 0, 0)
    far = (0, 0, 0, 0, 1, 1, 1, 1)
    m, s = gp.predict([best, far])
    assert float(m[0]) > float(m[1]) + 3  # learned the structure, not just the data


def test_bayesian_optimisation_beats_random_search_on_a_skip_landscape():
    """A synthetic objective with one best skip set: BO finds it (or a neighbour) in the budget, random does not."""
    d = 12
    target = (1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0)
    score = lambda x: -sum(a != b for a, b in zip(x, target)) + random.Random(hash(x)).gauss(0, 0.1)  # noqa: E731
    observed = {}
    rng = random.Random(1)
    for _ in range(30):
        x = propose_skip(observed, d, rng)
        assert x not in observed and any(x)
        observed[x] = score(x)
    bo_best = max(observed, key=observed.get)
    rng = random.Random(1)
    random_best = max((tuple(rng.randint(0, 1) for _ in range(d)) for _ in range(30)), key=score)
    distance = lambda x: sum(a != b for a, b in zip(x, target))  # noqa: E731
    assert distance(bo_best) <= 1 < distance(random_best)


def test_skip_vectors_round_trip_and_records_refine():
    skip = decode_skip((1, 0, 0, 1, 0, 1, 1, 0), 4)
    assert skip.skip_attention == (0, 3) and skip.skip_mlp == (1, 2)
    assert encode_skip(skip, 4) == (1, 0, 0, 1, 0, 1, 1, 0)
    search = SkipSearch(4, {(1, 0, 0, 1, 0, 1, 1, 0): 1.3, (0, 1, 0, 0, 0, 0, 0, 0): 0.9})
    again = SkipSearch.from_records(4, search.as_records())
    assert again.observations == search.observations and again.best()[1] == 1.3


def test_successive_halving_keeps_the_fastest_and_spends_more_on_survivors():
    spent = Counter()
    speed = {i: i + random.Random(i).random() for i in range(27)}

    def evaluate(candidate, prompts):
        spent[candidate["i"]] += prompts
        return speed[candidate["i"]]

    raced = successive_halving(evaluate, [{"i": i} for i in range(27)], prompts=8)
    assert raced[0][0]["i"] == 26
    assert spent[26] > spent[0] == 1  # the slow ones were measured once, the winner on ever more prompts
    assert sum(spent.values()) < 27 * 8 / 2  # far cheaper than measuring everything on every prompt


def test_tune_end_to_end_saves_settings_that_generate_uses(tiny_profile, data_home):
    path, prompts = tiny_profile
    args = ["tune", "-p", str(path), "--only", "skip,shape", "--iterations", "4", "--count", "2", "-n", "8",
            *sum((["--prompts", str(p)] for p in prompts), [])]
    first = spec(*args, env=data_home)
    assert first.returncode == 0, first.stderr
    shown = json.loads(spec("tune", "-p", str(path), "--show", "--json", env=data_home).stdout)
    machine = shown["machines"][shown["this_machine"]]
    assert len(machine["self_draft"]["observations"]) == 4
    greedy = machine["greedy"]
    assert greedy["settings"]["method"] in ("baseline", "speculative", "staged", "self")
    assert greedy["baseline_tokens_per_second"] > 0 and greedy["raced"]
    assert greedy["tokens_per_second"] >= greedy["baseline_tokens_per_second"] and greedy["speedup"] >= 1

    # generate picks the tuned shape (and skip set) up, and the output is still the oracle's
    base = json.loads(spec("generate", "-p", str(path), "def f(", "-m", "baseline", "--json", env=data_home).stdout)
    tuned = json.loads(spec("generate", "-p", str(path), "def f(", "--json", env=data_home).stdout)
    assert tuned["tuned"] == shown["this_machine"] and tuned["tokens"] == base["tokens"]
    for key, value in greedy["settings"].items():
        if key != "draft2":
            assert tuned["settings"][key] == value
    selfish = json.loads(spec("generate", "-p", str(path), "def f(", "-m", "self", "--json", env=data_home).stdout)
    assert selfish["tokens"] == base["tokens"] and selfish["stats"]["forwards"]["draft"] > 0
    untuned = json.loads(spec("generate", "-p", str(path), "def f(", "--untuned", "--json", env=data_home).stdout)
    assert untuned["tuned"] is None and untuned["settings"]["tree_budget"] == Decoding().tree_budget
    assert "greedy" in spec("tune", "-p", str(path), "--show", env=data_home).stdout

    # the benchmark runs the tuned settings, and the untuned ones side by side
    dataset = path.parent / "problems.jsonl"
    dataset.write_text("".join(json.dumps({"task_id": f"T/{i}", "prompt": p.read_text()}) + "\n"
                               for i, p in enumerate(prompts)))
    run = spec("bench", "humaneval", "-p", str(path), "--dataset", str(dataset), "--out", str(path.parent / "b"),
               "-n", "8", "--modes", "greedy", "--methods", "baseline,auto,auto:untuned,self,staged:untuned",
               env=data_home)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (path.parent / "b" / "results.jsonl").read_text().splitlines()]
    by_method = {r["method"]: r for r in rows}
    assert by_method["auto"]["settings"]["method"] == greedy["settings"]["method"]
    assert by_method["auto:untuned"]["settings"]["method"] == "staged"
    assert by_method["staged:untuned"]["settings"]["tree_budget"] == Decoding().tree_budget
    assert all(r["identical"] for r in rows)

    # re-running refines: earlier skip sets are kept and more are measured
    again = spec(*[("skip" if a == "skip,shape" else a) for a in args], env=data_home)
    assert again.returncode == 0, again.stderr
    shown = json.loads(spec("tune", "-p", str(path), "--show", "--json", env=data_home).stdout)
    assert len(shown["machines"][shown["this_machine"]]["self_draft"]["observations"]) == 8


def test_the_profile_file_wins_over_tuning(tiny_profile, data_home, tmp_path):
    path, prompts = tiny_profile
    pinned = tmp_path / "pinned.toml"
    pinned.write_text(path.read_text().replace("[decoding]\n", '[decoding]\nmethod = "speculative"\ndraft_tokens = 2\n'))
    run = spec("tune", "-p", str(pinned), "--only", "shape", "--count", "1", "-n", "6", "--prompts", str(prompts[0]),
               env=data_home)
    assert run.returncode == 0 and "sets draft_tokens; it wins over the tuned value" in run.stderr
    out = json.loads(spec("generate", "-p", str(pinned), "def f(", "--json", env=data_home).stdout)
    assert out["settings"]["method"] == "speculative" and out["settings"]["draft_tokens"] == 2


def test_fitting_draft2_on_a_corpus_gives_katz_probabilities_and_a_file(tiny_profile, data_home, tmp_path):
    path, prompts = tiny_profile
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("for i in range(10):\n    print(i)\n" * 40 + "def add(a, b):\n    return a + b\n" * 3)
    run = spec("tune", "-p", str(path), "--only", "draft2", "--corpus", str(corpus), env=data_home)
    assert run.returncode == 0, run.stderr
    shown = json.loads(spec("tune", "-p", str(path), "--show", "--json", env=data_home).stdout)
    record = shown["machines"][shown["this_machine"]]["draft2"]
    model = KatzTrigram.load(record["path"])  # the file round-trips

    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(path.read_text().split('"')[1])(corpus.read_text())["input_ids"]
    assert record["tokens"] == len(tokens) and record["complete"]
    # by hand: add-one unigrams ...
    counts = Counter(tokens)
    vocab = model.vocab_size
    for token in list(counts)[:5]:
        assert model.unigram[token] == pytest.approx((counts[token] + 1) / (len(tokens) + vocab))
    # ... and a trigram context seen so often (every count > 5, no Good-Turing discount) that
    # P(w | u v) is the plain relative frequency c(u v w) / c(u v)
    tri = Counter(zip(tokens, tokens[1:], tokens[2:]))
    contexts = Counter()
    for (u, v, w), c in tri.items():
        contexts[(u, v)] += c
    checked = 0
    for (u, v), total in contexts.items():
        followers = {w: c for (a, b, w), c in tri.items() if (a, b) == (u, v)}
        if min(followers.values()) > 5:
            p = model.probs(u, v)
            for w, c in followers.items():
                assert p[w] == pytest.approx(c / total)
            checked += 1
    assert checked >= 3


def test_tuning_one_model_alone_fits_its_trigram_on_pythons_library_for_auto(tiny_dir, data_home, tmp_path,
                                                                             monkeypatch):
    import spec_cli.draft2.fit as fit
    from spec_cli.core.settings import ModelRef
    from spec_cli.draft2 import trigrams
    from spec_cli.models.loading import load_tokenizer

    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    picked = fit.standard_library()[:3]  # (three of its files: quick)
    monkeypatch.setattr(fit, "standard_library", lambda: picked)
    oracle = str(tiny_dir / "gpt2-oracle")
    run = spec("tune", "--oracle", oracle, "--only", "draft2", env=data_home)
    assert run.returncode == 0, run.stderr
    shown = json.loads(spec("tune", "--oracle", oracle, "--show", "--json", env=data_home).stdout)
    record = shown["machines"][shown["this_machine"]]["draft2"]
    path = trigrams.corpus_path(load_tokenizer(ModelRef(oracle)))
    assert record["path"] == str(path) and record["complete"]
    assert record["corpus"] == "Python's standard library"
    assert KatzTrigram.load(record["path"]).unigram_counts.sum() == record["tokens"] > 1000
    assert "Python's standard library" in spec("tune", "--oracle", oracle, "--show", env=data_home).stdout


def test_an_interrupted_draft2_fit_keeps_the_partial_model(tiny_profile, monkeypatch):
    from transformers import GenerationMixin

    from spec_cli.draft2.fit import fit_from_draft
    from spec_cli.models import profiles

    real = GenerationMixin.generate
    calls = {"n": 0}

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    model, fitted = fit_from_draft(profiles.load(str(tiny_profile[0])), 10_000, 1.5, 0, "cpu", batch=4, length=16)
    assert fitted == 4 * 17 and int(model.unigram_counts.sum()) == fitted


def test_tune_mistakes(tiny_profile, data_home, tmp_path):
    path, prompts = tiny_profile
    assert_clean_error(spec("tune", "-p", str(path), "--only", "shapes", env=data_home), "unknown step 'shapes'")
    assert_clean_error(spec("tune", "-p", str(path), "--modes", "beam", env=data_home), "unknown mode 'beam'")
    assert_clean_error(spec("tune", "-p", str(path), "--prompts", "nope.txt", env=data_home), "prompt file not found")
    empty = spec("tune", "-p", str(path), "--show", env=data_home)
    assert empty.returncode == 0 and "nothing tuned" in empty.stdout
    assert f"run `spec tune --profile {path}`" in empty.stdout  # the profile as it was given: a path
    record = tmp_path / "data" / "spec" / "tuned" / "tinytune.json"
    record.parent.mkdir(parents=True)
    record.write_text("{broken")
    broken = spec("tune", "-p", str(path), "--show", env=data_home)
    assert_clean_error(broken, "unreadable tuning record")
    hint = broken.stderr.split("run `")[1].split("`")[0]
    assert hint == f"spec tune --profile {path} --reset"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("for i in range(10):\n    print(i)\n" * 20)
    fixed = spec(*hint.split()[1:], "--only", "draft2", "--corpus", str(corpus), env=data_home)  # as printed
    assert fixed.returncode == 0 and json.loads(record.read_text())["machines"], fixed.stderr


def test_tune_never_saves_a_shape_slower_than_baseline(tiny_profile, monkeypatch, tmp_path):
    """Where the oracle alone is fastest (as on the issue's machine: speculative 0.90x), baseline is saved,
    with its measured ratio; where a shape wins, the record states its ratio to baseline."""
    from types import SimpleNamespace

    from spec_cli import tune
    from spec_cli.models import profiles, tuned
    from spec_cli.models.loading import load_tokenizer

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    profile = profiles.load(str(tiny_profile[0]))
    engine = SimpleNamespace(has_draft=True, vocab_size=300, tokenizer=load_tokenizer(profile.oracle), translator=None,
                             runnable=lambda settings: settings)
    options = tune.Options(max_new_tokens=8)
    for fastest, rates in (("baseline", {"baseline": 93.1, "speculative": 83.5, "staged": 80.0}),
                           ("staged", {"baseline": 50.0, "speculative": 60.0, "staged": 75.0})):
        measured = []

        def measure(engine, prompts, plan):
            measured.append(plan.settings.method)
            return tune.Score(round(rates[plan.settings.method] * 100) * len(prompts), 100.0 * len(prompts), 1)

        monkeypatch.setattr(tune, "measure", measure)
        result = tune.tune_shape(engine, profile, "test-machine", [[1, 2], [3, 4]], "greedy", options)
        saved = tuned.entry(profile, "test-machine")["greedy"]
        assert saved == result and "baseline" in measured
        assert saved["settings"]["method"] == fastest
        assert saved["tokens_per_second"] == max(rates.values())
        assert saved["speedup"] == round(max(rates.values()) / rates["baseline"], 4) >= 1
        assert saved["baseline_won"] == (fastest == "baseline")
        applied = tuned.apply(profile, "test-machine")
        assert applied.decoding.method == fastest
