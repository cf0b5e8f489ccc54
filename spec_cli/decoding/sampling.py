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
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            floors = _nucleus_floor(logits.reshape(-1, logits.shape[-1]), self.top_p)
            logits = logits.masked_fill(logits < floors.reshape(*logits.shape[:-1], 1), float("-inf"))
        return logits


NUCLEUS = (1024, 16384)  # words a row's top-p looks among, in turn, before it sorts the whole row


def _nucleus_floor(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows, 1]: each row's least logit that top-p keeps. It keeps the most probable words until their
    probability reaches top_p, the first past it included; every word tied with the last is kept. The most
    probable words are found among the top 1024 where those reach top_p (the whole row sorted only where no
    part does; on a GPU every row sorted), by kernels that take a row at a time (softmax, top-k, cumsum: a row's own bits whatever rows
    are beside it)."""
    probs = logits.float().softmax(-1)
    if logits.device.type != "cpu":  # (a GPU sorts every row at once: looking in turn would read back)
        return _floor_among(logits, probs, top_p, logits.shape[-1])[0]
    floors = torch.empty(logits.shape[0], 1, dtype=logits.dtype, device=logits.device)
    rows = torch.arange(logits.shape[0], device=logits.device)
    for k in (*NUCLEUS, logits.shape[-1]):
        floor, short = _floor_among(logits[rows], probs[rows], top_p, min(k, logits.shape[-1]))
        floors[rows[~short]] = floor[~short]
        rows = rows[short]
        if not len(rows):
            break
    return floors


def _floor_among(logits: torch.Tensor, probs: torch.Tensor, top_p: float, k: int):
    """Each row's floor (`_nucleus_floor`) as its top k words give it, and whether they fall short of top_p (the
    k-th kept too, with words beyond it)."""
    whole = k == probs.shape[-1]
    top = torch.sort(probs, -1, descending=True) if whole else torch.topk(probs, k, dim=-1)  # (ties: any order)
    kept = top.values.cumsum(-1) - top.values < top_p  # (a prefix: the mass before each word only grows)
    floor = logits.gather(-1, top.indices.gather(-1, kept.sum(-1, keepdim=True) - 1))
    return floor, kept[:, -1] & (not whole)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class Draws:
    """Every random choice of one completion, from its one seeded generator on the logits' device (draws happen
    where the distributions are, and a seed reproduces a run on the same device). Strategies draw only through
    these methods, and take the object they draw from as an argument: tests/exact.py passes one that
    enumerates every choice, to compute a method's exact output distribution."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    @classmethod
    def seeded(cls, seed: int | None, device: torch.device | str = "cpu") -> Draws:
        return cls(make_generator(seed, device))

    def sample(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p, 1, generator=self.generator))

    def sample_group(self, q: torch.Tensor, k: int, replacement: bool) -> list[int]:
        """k draws from q, i.i.d. or without replacement (in draw order)."""
        return torch.multinomial(q, k, replacement=replacement, generator=self.generator).tolist()

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, device=self.generator.device))

    # On the device, for many rows at once (nothing is read back): `spec_cli.decoding.accept` and the tree's
    # drafting draw through these.
    def uniforms(self, shape, device) -> torch.Tensor:
        """Uniforms on [0, 1), only ever compared as `uniforms < a`."""
        return torch.rand(shape, generator=self.generator, device=device)

    def sample_rows(self, p: torch.Tensor) -> torch.Tensor:
        """One draw from each row of p [rows, V]: [rows]."""
        return torch.multinomial(p, 1, generator=self.generator)[:, 0]

    def sample_groups(self, q: torch.Tensor, k: int, replacement: bool) -> torch.Tensor:
        """k draws from each row of q [rows, V], i.i.d. or without replacement in draw order: [rows, k]. Without
        replacement: an exponential race (what torch.multinomial does), so a row with fewer than k tokens left
        ends with tokens of probability 0, which nobody uses."""
        if replacement:
            return torch.multinomial(q, k, replacement=True, generator=self.generator)
        return torch.topk(q / torch.empty_like(q).exponential_(1, generator=self.generator), k).indices

    def tree_rows(self, q: torch.Tensor, branching: int, rule: str, guesses, summarise):
        """A tree's rows of q with their sampled groups: `summarise(q, branching, rule, guesses, self)` draws
        them all on the device and reads them back at once (tests/exact.py draws each row's when it is read)."""
        return summarise(q, branching, rule, guesses, self)


def _normalised(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if total > 0 else fallback


def verify_candidates(
    p: torch.Tensor,
    candidates: list[int],
    rule: str,
    draws: Draws,
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
        if draws.uniform() < float(accept):
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
