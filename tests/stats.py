"""A chi-square goodness-of-fit test without scipy."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_p_value(observed: Counter, expected: dict, n: int, min_expected: float = 5.0) -> float:
    """p-value that `observed` counts (n draws) come from the `expected` probabilities."""
    stat, df, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    assert abs(sum(expected.values()) - 1) < 1e-4, sum(expected.values())
    unexpected = sum(c for k, c in observed.items() if expected.get(k, 0) == 0)
    if unexpected:
        return 0.0
    for key, prob in expected.items():
        e = prob * n
        if e < min_expected:
            pooled_obs += observed.get(key, 0)
            pooled_exp += e
            continue
        stat += (observed.get(key, 0) - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    df -= 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def deviation_p_value(tokens: torch.Tensor, ps: torch.Tensor) -> float:
    """p-value that each token was drawn from its row of `ps` (given everything before it): the sum of
    one-hot(token) - p over positions is a martingale, so with its covariance sum(diag(p) - p p^T) the quadratic
    form is chi-square with V - 1 degrees of freedom."""
    if (ps.gather(1, tokens[:, None]) == 0).any():
        return 0.0
    deviation = (torch.nn.functional.one_hot(tokens, ps.shape[1]).double() - ps).sum(0)[:-1]
    cov = (torch.diag_embed(ps) - ps[:, :, None] * ps[:, None, :]).sum(0)[:-1, :-1]
    stat = float(deviation @ torch.linalg.solve(cov, deviation))
    df = torch.tensor((ps.shape[1] - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def biased(ps: torch.Tensor, bias: float) -> torch.Tensor:
    """`bias` of the probability moved from each row's most likely token to its least likely one still possible."""
    out = ps.clone()
    top = ps.argmax(1)
    low = torch.where(ps > bias, ps, torch.inf).argmin(1)
    rows = torch.arange(len(ps))
    out[rows, top] -= bias
    out[rows, low] += bias
    return out
