"""Turning logits into the distributions we sample from, and the exact acceptance rules.

All acceptance rules work on p (the oracle's distribution after temperature/top-k/top-p) and q (the
distribution the draft's candidates were drawn from). Each returns the accepted candidate's index, or None
with the residual distribution to sample the oracle's own token from, so the result is a sample of p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.exec.ops import argmax  # noqa: F401 (what the strategies pick by)


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    coupled: bool = False  # sampling by argmaxes of coupled scores (`spec_cli.decoding.coupling`), not by drawing

    @property
    def greedy(self) -> bool:
        """Tokens are decided by argmax: of the logits (temperature 0), or of coupled scores."""
        return self.temperature == 0 or self.coupled

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Distribution(s) after temperature, top-k and top-p, in that order (as Hugging Face does)."""
        return self.warped(logits).softmax(-1)

    def warped(self, logits: torch.Tensor) -> torch.Tensor:
        """log p up to a constant per row: the logits after temperature, -inf outside top-k and top-p."""
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop_sorted = cumulative - sorted_logits.softmax(-1) >= self.top_p  # keep the first past top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits


# Every random choice of every strategy goes through these three (tests/exact.py replaces them to enumerate
# all choices and compute a method's exact output distribution).
def sample(p: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def sample_group(q: torch.Tensor, k: int, replacement: bool, generator: torch.Generator) -> list[int]:
    """k draws from q, i.i.d. or without replacement (in draw order)."""
    return torch.multinomial(q, k, replacement=replacement, generator=generator).tolist()


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device=generator.device))


# Their counterparts on the device, for many rows at once (nothing is read back): `spec_cli.decoding.accept` and the
# tree's drafting draw through these, and tests/exact.py enumerates them as it does the three above.
def uniforms(shape, generator: torch.Generator, device) -> torch.Tensor:
    """Uniforms on [0, 1), only ever compared as `uniforms < a`."""
    return torch.rand(shape, generator=generator, device=device)


def sample_rows(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw from each row of p [rows, V]: [rows]."""
    return torch.multinomial(p, 1, generator=generator)[:, 0]


def sample_groups(q: torch.Tensor, k: int, replacement: bool, generator: torch.Generator) -> torch.Tensor:
    """k draws from each row of q [rows, V], i.i.d. or without replacement in draw order: [rows, k]. Without
    replacement: an exponential race (what torch.multinomial does), so a row with fewer than k tokens left
    ends with tokens of probability 0, which nobody uses."""
    if replacement:
        return torch.multinomial(q, k, replacement=True, generator=generator)
    return torch.topk(q / torch.empty_like(q).exponential_(1, generator=generator), k).indices


def _normalised(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if total > 0 else fallback


def verify_candidates(
    p: torch.Tensor,
    candidates: list[int],
    rule: str,
    generator: torch.Generator,
    q: torch.Tensor | None = None,
) -> tuple[int | None, torch.Tensor]:
    """Test the candidates for one position in order; (index of the accepted one, None) or (None, residual).

    rule "iid": candidates drawn i.i.d. from q (one candidate: Leviathan et al.; several: SpecInfer).
    rule "without_replacement": distinct candidates drawn from q without replacement (Sequoia).
    rule "deterministic": candidates fixed without drawing from q (top-k of the draft, n-gram guesses):
    q is a point mass on each, so accept x with probability p(x), else zero p[x] and renormalise.
    """
    p = p.clone()
    if rule != "deterministic" and candidates:
        q = q.clone()
    for index, x in enumerate(candidates):
        if rule == "deterministic":
            accept = p[x]
        else:
            accept = torch.clamp(p[x] / q[x], max=1.0) if q[x] > 0 else torch.tensor(0.0)
        if uniform(generator) < float(accept):
            return index, p
        if rule == "deterministic":
            p[x] = 0
            p = _normalised(p, p)
        else:
            p = _normalised(torch.clamp(p - q, min=0), p)
            if rule == "without_replacement":
                q[x] = 0
                q = _normalised(q, q)
    return None, p
