"""On-device acceptance, exactly: the output law of Leviathan's rule as `spec_cli.decoding.accept` computes it, summed
in closed form over every proposal and every accept/reject outcome, equals the oracle's distribution to
1e-9; and the settling step turns uniforms into the right accepted prefix."""

from __future__ import annotations

import itertools

import pytest
import torch

from spec_cli.decoding import accept
from spec_cli.decoding.sampling import Draws, Sampler, verify_candidates

V = 6


def pairs(seed: int, k: int):
    """k + 1 oracle rows p and k draft rows q, spread or peaked, with zeros (top-k/top-p cut) in both."""
    g = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(k + 1, V, generator=g, dtype=torch.float64) * (0.5 + 3 * (seed % 2))
    logits_q = logits_p[:k] + torch.randn(k, V, generator=g, dtype=torch.float64) * (1 + seed % 3)
    sampler = Sampler(temperature=1.0, top_k=4 if seed % 3 == 0 else 0, top_p=0.8 if seed % 3 == 1 else 1.0)
    return sampler.probs(logits_p), Sampler(temperature=1.0).probs(logits_q) if seed % 4 else sampler.probs(logits_q)


def output_law(ps, qs, k):
    """The law of the tokens a step emits: first token, and the second given the first was an accepted
    proposal, summed over every proposal chain and accept/reject outcome with `accept`'s ratios/residuals."""
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, V, dtype=torch.float64)  # [accepted x0, y1]
    for chain in itertools.product(range(V), repeat=k):
        proposals = torch.tensor(chain)
        weight = torch.prod(qs[torch.arange(k), proposals])
        if weight == 0:
            continue
        r = accept.ratios(ps, qs, proposals)
        rest = accept.residuals(ps, qs)
        first += weight * (1 - r[0]) * rest[0]
        first[chain[0]] += weight * r[0]
        if k == 1:
            second[chain[0]] += weight * r[0] * rest[1]
        else:
            second[chain[0]] += weight * r[0] * (1 - r[1]) * rest[1]
            second[chain[0], chain[1]] += weight * r[0] * r[1]
    return first, second


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 2])
def test_leviathan_on_the_device_gives_the_oracle_distribution_exactly(seed, k):
    ps, qs = pairs(seed, k)
    first, second = output_law(ps, qs, k)
    torch.testing.assert_close(first, ps[0], atol=1e-9, rtol=0)
    accepted = second.sum(-1, keepdim=True)
    where = accepted[:, 0] > 1e-12
    law = second[where] / accepted[where]  # given the first was accepted, the next follows p_1
    torch.testing.assert_close(law, ps[1].expand_as(law), atol=1e-9, rtol=0)


def test_a_residual_of_p_minus_09q_is_off_by_more_than_1e9():
    """The power of the test above: the issue's mutant moves the law by far more than its tolerance."""
    ps, qs = pairs(2, 1)  # spread: no top-k, no top-p
    rest = (ps[0] - 0.9 * qs[0]).clamp(min=0)
    rest = rest / rest.sum()
    law = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        r = accept.ratios(ps, qs, torch.tensor([x]))[0]
        law += qs[0, x] * (1 - r) * rest
        law[x] += qs[0, x] * r
    assert (law - ps[0]).abs().max() > 1e-4


@pytest.mark.parametrize("k", [1, 3])
def test_settling_accepts_the_prefix_of_uniforms_under_their_ratios(k):
    ps, qs = pairs(5, k)
    proposals = qs.argmax(-1)
    r = accept.ratios(ps, qs, proposals)
    for bits in itertools.product([True, False], repeat=k):
        uniforms = torch.where(torch.tensor(bits), r * 0.5, r + (1 - r) * 0.5)
        n, final = accept.sampled_chain(ps, qs, proposals, Fed(uniforms, torch.Generator())).tolist()
        expected = next((i for i, b in enumerate(bits) if not b), k)
        assert n == expected
        assert accept.residuals(ps, qs)[n][final] > 0  # drawn from the residual of the first rejection


