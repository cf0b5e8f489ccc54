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
