"""Coupled sampling: every method draws the same text from the same seed.

The token at position t is argmax(log p_t + G_t), where p_t is the oracle's distribution (after temperature,
top-k and top-p) and G_t is Gumbel noise drawn for position t alone, from the completion's seed. That is an
exact draw from p_t (the Gumbel-max trick), independent of every earlier position's draw. A draft scores its
guesses with the same noise, argmax(log q_t + G_t), so it guesses what the oracle will draw, and verifying is
what it is for greedy decoding: keep the guesses the oracle's own scores agree with. So each method's text is
the oracle alone's text for that seed, token for token, and the greedy machinery (and its proofs) carries
over whole.

`Coupled` wraps a runner so its logits come out as those scores; the strategies then decide by argmax.
"""

from __future__ import annotations

import torch

from spec_cli.decoding.sampling import Sampler

BLOCK = 16  # positions per draw: noise for position t is the same whichever method asks, and in what order


class Noise:
    """Gumbel noise [V] per position, drawn in blocks of BLOCK positions in order from the seed, kept for a
    window of recent positions."""

    KEEP = 1024  # positions kept behind the newest asked for (a draft's cache lags the oracle's by a step)

    def __init__(self, sampler: Sampler, generator: torch.Generator, vocab: int, device, base: int):
        """`base`: the first position the completion decides (the prompt's length); the first block drawn
        is the one holding it, whatever a method runs first."""
        self.sampler, self.generator, self.vocab, self.device = sampler, generator, vocab, device
        self.base = base
        self.first = base - base % BLOCK  # the position of the table's row 0
        self.table = torch.empty(0, vocab, device=device)

    def _cover(self, lo: int, hi: int) -> None:
        """Make positions lo..hi-1 available (host ints: nothing waits for the device)."""
        if lo < self.first:
            raise RuntimeError(f"coupled noise for position {lo} was dropped (window starts at {self.first})")
        end = self.first + self.table.shape[0]
        if hi > end:
            blocks = -(-(hi - end) // BLOCK)
            fresh = [torch.rand(BLOCK, self.vocab, generator=self.generator, device=self.device)
                     for _ in range(blocks)]
            gumbel = -torch.log(-torch.log(torch.cat(fresh)))
            keep = min(lo, hi - self.KEEP)  # positions before this are not asked for again
            drop = min(self.table.shape[0], max(0, (keep - self.first) // BLOCK * BLOCK))
            self.table = torch.cat([self.table[drop:], gumbel])
            self.first += drop

    def scores(self, logits: torch.Tensor, positions: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """log p + G for rows [rows, V] whose tokens sit at `positions` (device): each scores the token at
        its position + 1. lo..hi-1 bound the positions scored; rows scoring the prompt's own tokens get the
        first row's noise, and nobody reads them."""
        self._cover(max(lo, self.base), max(hi, self.base + 1))
        rows = (positions + 1 - self.first).clamp(min=0)
        return self.sampler.warped(logits) + self.table[rows]  # log p + G, less a constant per row


class Coupled:
    """A runner whose forward returns coupled scores in place of logits; everything else is the runner's."""

    def __init__(self, runner, noise: Noise):
        self.__dict__["runner"], self.__dict__["noise"] = runner, noise

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __setattr__(self, name, value):
        setattr(self.runner, name, value)

    def forward(self, tokens, *args, **kwargs):
        start = self.runner.length
        result = self.runner.forward(tokens, *args, **kwargs)
        scores = self.noise.scores(result.logits, result.positions, start + 1, start + len(tokens) + 1)
        return result._replace(logits=scores)
