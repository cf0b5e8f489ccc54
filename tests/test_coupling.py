"""Coupled sampling: each method's text is the oracle alone's for the seed, and that text is a draw from p."""

import dataclasses
from collections import Counter

import pytest
import torch
from conftest import load_pair
from helpers import exact_distribution, prompts, tiny_vocab_model
from stats import chi_square_p_value

from spec_cli.core.events import REJECTED, Token
from spec_cli.core.families import Skip
from spec_cli.core.settings import Decoding
from spec_cli.decoding import coupling
from spec_cli.decoding.chain import Models
from spec_cli.decoding.coupling import KEEP, Noise, gumbel, gumbel_of
from spec_cli.decoding.methods import decode
from spec_cli.decoding.sampling import Sampler, make_generator
from spec_cli.draft2.ngram import PromptLookup
from spec_cli.exec import Runner

SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.2, top_p=0.8),
            dict(temperature=1.0, top_k=50, top_p=0.95)]


def tokens(models, prompt, reuse=False, **settings):
    events = list(decode(models, prompt, Decoding(**settings), reuse=reuse))
    return [e.token for e in events if isinstance(e, Token) and e.output], events


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tiny_dir):
    oracle, draft = load_pair(tiny_dir, request.param)
    return Models(Runner(oracle), Runner(draft), self_skip=Skip.of([1], [0, 2]))


@pytest.mark.parametrize("settings", SETTINGS)
def test_every_method_samples_the_oracle_alones_text(pair, settings):
    rejected, texts = 0, set()
    for seed, prompt in enumerate(prompts(4, seed=7)):
        expected, _ = tokens(pair, prompt, method="baseline", max_new_tokens=40, seed=seed, **settings)
        texts.add(tuple(expected))
        for method, extra in (("speculative", dict(draft_tokens=1)), ("speculative", dict(draft_tokens=5)),
                              ("staged", {}), ("staged", dict(tree_adaptive=False, tree_budget=12)),
                              ("staged+lookup", dict(tree_adaptive=False)), ("self", {})):
            models = dataclasses.replace(pair, draft2=PromptLookup()) if method.endswith("+lookup") else pair
            got, events = tokens(models, prompt, method=method.split("+")[0], max_new_tokens=40, seed=seed,
                                 **settings, **extra)
            assert got == expected, (method, extra, seed)
            rejected += sum(isinstance(e, Token) and e.kind == REJECTED for e in events)
    assert rejected > 10  # rollbacks were exercised
    assert len(texts) == 4


def test_the_seed_chooses_the_text_and_rejection_sampling_draws_its_own(pair):
    prompt = prompts(1, seed=3)[0]
    by_seed = {seed: tokens(pair, prompt, method="staged", max_new_tokens=30, seed=seed, temperature=1.0)[0]
               for seed in range(4)}
    assert len({tuple(t) for t in by_seed.values()}) == 4
    assert tokens(pair, prompt, method="speculative", max_new_tokens=30, seed=2, temperature=1.0)[0] == by_seed[2]
    greedy, _ = tokens(pair, prompt, method="baseline", max_new_tokens=30)
    assert greedy not in by_seed.values()
    drawn = [tokens(pair, prompt, method=m, max_new_tokens=30, seed=2, temperature=1.0, sampling="rejection")[0]
             for m in ("baseline", "speculative")]
    assert drawn[0] != by_seed[2] or drawn[1] != by_seed[2]


def test_a_draft_that_is_the_oracle_guesses_every_token(tiny_dir):
    """The draft scores with the oracle's noise at the same positions: with the oracle as its own draft every
    guess is accepted (a draft reading another position's noise would lose most of them)."""
    oracle, _ = load_pair(tiny_dir, "llama")
    models = Models(Runner(oracle), Runner(oracle))
    for seed, prompt in enumerate(prompts(3, seed=5)):
        for method, extra in (("speculative", dict(draft_tokens=4)), ("staged", dict(tree_adaptive=False))):
            _, events = tokens(models, prompt, method=method, max_new_tokens=30, seed=seed, temperature=1.0,
                               top_k=30, **extra)
            assert not any(isinstance(e, Token) and e.kind == REJECTED for e in events), (method, seed)