def test_greedy_chain_accepts_while_proposals_are_the_argmax():
    logits = torch.tensor([[0.0, 5, 1], [3, 0, 1], [0, 1, 4], [2, 1, 0]])
    assert accept.greedy_chain(logits, torch.tensor([1, 0, 2])).tolist() == [3, 0]
    assert accept.greedy_chain(logits, torch.tensor([1, 2, 2])).tolist() == [1, 0]
    assert accept.greedy_chain(logits, torch.tensor([0, 0, 2])).tolist() == [0, 1]


class Fed(Draws):
    """Draws that hand out the given uniforms (one by one on the host, all at once on the device) and keep
    the distributions they are asked to sample from (sampled with `generator`, if given)."""

    def __init__(self, uniforms: torch.Tensor, generator: torch.Generator | None = None):
        super().__init__(generator)
        self.all, self.each, self.drawn = uniforms, iter(uniforms.reshape(-1).tolist()), []

    def uniform(self):
        return next(self.each)

    def uniforms(self, shape, device):
        assert self.all.shape == torch.Size([shape] if isinstance(shape, int) else shape)
        return self.all

    def sample_rows(self, p):
        self.drawn.append(p[0])
        return super().sample_rows(p) if self.generator is not None else torch.zeros(1, dtype=torch.long)


def _reference_walk(ps, qs, tests, tokens, rule, uniforms):
    """The tree walk with the host's rule (`verify_candidates`, exactly tested on its own), each test using
    uniforms[level][place]: (the accepted place per level, the distribution of the final token)."""
    node, places = 0, []
    for level in range(len(uniforms)):
        index, rest = verify_candidates(ps[node], [tokens[node][j] for j in range(len(tests[node]))], rule,
                                        Fed(uniforms[level]), qs[node])
        if index is None:
            return places + [-1] * (len(uniforms) - level), rest
        places.append(index)
        node = tests[node][index]
    return places, ps[node]


@pytest.mark.parametrize("rule", ["deterministic", "iid", "without_replacement"])
def test_the_device_walk_decides_as_the_host_rule(rule):
    """Same uniforms, same decisions and the same final distribution as `verify_candidates`, level by level,
    on a two-level tree (so q and p come from the right node after a child is accepted)."""
    g = torch.Generator().manual_seed(3)
    rows = 5  # root, two children, a grandchild under each
    ps = torch.softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 2, -1)
    qs = torch.softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 2, -1)
    repeat = rule == "iid"
    tests = {0: [1, 1, 2] if repeat else [1, 2], 1: [3], 2: [4], 3: [], 4: []}
    low = (ps / qs).argsort(-1).tolist()  # candidates the rules often reject: p(x) / q(x) below 1
    tokens = {0: [low[0][2], low[0][2], low[0][3]] if repeat else [low[0][2], low[0][3]], 1: [low[1][1]],
              2: [low[2][1]], 3: [], 4: []}
    width = 3
    kids = torch.tensor([tests[r] + [-1] * (width - len(tests[r])) for r in range(rows)])
    toks = torch.tensor([tokens[r] + [0] * (width - len(tokens[r])) for r in range(rows)])
    widths = [len(tests[0]), 1, 0]
    seen = 0
    for trial in range(300):
        uniforms = torch.rand(len(widths), width, generator=g, dtype=torch.float64) ** 2
        draws = Fed(uniforms)
        walked = accept.tree_walk(ps, qs, kids, toks, rule, widths, draws).tolist()
        places, final = _reference_walk(ps, qs, tests, tokens, rule, uniforms)
        assert walked[:-1] == places, trial
        torch.testing.assert_close(draws.drawn[0], final, atol=1e-12, rtol=0)
        seen += places[0] >= 0 and places[1] == -1
    assert seen > 10, rule  # paths that accept at the root and reject below it were met
