"""Prefixes kept: the cache entries of earlier sequences, so a request that shares a prefix with any of them
(a system prompt, an agent's tool list, a chat a client comes back to) runs only what follows it.

A runner holds one sequence; before a new one overwrites what it holds, the old one's committed entries are
copied here (`Runner.reuse`), and the new one starts from the longest prefix found here or in the runner,
whichever is longer. An entry at a position depends only on the tokens up to it, so any stored sequence serves
any prompt for as many tokens as they share. Least recently used out, within a budget of bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

SMALLEST = 32  # tokens: a shorter sequence is not worth a copy (its prefill costs about one forward)


@dataclass
class Kept:
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, 1, kv heads, tokens, head dim]
    values: torch.Tensor

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


def shared(a, b) -> int:
    """How many tokens `a` and `b` share from the start."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Prefixes:
    def __init__(self, budget: int):
        self.budget = budget  # bytes
        self.kept: OrderedDict[tuple[int, ...], Kept] = OrderedDict()
        self.hits = self.misses = 0
        self.lock = threading.Lock()  # (a server's slots share one)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kept.values())

    def put(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep a sequence's entries (copied: the runner overwrites its own); the oldest go beyond the budget.
        A sequence that a kept one starts with adds nothing; one that starts with a kept one replaces it."""
        with self.lock:
            self._put(tuple(tokens), keys, values)

    def _put(self, key: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        if len(key) < SMALLEST or any(k[: len(key)] == key for k in self.kept):
            return
        for k in [k for k in self.kept if key[: len(k)] == k]:
            del self.kept[k]
        entry = Kept(key, keys.clone(), values.clone())
        if entry.bytes > self.budget:
            return
        self.kept[key] = entry
        while self.bytes > self.budget:
            self.kept.popitem(last=False)

    def best(self, sequence: list[int], limit: int) -> tuple[int, Kept | None]:
        """The kept sequence sharing the most tokens with `sequence` (at most `limit`), and how many."""
        with self.lock:
            return self._best(sequence, limit)

    def _best(self, sequence: list[int], limit: int) -> tuple[int, Kept | None]:
        found, most = None, 0
        for entry in self.kept.values():
            n = min(shared(entry.tokens, sequence), limit)
            if n > most:
                found, most = entry, n
        if found is not None:
            self.kept.move_to_end(found.tokens)
        return most, found