def test_a_chat_turn_reusing_the_cache_samples_what_a_fresh_run_does(pair):
    first = prompts(1, seed=9)[0]
    reply, _ = tokens(pair, first, reuse=True, method="staged", max_new_tokens=12, seed=4, temperature=1.0)
    second = first + reply + [5, 6, 7]
    reused, _ = tokens(pair, second, reuse=True, method="staged", max_new_tokens=12, seed=4, temperature=1.0)
    fresh, _ = tokens(Models(Runner(pair.oracle.model), Runner(pair.draft.model)), second, method="baseline",
                      max_new_tokens=12, seed=4, temperature=1.0)
    assert reused == fresh


def test_noise_for_a_position_does_not_depend_on_who_asks_or_when():
    sampler, vocab, base = Sampler(1.0, coupled=True), 40, 21
    logits = torch.zeros(1, vocab)

    def noise_at(asks):
        noise = Noise(sampler, make_generator(3), vocab, "cpu", base)
        seen = {}
        for lo, hi in asks:  # rows for positions lo-1..hi-2 score positions lo..hi-1
            positions = torch.arange(lo - 1, hi - 1)
            scores = noise.scores(logits.expand(len(positions), vocab), positions)
            for p, row in zip(range(lo, hi), scores):
                seen.setdefault(p, row)
                assert torch.equal(seen[p], row)
        return seen

    one_by_one = noise_at([(p, p + 1) for p in range(base, base + 48)])
    in_pieces = noise_at([(1, base + 1), (base, base + 7), (base + 3, base + 40), (base + 40, base + 48)])
    assert all(torch.equal(one_by_one[p], in_pieces[p]) for p in one_by_one)
    assert not torch.equal(one_by_one[base], one_by_one[base + 1])


@pytest.mark.parametrize("way", ["torch", "kernels"])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.6, top_k=3, top_p=0.9),
                                      dict(temperature=0.8, top_k=4), dict(temperature=0.9, top_p=0.7)])
