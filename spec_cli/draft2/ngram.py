"""Second-stage drafters: cheap guessers that speculate for the draft model.

- `KatzTrigram`: the staged speculative decoding paper's draft2, a Katz back-off trigram model (Good-Turing
  discounts for counts up to k, back-off weights so each distribution sums to one, add-one unigrams at the
  bottom). Fitted from token streams; saved to / loaded from an .npz file; `propose` is dictionary look-ups.
- `PromptLookup`: continues the longest recent n-gram match within the prompt and the text so far.
- `LookupOrTrigram`: prompt lookup where the context repeats (a match of at least two tokens), the trigram
  elsewhere and after the copied run ends.

A drafter only proposes: the draft model checks every guess, and the oracle checks the draft's candidates,
so a drafter's quality changes speed, never output.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from spec_cli.core.errors import SpecError
from spec_cli.draft2.lookup import continuation

FORMAT = 1
TOPS = 2  # a context's likeliest tokens remembered (`tops`)


class Drafter(Protocol):
    def propose(self, context: list[int], n: int) -> list[int]:
        """Up to n guesses of the tokens that follow `context`."""


def good_turing_discounts(counts: np.ndarray, k: int = 5) -> np.ndarray:
    """Katz's discount d_r for r = 0..k (d_r = 1 above k); plain 1 where the Good-Turing numbers are unusable."""
    n = np.bincount(counts, minlength=k + 2).astype(np.float64)
    d = np.ones(k + 1)
    if n[1] == 0:
        return d
    common = (k + 1) * n[k + 1] / n[1]
    for r in range(1, k + 1):
        if n[r] == 0 or common >= 1:
            return np.ones(k + 1)
        value = ((r + 1) * n[r + 1] / (r * n[r]) - common) / (1 - common)
        if not 0 < value <= 1:
            return np.ones(k + 1)
        d[r] = value
    return d


