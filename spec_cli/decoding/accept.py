"""Acceptance on the device: a verified chain settled without reading anything back, then one packed read.

Leviathan et al.'s rule, vectorised: proposal i (drawn from q_i) is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); the first rejection at n is replaced by a draw from norm(max(0, p_n - q_n)), and
when all k are accepted the bonus token is drawn from p_k. Greedy is the same with argmaxes: proposals are
accepted while they equal the oracle's argmax. Uniforms are drawn for all k at once, from the completion's
draws, so nothing here waits for the device.
"""

from __future__ import annotations

import torch

from spec_cli.decoding.sampling import Draws, argmax


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """How many of `accept` (bools, in order) hold before the first that does not: a 0-d tensor."""
    return accept.long().cumprod(0).sum()


def greedy_chain(logits: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """[n accepted, the oracle's token after them] for proposals [k] under logits [k + 1, V]."""
    targets = argmax(logits)
    n = accepted_prefix(proposals == targets[:-1])
    return torch.stack([n, targets[n]])


def ratios(ps: torch.Tensor, qs: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """min(1, p_i(x_i) / q_i(x_i)) per proposal: the probability each one is accepted."""
    rows = torch.arange(proposals.shape[0], device=proposals.device)
    p, q = ps[rows, proposals], qs[rows, proposals]
    return torch.where(q > 0, (p / q.clamp(min=torch.finfo(q.dtype).tiny)).clamp(max=1.0), torch.zeros_like(p))


def residuals(ps: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """[k + 1, V]: row i < k is norm(max(0, p_i - q_i)), what to draw from after rejecting proposal i; row k
    is p_k, the bonus token's distribution."""
    rest = torch.cat([(ps[:-1] - qs).clamp(min=0), ps[-1:]])
    total = rest.sum(-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=torch.finfo(rest.dtype).tiny), ps)


def sampled_chain(ps: torch.Tensor, qs: torch.Tensor, proposals: torch.Tensor,
                  draws: Draws) -> torch.Tensor:
    """[n accepted, the oracle's token after them] for proposals [k] drawn from qs [k, V], under ps [k + 1, V]."""
    k = proposals.shape[0]
    n = accepted_prefix(draws.uniforms(k, ps.device) < ratios(ps, qs, proposals))
    final = draws.sample_rows(residuals(ps, qs)[n][None])[0]
    return torch.stack([n, final])


def _normalised(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return torch.where(total > 0, x / total.clamp(min=torch.finfo(x.dtype).tiny), fallback)


def tree_walk(ps: torch.Tensor, qs: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor, rule: str,
              widths: list[int], draws: Draws) -> torch.Tensor:
    """Follow the oracle down a drafted tree when sampling, on the device: [which child (its place in the test
    order) was accepted at each level (-1 past the end), the oracle's own token after the path].

    Row 0 is the root, row r the r-th node; ps [rows, V] the oracle's distribution at each row, qs the draft's
    distribution each row's children were drawn from; kids/tokens [rows, B] the children (rows, -1: none) and
    their tokens in test order; widths[level]: the most children a node of that depth has. At each node the
    children are tested in order with `rule` (as
    `spec_cli.decoding.sampling.verify_candidates` does: deterministic, iid or without_replacement), each with a
    fresh uniform; the first accepted one is followed; when none is, the token comes from what rejection left
    of p (a leaf: p itself)."""
    uniforms = draws.uniforms((len(widths), kids.shape[1]), ps.device)
    node = torch.zeros((), dtype=torch.long, device=ps.device)
    alive = torch.ones((), dtype=torch.bool, device=ps.device)
    final = ps[0]
    path = []
    for level, width in enumerate(widths):
        p, q = ps[node], qs[node]
        chosen = torch.full((), -1, dtype=torch.long, device=ps.device)
        place = torch.full((), -1, dtype=torch.long, device=ps.device)
        for j in range(width):
            kid, x = kids[node, j], tokens[node, j]
            valid = alive & (kid >= 0) & (chosen < 0)
            if rule == "deterministic":
                ratio = p[x]
            else:
                ratio = torch.where(q[x] > 0, (p[x] / q[x].clamp(min=torch.finfo(q.dtype).tiny)).clamp(max=1.0),
                                    torch.zeros_like(p[x]))
            taken = valid & (uniforms[level, j] < torch.where(valid, ratio, 0.0))
            chosen = torch.where(taken, kid, chosen)
            place = torch.where(taken, j, place)
            rejected = valid & ~taken
            if rule == "deterministic":
                left = _normalised(p.scatter(0, x[None], 0.0), p)
            else:
                left = _normalised((p - q).clamp(min=0), p)
            p = torch.where(rejected, left, p)
            if rule == "without_replacement":
                q = torch.where(rejected, _normalised(q.scatter(0, x[None], 0.0), q), q)
        stops = alive & (chosen < 0)
        final = torch.where(stops, p, final)
        alive = alive & (chosen >= 0)
        path.append(torch.where(alive, place, -1))
        node = torch.where(alive, chosen, node)
    final = torch.where(alive, ps[node], final)
    return torch.cat([torch.stack(path), draws.sample_rows(final[None])])
