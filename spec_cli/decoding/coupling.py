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
from spec_cli.exec import native

SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # its increment, multipliers (Steele et al.)
GOLDEN, MIX_1, MIX_2 = (c - (1 << 64) for c in SPLITMIX)  # (as the signed 64-bit integers torch holds)
BITS = 23  # of each hash, a uniform's (24 significant bits with the half: exact in float32)
KEEP = 64  # positions whose whole-vocabulary noise is kept (sampling by temperature alone: every word survives)


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >> bits as unsigned 64-bit integers (torch's shift keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mixed(seed: int) -> int:
    """splitmix64's output for `seed`, in Python's integers: a key as far from its neighbours' as from any."""
    z = (seed + SPLITMIX[0]) % (1 << 64)
    z = ((z ^ (z >> 30)) * SPLITMIX[1]) % (1 << 64)
    z = ((z ^ (z >> 27)) * SPLITMIX[2]) % (1 << 64)
    return (z ^ (z >> 31)) >> 2  # (a non-negative 62-bit key)


def gumbel(key: int, counters: torch.Tensor, kernels=None) -> torch.Tensor:
    """Gumbel noise, one float32 a counter (int64): the counter-th output of the splitmix64 stream seeded with
    `key`, its top 23 bits a uniform strictly inside (0, 1), through -log(-log u). With spec's CPU `kernels`, by
    theirs (`native/logits.cpp`: the same integers and float steps, the C library's log)."""
    if kernels is not None and counters.device.type == "cpu":
        return kernels.coupled_noise(counters, key)
    z = (counters + 1).mul_(GOLDEN).add_(key)  # (wrapping, as the generator's state does)
    z = z.bitwise_xor_(_shifted(z, 30)).mul_(MIX_1)
    z = z.bitwise_xor_(_shifted(z, 27)).mul_(MIX_2)
    return gumbel_of(_shifted(z.bitwise_xor_(_shifted(z, 31)), 64 - BITS))


def gumbel_of(bits: torch.Tensor) -> torch.Tensor:
    """-log(-log u) for u = (bits + 1/2) / 2^23, bits 0 .. 2^23 - 1: every u exact in float32 (24 significant
    bits at most), so none rounds to 0 or 1 (with 24 bits the largest rounds to 1, an infinite noise that wins
    whatever p says, once in 2^24 words)."""
    u = bits.to(torch.float32).add_(0.5).mul_(2.0 ** -BITS)
    return u.log_().neg_().log_().neg_()


class Noise:
    """Gumbel noise G(t, v) for the word v at position t: a hash of (the completion's key, t, v), so whoever asks
    for a position, in whatever order and however long after, gets the same noise, and it is computed only where
    it counts: for the words top-k and top-p keep (the rest score -inf whatever their noise), and with spec's CPU
    kernels, by temperature alone, for the words that can win the draw (log p within the noise's range of the
    largest: any other scores below that one's score whatever the noise, so its -inf changes no argmax)."""

    def __init__(self, sampler: Sampler, generator: torch.Generator, vocab: int, device, base: int = 0):
        """`base`: the first position the completion decides (the prompt's length): rows scoring the prompt's
        own tokens, which nobody reads, take its noise (a prompt's rows cost no noise of their own)."""
        self.sampler, self.vocab, self.device, self.base = sampler, vocab, device, base
        self.key = _mixed(generator.initial_seed())  # (the seed's, read without asking the device)
        self.kept: dict[int, torch.Tensor] = {}  # position -> its whole-vocabulary noise [V] (insertion order)
        # spec's CPU kernels where loaded, for every call of this completion (one way of computing it throughout)
        self.kernels = native.loaded() if torch.device(device).type == "cpu" else None

    def at(self, positions: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """G at each (position, word) pair (int64 tensors of one shape)."""
        return gumbel(self.key, positions * self.vocab + words, self.kernels)

    def _whole(self, positions: torch.Tensor) -> torch.Tensor:
        """Every word's noise at each position: [len(positions), V]."""
        rows = []
        for t in positions.tolist():
            if t not in self.kept:
                self.kept[t] = self.every_word(torch.tensor([t], device=self.device))[0]
                if len(self.kept) > KEEP:
                    del self.kept[next(iter(self.kept))]
            rows.append(self.kept[t])
        return torch.stack(rows)

    def scores(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """log p + G for rows [rows, V] whose tokens sit at `positions` (device): each scores the token at its
        position + 1. Row by row the same bits whatever rows share the call, and whichever way (some words or all)
        the noise is computed."""
        sampler = self.sampler
        at = (positions.to(device=logits.device, dtype=torch.long) + 1).clamp(min=self.base)
        if (self.kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.device.type == "cpu"):
            if 0 < sampler.top_k < logits.shape[-1]:  # (one pass a row: the k-th largest, top-p among those, then
                # the noise of the words kept)
                return self.kernels.coupled_top_k(logits, at, sampler.temperature, sampler.top_k, sampler.top_p,
                                                  self.key, self.vocab)
            # (the nucleus found among the most probable words; by temperature alone, the noise only of the words
            # that can win the draw: the same argmax as every word's)
            return self.kernels.coupled_nucleus(logits, at, sampler.temperature, sampler.top_p, self.key, self.vocab)
        warped = sampler.warped(logits)
        if warped.device.type != "cpu":  # (every word's noise for every row at once: nothing read back)
            return warped + self.every_word(at)
        rows, words = (warped > float("-inf")).nonzero(as_tuple=True)
        if len(rows) * 4 <= warped.numel():  # (top-k, top-p, a draft's part of the vocabulary)
            out = torch.full(warped.shape, float("-inf"), device=warped.device,
                             dtype=torch.promote_types(warped.dtype, torch.float32))
            out[rows, words] = warped[rows, words] + self.at(at[rows], words)
            return out
        unique, inverse = torch.unique(at, return_inverse=True)
        return warped + self._whole(unique)[inverse]  # log p + G, less a constant per row

    def every_word(self, at: torch.Tensor) -> torch.Tensor:
        """[rows, V]: every word's noise at each position of `at`, computed whole (on a GPU, where the rows'
        words cost nothing beside reading back which of them survive)."""
        return self.at(at[:, None], torch.arange(self.vocab, device=at.device)[None, :])


class Coupled:
    """A runner whose forward returns coupled scores in place of logits; everything else is the runner's."""

    def __init__(self, runner, noise: Noise):
        self.__dict__["runner"], self.__dict__["noise"] = runner, noise

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __setattr__(self, name, value):
        setattr(self.runner, name, value)

    def forward(self, tokens, *args, **kwargs):
        result = self.runner.forward(tokens, *args, **kwargs)
        return result._replace(logits=self.noise.scores(result.logits, result.positions), raw=result.logits)