class KatzTrigram:
    def __init__(self, vocab_size: int, unigrams: np.ndarray, bigrams: tuple[np.ndarray, np.ndarray],
                 trigrams: tuple[np.ndarray, np.ndarray], k: int = 5):
        self.vocab_size = V = vocab_size
        self.k = k
        self.unigram_counts = unigrams.astype(np.int64)
        self.bi_keys, self.bi_counts = bigrams
        self.tri_keys, self.tri_counts = trigrams
        self.unigram = (self.unigram_counts + 1) / (self.unigram_counts.sum() + V)
        self.d2 = good_turing_discounts(self.bi_counts, k)
        self.d3 = good_turing_discounts(self.tri_counts, k)
        # successors by context, as sorted key arrays: bigram key v*V+w, trigram key (u*V+v)*V+w
        self.bi_ctx = self.bi_keys // V
        self.tri_ctx = self.tri_keys // V
        self._bi_alpha: dict[int, float] = {}
        self._tri_alpha: dict[int, float] = {}
        self._best: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {}

    # --- fitting and files -------------------------------------------------------------------------------
    @classmethod
    def fit(cls, streams: Iterable[Iterable[int]], vocab_size: int, k: int = 5) -> "KatzTrigram":
        V = vocab_size
        uni = np.zeros(V, dtype=np.int64)
        bi_parts, tri_parts = [], []
        for stream in streams:
            ids = np.asarray(list(stream), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= V):
                raise SpecError(f"token id outside the vocabulary of {V}")
            uni += np.bincount(ids, minlength=V)
            if ids.size >= 2:
                bi_parts.append(ids[:-1] * V + ids[1:])
            if ids.size >= 3:
                tri_parts.append((ids[:-2] * V + ids[1:-1]) * V + ids[2:])
        empty = np.zeros(0, dtype=np.int64)
        bi = np.unique(np.concatenate(bi_parts) if bi_parts else empty, return_counts=True)
        tri = np.unique(np.concatenate(tri_parts) if tri_parts else empty, return_counts=True)
        return cls(V, uni, bi, tri, k)

    def save(self, path: str | Path) -> None:
        """The model as an .npz file at exactly `path` (numpy would add ".npz" to a name without it)."""
        with open(path, "wb") as f:
            np.savez_compressed(f, format=FORMAT, vocab_size=self.vocab_size, k=self.k, unigrams=self.unigram_counts,
                                bi_keys=self.bi_keys, bi_counts=self.bi_counts, tri_keys=self.tri_keys,
                                tri_counts=self.tri_counts)

    @classmethod
    def load(cls, path: str | Path) -> "KatzTrigram":
        try:
            data = np.load(path)
            if int(data["format"]) != FORMAT:
                raise SpecError(f"{path}: n-gram file format {int(data['format'])}, expected {FORMAT}")
            return cls(int(data["vocab_size"]), data["unigrams"], (data["bi_keys"], data["bi_counts"]),
                       (data["tri_keys"], data["tri_counts"]), int(data["k"]))
        except (OSError, KeyError, ValueError) as e:
            raise SpecError(f"cannot read the n-gram model {path}: {e}") from None

    # --- probabilities ---------------------------------------------------------------------------------
    def _discounted(self, counts: np.ndarray, d: np.ndarray) -> np.ndarray:
        return np.where(counts <= self.k, d[np.minimum(counts, self.k)], 1.0) * counts

    def _successors(self, ctx_keys, keys, counts, ctx):
        lo, hi = np.searchsorted(ctx_keys, [ctx, ctx + 1])
        return keys[lo:hi] % self.vocab_size, counts[lo:hi]

    def bigram_probs(self, v: int) -> np.ndarray:
        words, counts = self._successors(self.bi_ctx, self.bi_keys, self.bi_counts, v)
        if counts.size == 0:
            return self.unigram.copy()
        return self._back_off(words, self._discounted(counts, self.d2) / counts.sum(), self.unigram)

    def probs(self, u: int, v: int) -> np.ndarray:
        """P(w | u v) for every w."""
        lower = self.bigram_probs(v)
        words, counts = self._successors(self.tri_ctx, self.tri_keys, self.tri_counts, u * self.vocab_size + v)
        if counts.size == 0:
            return lower
        return self._back_off(words, self._discounted(counts, self.d3) / counts.sum(), lower)

    @staticmethod
    def _back_off(words: np.ndarray, seen: np.ndarray, lower: np.ndarray) -> np.ndarray:
        """Seen words keep their discounted estimates; the mass left over goes to the others by `lower`."""
        unseen_mass = 1 - lower[words].sum()
        if len(words) == len(lower) or unseen_mass <= 1e-12:  # nothing unseen: renormalise the seen ones
            probs = np.zeros_like(lower)
            probs[words] = seen / seen.sum()
            return probs
        probs = max(1 - seen.sum(), 0.0) / unseen_mass * lower
        probs[words] = seen
        return probs

    # --- proposing -------------------------------------------------------------------------------------
    def top(self, u: int, v: int) -> tuple[int, float]:
        """The likeliest token after `u v` and its probability."""
        return self.tops(u, v)[0]

    def tops(self, u: int, v: int) -> tuple[tuple[int, float], ...]:
        """The TOPS likeliest tokens after `u v`, likeliest first (ties: the lower id), each with its probability
        (remembered: a context recurs often)."""
        key = (u, v)
        best = self._best.get(key)
        if best is None:
            probs = self.probs(u, v)
            found = []
            for _ in range(min(TOPS, len(probs))):
                t = int(np.argmax(probs))
                found.append((t, float(probs[t])))
                probs[t] = -1.0  # (its own array: `probs` computes a new one)
            best = tuple(found)
            if len(self._best) > 1_000_000:
                self._best.clear()
            self._best[key] = best
        return best

    def next_token(self, u: int, v: int) -> int:
        return self.top(u, v)[0]

    def chain(self, context: list[int], n: int) -> list[tuple[int, float]]:
        """Its greedy guesses after `context`, n of them, each with its probability."""
        u, v = self.last_two(context)
        out = []
        for _ in range(n):
            w, p = self.top(u, v)
            out.append((w, p))
            u, v = v, w
        return out

    @staticmethod
    def last_two(context: list[int]) -> tuple[int, int]:
        """The context a next token is guessed from: its last two tokens (0 before its start)."""
        return (context[-2] if len(context) > 1 else 0), (context[-1] if context else 0)

    def propose(self, context: list[int], n: int) -> list[int]:
        return [w for w, _ in self.chain(context, n)]


class PromptLookup:
    """Guess that the text repeats: find the latest earlier occurrence of the last n tokens, copy what followed.
    A copy that reaches the end of the text goes on copying what it copied (a loop repeats whole)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: list[int], n: int) -> list[int]:
        tokens = context[-4096:]
        text = array("i", tokens).tobytes()  # 4 bytes a token: a match is a byte match at a multiple of 4
        for size in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= size:
                continue
            pattern, end = text[-4 * size :], len(text) - 4  # (in the text before the last token)
            at = text.rfind(pattern, 0, end)
            while at > 0 and at % 4:  # a match across token boundaries: the latest one before it
                at = text.rfind(pattern, 0, at + 4 * size - 1)
            if at >= 0 and at % 4 == 0:
                return continuation(tokens, at // 4 + size, n)
        return []


class LookupOrTrigram:
    """Copy where the text repeats itself, guess like the paper's trigram everywhere else."""

    def __init__(self, trigram: KatzTrigram, lookup: PromptLookup | None = None):
        self.trigram = trigram
        self.lookup = lookup or PromptLookup(max_ngram=3, min_ngram=2)

    def propose(self, context: list[int], n: int) -> list[int]:
        copied = self.lookup.propose(context, n)
        if len(copied) < n:
            copied += self.trigram.propose(list(context[-2:]) + copied, n - len(copied))
        return copied


def trigram_of(drafter: Drafter | None) -> KatzTrigram | None:
    """The trigram a second stage holds, if any (its guesses also go to the oracle on steps without the draft)."""
    if isinstance(drafter, LookupOrTrigram):
        return drafter.trigram
    return drafter if isinstance(drafter, KatzTrigram) else None
