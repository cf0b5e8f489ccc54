"""Guesses copied from the text itself, with no model: prompt lookup over the prompt and everything generated,
grown into trees as suffix decoding does (Oliaro et al. 2024).

`Index` holds every n-gram of the text so far (n = 1..LONGEST) with the places where what followed it begins,
brought up to date as the text grows (a step costs O(new tokens), whatever the context's length). `Index.guess`
finds the longest n-gram ending the text that occurred before and merges what followed its latest occurrences
into a trie: occurrences that continue alike share a branch, and where they part the trie branches. Each guess
carries what says how far to trust it: the share of the occurrences at its parent that went on with it, and
the length of the match it extends (the n-gram, plus the guesses above it).

A guess is deterministic (no draw), so the oracle verifies these trees exactly by the one-hot rule: a child x
is accepted with probability p(x), else the token is drawn from p with x removed (`spec_cli.decoding.accept`); greedy,
while it is the oracle's argmax.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

LONGEST = 4  # the longest n-gram matched
SOURCES = 8  # the latest occurrences of the match whose continuations make the trie
MATCHED = 32  # the longest match measured (backwards from each occurrence)
ROOT = -1


@dataclass
class Guess:
    token: int
    parent: int  # index of the parent guess, ROOT for the text's last token
    share: float  # of the occurrences that reached the parent, the share that went on with this token
    match: int  # the length of the match this guess extends: the n-gram and the guesses above it
    rank: int  # place among its siblings, most shared first


class Index:
    """Every n-gram of a text (n = 1..LONGEST) -> the positions just after its occurrences, kept up to date by
    `extend` as the text grows (a chat's text only grows within a completion)."""

    def __init__(self, longest: int = LONGEST):
        self.longest = longest
        self.after: dict[tuple[int, ...], list[int]] = {}
        self.upto = 0  # positions before this are indexed

    def extend(self, text: list[int]) -> None:
        """Index the n-grams that now have a token after them."""
        for p in range(max(self.upto, 1), len(text)):
            for n in range(1, min(self.longest, p) + 1):
                self.after.setdefault(tuple(text[p - n : p]), []).append(p)
        self.upto = max(self.upto, len(text))

    def repeating(self, text: list[int]) -> bool:
        """Whether the text's last three tokens occurred before, with something after them (a copy may begin)."""
        return len(text) > 3 and tuple(text[-3:]) in self.after

    def match(self, text: list[int]) -> tuple[int, list[int]]:
        """The longest n-gram ending the text that occurred before: (n, the positions after its latest
        occurrences, latest first); (0, []) when even the last token is new."""
        for n in range(min(self.longest, len(text) - 1), 0, -1):
            found = self.after.get(tuple(text[-n:]))
            if found:
                return n, found[-SOURCES:][::-1]
        return 0, []

    def guess(self, text: list[int], depth: int, branches: int, most: int) -> list[Guess]:
        """The trie of what followed the longest match's latest occurrences, `depth` tokens deep, at most
        `branches` children a node (the most shared; ties: the latest), at most `most` guesses, parents
        before their children and siblings by rank. `extend(text)` must have been called."""
        n, sources = self.match(text)
        if not n or depth < 1:
            return []
        lengths = [_matched(text, p, n) for p in sources]
        # the trie, node 0 its root: each node's token, depth, occurrences through it, the first occurrence that
        # reached it (the latest: 0), the longest match among them, and its children by token
        token, level, count, first, longest, kids = [0], [0], [len(sources)], [0], [0], [{}]
        for k, p in enumerate(sources):
            node = 0
            for t in continuation(text, p, depth):
                child = kids[node].get(t)
                if child is None:
                    child = kids[node][t] = len(kids)
                    token.append(t)
                    level.append(level[node] + 1)
                    count.append(0)
                    first.append(k)
                    longest.append(0)
                    kids.append({})
                count[child] += 1
                if lengths[k] > longest[child]:
                    longest[child] = lengths[k]
                node = child
        guesses: list[Guess] = []
        todo = deque([(0, ROOT)])  # breadth first: the shallow guesses first, as `most` cuts
        while todo and len(guesses) < most:
            node, parent = todo.popleft()
            children = sorted(kids[node].values(), key=lambda c: (-count[c], first[c]))[:branches]
            for rank, child in enumerate(children):
                if len(guesses) >= most:
                    break
                guesses.append(Guess(token[child], parent, count[child] / count[node],
                                     longest[child] + level[child] - 1, rank))
                todo.append((child, len(guesses) - 1))
        return guesses


def _matched(text: list[int], p: int, n: int) -> int:
    """How far back the text before position p matches the text's end (at least the n tokens found, at most
    MATCHED): a copy under way for many tokens is likelier to go on than a fresh match."""
    end = len(text)
    while n < MATCHED and n < p and text[p - 1 - n] == text[end - 1 - n]:
        n += 1
    return n


def continuation(text: list[int], p: int, depth: int) -> list[int]:
    """The `depth` tokens from position p on; a copy that reaches the end of the text goes on copying what it
    copied (the text from p is then taken to repeat with period len(text) - p: a loop repeats whole)."""
    copied = list(text[p : p + depth])
    period = len(text) - p
    while len(copied) < depth:
        copied.append(copied[len(copied) - period])
    return copied
