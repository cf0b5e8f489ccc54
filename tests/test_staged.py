"""Staged speculative decoding: tree batches and the draft2 stage stay exact."""

import random

import numpy as np
import pytest

from conftest import load_pair
from spec_cli.decoding import Models
from spec_cli.methods import decode
from spec_cli.events import ACCEPTED, REJECTED, Finished, Stats, Token
from spec_cli.ngram import KatzTrigram, PromptLookup
from spec_cli.profiles import Decoding
from spec_cli.runner import Runner
from spec_cli.sampling import Sampler
from stats import chi_square_p_value
from test_decoding import SAMPLING, exact_distribution, prompts, run, sampled, tiny_vocab_pair  # noqa: F401

SHAPES = [  # budget, depth, branching, width
    (1, 1, 1, 1), (4, 4, 1, 1), (8, 3, 3, 2), (16, 5, 2, 4), (24, 6, 3, 4), (40, 8, 4, 8),
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tiny_dir):
    oracle, draft = load_pair(tiny_dir, request.param)
    return Models(Runner(oracle), Runner(draft))


class Noisy:
    """A deliberately poor draft2: right some of the time, wrong otherwise."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, context, n):
        return [self.rng.randrange(300) for _ in range(n)]


@pytest.mark.parametrize("draft2", [None, "prompt-lookup", "noisy"])
def test_greedy_staged_is_token_identical_to_baseline(pair, draft2):
    pair.draft2 = {None: None, "prompt-lookup": PromptLookup(), "noisy": Noisy(0)}[draft2]
    stats = Stats()
    try:
        for prompt in prompts(5, seed=1):
            expected, _ = run(pair, prompt, method="baseline", max_new_tokens=40)
            for budget, depth, branching, width in SHAPES:
                got, events = run(pair, prompt, method="staged", max_new_tokens=40, tree_budget=budget,
                                  tree_depth=depth, tree_branching=branching, tree_width=width)
                assert got == expected, (prompt, budget, depth, branching, width)
                for e in events:
                    stats.add(e)
    finally:
        pair.draft2 = None
    assert stats.accepted["oracle"] > 300
    if draft2 is not None:
        assert stats.proposed["draft"] > 0


def test_trees_beat_chains_in_tokens_per_oracle_forward(pair):
    chain, tree = Stats(), Stats()
    for prompt in prompts(4, seed=2):
        for e in run(pair, prompt, method="staged", max_new_tokens=40, tree_budget=4, tree_depth=4,
                     tree_branching=1, tree_width=1)[1]:
            chain.add(e)
        for e in run(pair, prompt, method="staged", max_new_tokens=40, tree_budget=24, tree_depth=4,
                     tree_branching=3, tree_width=6)[1]:
            tree.add(e)
    assert tree.tokens_per_oracle_forward > chain.tokens_per_oracle_forward


def test_staged_events_and_stop_reasons(pair):
    prompt = prompts(1, seed=4)[0]
    _, events = run(pair, prompt, method="staged", max_new_tokens=25)
    outputs = [e for e in events if isinstance(e, Token) and e.output]
    assert len(outputs) == 25 and events[-1] == Finished("length")
    assert any(isinstance(e, Token) and e.kind == ACCEPTED for e in events)
    assert any(isinstance(e, Token) and e.kind == REJECTED for e in events)


@pytest.mark.parametrize("settings", SAMPLING)
def test_staged_sampling_follows_the_oracle_distribution(tiny_vocab_pair, settings):  # noqa: F811
    oracle, models = tiny_vocab_pair
    prompt, length, trials = [1, 3], 3, 3000
    expected = exact_distribution(oracle, prompt, length, Sampler(**settings))
    counts = sampled(models, prompt, length, trials, method="staged", tree_budget=6, tree_depth=2,
                     tree_branching=2, tree_width=2, **settings)
    assert chi_square_p_value(counts, expected, trials) > 1e-4


def test_staged_sampling_with_a_drafter_stays_exact(tiny_vocab_pair):  # noqa: F811
    oracle, models = tiny_vocab_pair
    models.draft2 = PromptLookup(max_ngram=1)
    try:
        prompt, length, trials = [1, 3, 1], 3, 3000
        expected = exact_distribution(oracle, prompt, length, Sampler(temperature=1.0))
        counts = sampled(models, prompt, length, trials, method="staged", tree_budget=5, tree_depth=3,
                         tree_branching=2, tree_width=1, draft2_tokens=2, temperature=1.0)
        assert chi_square_p_value(counts, expected, trials) > 1e-4
    finally:
        models.draft2 = None


# --- draft2 models ------------------------------------------------------------------------------------


def test_katz_trigram_matches_hand_computed_values():
    # counts chosen so that Good-Turing discounts are usable for the bigram level (k = 1)
    streams = [[0, 1, 2], [0, 1, 3], [0, 1, 2], [4, 1, 2], [3, 3]]
    m = KatzTrigram.fit(streams, vocab_size=5, k=1)
    # bigrams: 01 x3, 12 x3, 13 x1, 41 x1, 33 x1 -> n1 = 3, n2 = 0 -> Good-Turing unusable -> d = 1
    np.testing.assert_allclose(m.d2, [1, 1])
    # unigram: add-one over counts [3, 4, 3, 3, 1] (14 tokens, V = 5)
    np.testing.assert_allclose(m.unigram, np.array([4, 5, 4, 4, 2]) / 19)
    # P(w | 1): seen 2 (x3), 3 (x1) -> 3/4, 1/4, nothing left for unseen words
    np.testing.assert_allclose(m.bigram_probs(1), [0, 0, 0.75, 0.25, 0])
    # P(w | 0 1): trigrams 012 x2, 013 x1 -> 2/3, 1/3
    np.testing.assert_allclose(m.probs(0, 1), [0, 0, 2 / 3, 1 / 3, 0])
    # unseen trigram context (2, 2) backs off to P(w | 2), an unseen bigram context -> unigram
    np.testing.assert_allclose(m.probs(2, 2), m.unigram)


def test_katz_discounts_and_backoff_weights():
    V = 20
    rng = np.random.default_rng(0)
    zipf = 1 / np.arange(1, V + 1)
    stream = rng.choice(V, size=5000, p=zipf / zipf.sum()).tolist()
    m = KatzTrigram.fit([stream], vocab_size=V, k=5)
    # Good-Turing by hand from the count-of-counts of the trigram counts (all usable for this corpus)
    n = np.bincount(m.tri_counts, minlength=8).astype(float)
    common = 6 * n[6] / n[1]
    for r in range(1, 6):
        assert m.d3[r] == pytest.approx(((r + 1) * n[r + 1] / (r * n[r]) - common) / (1 - common))
        assert m.d3[r] < 1
    for u in range(V):
        for v in range(V):
            p = m.probs(u, v)
            assert p.sum() == pytest.approx(1.0) and (p >= 0).all()
            # a seen trigram's probability is its discounted relative frequency
            keys = (u * V + v) * V + np.arange(V)
            idx = np.searchsorted(m.tri_keys, keys)
            seen = (idx < len(m.tri_keys)) & (m.tri_keys[np.minimum(idx, len(m.tri_keys) - 1)] == keys)
            if seen.any():
                counts = m.tri_counts[idx[seen]]
                d = np.where(counts <= 5, m.d3[np.minimum(counts, 5)], 1.0)
                if seen.all():  # nothing to back off to: the discounted estimates are renormalised
                    np.testing.assert_allclose(p, d * counts / (d * counts).sum())
                    continue
                np.testing.assert_allclose(p[seen], d * counts / counts.sum())
                # the left-over mass goes to unseen words in proportion to the bigram model
                lower = m.bigram_probs(v)
                alpha = (1 - p[seen].sum()) / (1 - lower[seen].sum())
                np.testing.assert_allclose(p[~seen], alpha * lower[~seen])


def test_trigram_file_round_trip_and_proposals(tmp_path):
    m = KatzTrigram.fit([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]], vocab_size=6)
    m.save(tmp_path / "tri.npz")
    loaded = KatzTrigram.load(tmp_path / "tri.npz")
    np.testing.assert_allclose(loaded.probs(1, 2), m.probs(1, 2))
    assert loaded.propose([1, 2], 4) == [3, 4, 1, 2]


def test_prompt_lookup_continues_the_latest_match():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([5, 1, 2, 9, 7, 1, 2, 8, 6, 1, 2], 2) == [8, 6]
    assert lookup.propose([1, 2, 3], 2) == []


def test_distribution_test_catches_a_partial_sibling_group(tiny_vocab_pair, monkeypatch):  # noqa: F811
    """Keeping only the best-scoring drawn children (not the whole drawn group) biases Sequoia's rule."""
    from spec_cli import tree as tree_module

    def best_by_score(self, budget):
        order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
        return sorted(order[:budget])

    monkeypatch.setattr(tree_module.Tree, "best", best_by_score)
    oracle, models = tiny_vocab_pair
    prompt, length, trials = [1, 3], 2, 3000
    expected = exact_distribution(oracle, prompt, length, Sampler(temperature=1.0))
    counts = sampled(models, prompt, length, trials, method="staged", tree_budget=1, tree_depth=1,
                     tree_branching=4, tree_width=1, temperature=1.0)
    assert chi_square_p_value(counts, expected, trials) < 1e-6