def test_coupled_draws_are_exact_and_independent_across_positions(settings, way):
    """The argmax of log p + G at each position is a draw from p, independent of the position before: by torch's
    operations and by spec's CPU kernels (top-k in one pass a row, top-p alone among the most probable words,
    temperature alone over the words that can win; the noise by the C library's log)."""
    from spec_cli.exec import native

    sampler = Sampler(**settings, coupled=True)
    logits = torch.tensor([1.5, 0.2, -0.4, 0.9, 0.0, -2.0])
    n = 20000
    noise = Noise(sampler, make_generator(11), len(logits), "cpu", 0)
    noise.kernels = native.int4() if way == "kernels" else None
    if way == "kernels" and noise.kernels is None:
        pytest.skip(f"spec's CPU kernels: {native.status()}")
    positions = torch.arange(-1, n - 1)
    drawn = noise.scores(logits.expand(n, -1), positions).argmax(-1).tolist()
    p = sampler.probs(logits).tolist()
    expected = {(i,): p[i] for i in range(len(p))}
    assert chi_square_p_value(Counter((x,) for x in drawn), expected, n) > 1e-4
    pairs = Counter(zip(drawn[0::2], drawn[1::2]))
    expected_pairs = {(i, j): p[i] * p[j] for i in range(len(p)) for j in range(len(p))}
    assert chi_square_p_value(pairs, expected_pairs, n // 2) > 1e-4


def test_whole_coupled_completions_follow_the_oracle_distribution():
    """Seeds 0..N-1 through speculative decoding: the completions are distributed as the oracle's."""
    oracle, draft = tiny_vocab_model(11, 2), tiny_vocab_model(12, 1)
    models = Models(Runner(oracle), Runner(draft))
    prompt, length, trials = [1, 3], 3, 3000
    settings = dict(temperature=1.0, top_k=4)
    expected = exact_distribution(oracle, prompt, length, Sampler(**settings))
    counts = Counter(tuple(tokens(models, prompt, method="speculative", draft_tokens=2, max_new_tokens=length,
                                  seed=seed, **settings)[0]) for seed in range(trials))
    assert chi_square_p_value(counts, expected, trials) > 1e-4


def test_a_position_s_noise_is_the_same_however_long_after_and_kept_within_bounds():
    sampler, vocab = Sampler(1.0, coupled=True), 8
    logits = torch.zeros(1, vocab)
    ask = lambda noise, lo, hi: noise.scores(logits.expand(hi - lo, vocab), torch.arange(lo - 1, hi - 1))
    whole = ask(Noise(sampler, make_generator(5), vocab, "cpu"), 0, 3 * KEEP)
    noise = Noise(sampler, make_generator(5), vocab, "cpu")
    for lo in range(0, 3 * KEEP - 8, 5):  # the oracle's steps, and a draft lagging far behind
        assert torch.equal(ask(noise, lo, lo + 8), whole[lo : lo + 8])
        if lo >= 100:
            assert torch.equal(ask(noise, lo - 100, lo - 98), whole[lo - 100 : lo - 98])
    assert len(noise.kept) <= KEEP
    assert torch.equal(ask(noise, 10, 12), whole[10:12])
    assert not torch.equal(ask(Noise(sampler, make_generator(6), vocab, "cpu"), 0, 8), whole[:8])


def test_noise_for_a_word_is_the_same_bits_computed_with_any_others():
    """Top-k asks for a few words' noise, temperature alone for every word's: a word's noise must not depend on
    how many are computed with it, or where it sits among them (a kernel's vector body against its scalar tail)."""
    vocab, position = 50_000, 77
    counters = position * vocab + torch.arange(vocab)
    whole = gumbel(123_456_789, counters)
    generator = torch.Generator().manual_seed(0)
    for n in [*range(1, 40), 127, 4097, 33_333]:
        some = torch.randperm(vocab, generator=generator)[:n]
        assert torch.equal(gumbel(123_456_789, counters[some]), whole[some]), n
    assert abs(float(whole.mean()) - 0.5772) < 0.02 and abs(float(whole.std()) - 1.2825) < 0.02  # Gumbel(0, 1)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, top_k=5),
                                      dict(temperature=0.9, top_p=0.8), dict(temperature=1.0, top_k=9, top_p=0.9)])
def test_scores_are_a_row_s_own_whatever_rows_share_the_call(settings):
    """The same row's scores alone and among others, whether the noise is taken for the kept words (top-k,
    top-p, a draft's part of the vocabulary) or for every word; and -inf wherever p is 0."""
    sampler, vocab = Sampler(**settings, coupled=True), 300
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(1)) * 3
    logits[3, 40:] = float("-inf")  # (a draft drafting from part of the vocabulary)
    positions = torch.tensor([30, 30, 31, 32, 32, 33, 40, 41, 41, 41, 50, 60])
    noise = Noise(sampler, make_generator(2), vocab, "cpu", base=20)
    together = noise.scores(logits, positions)
    for row in range(len(logits)):
        alone = Noise(sampler, make_generator(2), vocab, "cpu", base=20).scores(logits[row:row + 1], positions[row:row + 1])
        assert torch.equal(alone[0], together[row]), row
    assert torch.equal(together == float("-inf"), sampler.warped(logits) == float("-inf"))
    on_a_gpu = sampler.warped(logits) + noise.every_word(positions + 1)  # (what a GPU computes, nothing read back)
    assert torch.equal(on_a_gpu, together)


def test_no_word_s_noise_is_infinite_however_its_hash_falls():
    """The uniforms at both ends of the hash's range stay inside (0, 1): an infinite noise would win a draw whatever
    p says (the top 24 bits made the largest round to 1.0)."""
    largest = coupling._shifted(torch.tensor([-1]), 64 - coupling.BITS)  # (a hash of all ones)
    ends = torch.cat([torch.tensor([0, 1, 2, 1 << 22]), largest - 1, largest])
    noise = gumbel_of(ends)
    assert torch.isfinite(noise).all() and (noise[1:] > noise[:-1]).all()
    assert 16 < float(noise[-1]) < 17 and -3 < float(noise[0]) < -2.5
