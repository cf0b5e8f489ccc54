"""The acceptance rules, alone: whatever the candidates, the accepted-or-resampled token is a sample of p."""

from collections import Counter

import pytest
import torch
from stats import chi_square_p_value

from spec_cli.decoding import sampling
from spec_cli.decoding.sampling import Draws, Sampler, argmax, verify_candidates

V = 6
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])


def outcome_counts(rule, n_candidates, trials, seed, verify=verify_candidates):
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(trials):
        if rule == "iid":
            candidates = torch.multinomial(Q, n_candidates, replacement=True, generator=g).tolist()
        elif rule == "without_replacement":
            candidates = torch.multinomial(Q, n_candidates, replacement=False, generator=g).tolist()
        else:  # deterministic: the draft's top candidates
            candidates = torch.topk(Q, n_candidates).indices.tolist()
        index, residual = verify(P, candidates, rule, Draws(g), Q)
        token = candidates[index] if index is not None else int(torch.multinomial(residual, 1, generator=g))
        counts[token] += 1
    return counts


@pytest.mark.parametrize("rule", ["iid", "without_replacement", "deterministic"])
@pytest.mark.parametrize("n_candidates", [1, 2, 3])
def test_rule_output_is_distributed_as_p(rule, n_candidates):
    trials = 6000
    counts = outcome_counts(rule, n_candidates, trials, seed=n_candidates)
    expected = {i: float(P[i]) for i in range(V)}
    assert chi_square_p_value(counts, expected, trials) > 1e-4


def _forget_q(p, candidates, rule, draws, q=None):
    """A classic bug: on rejection, resample from p instead of the residual norm(max(0, p - q))."""
    p = p.clone()
    for index, x in enumerate(candidates):
        if draws.uniform() < min(1.0, float(p[x] / q[x])):
            return index, p
    return None, p


def _wrong_sequoia(p, candidates, rule, draws, q=None):
    """Without-replacement candidates verified with SpecInfer's rule (q never renormalised): biased."""
    return verify_candidates(p, candidates, "iid", draws, q)


@pytest.mark.parametrize("bug,rule", [(_forget_q, "iid"), (_wrong_sequoia, "without_replacement")])
def test_the_statistical_test_catches_a_wrong_residual(bug, rule):
    trials = 6000
    counts = outcome_counts(rule, 3, trials, seed=7, verify=bug)
    expected = {i: float(P[i]) for i in range(V)}
    assert chi_square_p_value(counts, expected, trials) < 1e-6


def test_sampler_top_k_top_p_and_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = Sampler(temperature=1.0, top_k=2).probs(logits)
    assert (p[2:] == 0).all() and torch.isclose(p[:2].sum(), torch.tensor(1.0))
    assert torch.isclose(p[0] / p[1], torch.tensor(2.718281828))
    full = torch.softmax(logits, -1)  # [0.61, 0.22, 0.14, 0.08, 0.03]
    nucleus = Sampler(temperature=1.0, top_p=0.7).probs(logits)
    assert (nucleus[:2] > 0).all() and (nucleus[2:] == 0).all()  # 0.61 < 0.7, so the second token stays
    torch.testing.assert_close(nucleus[:2], full[:2] / full[:2].sum())
    hot = Sampler(temperature=2.0).probs(logits)
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))
    batch = Sampler(temperature=1.0, top_k=1).probs(torch.stack([logits, -logits]))
    assert batch[0, 0] == 1 and batch[1, 4] == 1


def _nucleus_by_sorting(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's kept words the plain way: the whole row sorted, the smallest prefix reaching top_p."""
    probs, order = torch.sort(logits.double().softmax(-1), descending=True)
    count = int(((probs.cumsum(-1) - probs) < top_p).sum())
    kept = torch.zeros_like(logits, dtype=torch.bool)
    kept[order[:count]] = True
    return kept


@pytest.mark.parametrize("scale", [6.0, 0.4, 0.02])  # peaked (a few words), flat (thousands), flatter (most)
def test_top_p_keeps_the_smallest_most_probable_set_and_is_each_row_s_own(scale):
    """The nucleus found among the top words where they reach top_p, wider where they do not (scale 0.4: past
    the first 1024 words; 0.02: past 16384 as well), is the one sorting the whole row finds, row by row."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40_000, generator=generator) * scale
    for top_p in (0.5, 0.9):
        sampler = Sampler(temperature=1.0, top_p=top_p)
        warped = sampler.warped(logits)
        for row in range(len(logits)):
            kept = warped[row] > float("-inf")
            reference = _nucleus_by_sorting(logits[row], top_p)
            assert int((kept != reference).sum()) <= 2, (row, top_p)  # (a float32 sum's rounding at the cut)
            assert torch.equal(sampler.warped(logits[row:row + 1])[0], warped[row])
        if scale == 0.02:
            assert (warped > float("-inf")).sum(-1).min() > 16_384
        floors = sampling._nucleus_floor(logits, top_p)
        sorted_whole = sampling._floor_among(logits, logits.softmax(-1), top_p, logits.shape[-1])[0]  # (a GPU's way)
        assert torch.equal(floors, sorted_whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torchs_the_first_of_equal_maxima(dtype):
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        x = (torch.randn(7, 300, generator=generator) * 2).round().to(dtype)  # many rows with tied maxima
        x[1, 5] = x[1, 250] = x[1].max() + 1  # a tie on the maximum, first at 5
        if trial % 5 == 0:
            x[2, 100] = x[2, 200] = float("nan")  # NaN counts as the largest, the first one wins
            x[3] = float("-inf")
        assert torch.equal(argmax(x), x.argmax(-1))
        assert torch.equal(argmax(x[0], keepdim=True), x[0].argmax(-1, keepdim=True))
        assert int(argmax(x)[1]) == 5
