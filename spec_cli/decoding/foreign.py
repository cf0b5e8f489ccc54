"""Speculative decoding with a draft of another vocabulary (`Models.translator`: `models.translation`).

Each step the draft reads what it has not read of the text, in its own tokens, and proposes up to
`draft_tokens` more (greedily: its guesses are deterministic); the translator turns the text they spell into the
oracle's tokens, and the oracle verifies those in one forward as guesses of its own: greedily (or by coupled
scores) while each is its argmax, and when sampling by the one-hot rule (x kept with probability p(x), else the
token drawn from p without x). So the text is the oracle alone's, as with any draft. Afterwards the draft keeps
the part of its cache that still spells the text in its tokens (a word the oracle ended otherwise may
re-tokenize what came before it); it reads the text only on the steps it runs in.

Where the text repeats itself (its last `COPIED` tokens or more occurred before: `draft2.lookup`), the step
verifies what followed them instead, and the draft does not run. How many tokens the draft proposes is `Pace`'s
choice, from what its guesses and forwards have been worth so far; when none pays, steps are the oracle's alone,
with a probe now and then (`tree_adaptive`; without it, `draft_tokens` every step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from spec_cli.core.events import Event, Verified
from spec_cli.core.settings import Decoding
from spec_cli.decoding import accept
from spec_cli.decoding import chain as decoding
from spec_cli.decoding.chain import (
    Models,
    Output,
    chain_events,
    oracle_first,
    pending,
    sampler_of,
)
from spec_cli.decoding.sampling import Draws, argmax
from spec_cli.draft2.lookup import Index
from spec_cli.exec.prefixes import shared

COPIED = 3  # the shortest match of the text's end with an earlier place whose continuation is verified instead


class Pace:
    """The draft's chain length: the one that brings the most tokens an oracle forward's worth of time, from the
    share of its guesses the oracle kept (counts that fade, so a change of text shows) and a draft forward's
    time against the oracle's; 0 (a plain step) when none beats the oracle alone by 5%, with a probe of 2 every
    `PROBE` plain steps so that a draft that starts to agree is seen (twice as seldom after each probe that kept
    nothing, up to every `SELDOM`)."""

    PROBE, SELDOM = 8, 64
    FADE = 0.9

    def __init__(self, most: int):
        self.most = most
        self.kept, self.missed = 2.0, 1.0  # (a start: two in three kept)
        self.draft_seconds = self.oracle_seconds = None  # a draft forward's, an oracle forward's (fading means)
        self.plain = 0  # plain steps in a row
        self.every, self.probing = self.PROBE, False  # plain steps between probes; whether this step is one

    def length(self) -> int:
        if self.most < 1:
            return 0
        a = self.kept / (self.kept + self.missed)
        ratio = (self.draft_seconds / self.oracle_seconds) if self.draft_seconds and self.oracle_seconds else 0.1
        best, best_rate = 0, 1.05  # a plain step: one token an oracle forward
        for k in range(1, self.most + 1):
            rate = sum(a ** i for i in range(k + 1)) / (1 + ratio * k)
            if rate > best_rate:
                best, best_rate = k, rate
        self.probing = False
        if best == 0:
            self.plain += 1
            if self.plain >= self.every:
                self.plain, self.probing = 0, True
                return min(2, self.most)
        else:
            self.plain = 0
        return best

    def judge(self, guessed: int, kept: int) -> None:
        self.kept = self.FADE * self.kept + kept
        self.missed = self.FADE * self.missed + (kept < guessed)
        if self.probing:
            self.every = min(2 * self.every, self.SELDOM) if kept == 0 else self.PROBE

    def timed(self, draft_forwards: int, draft_seconds: float, oracle_seconds: float) -> None:
        def fade(mean, value):
            return value if mean is None else self.FADE * mean + (1 - self.FADE) * value

        if draft_forwards:
            self.draft_seconds = fade(self.draft_seconds, draft_seconds / draft_forwards)
        self.oracle_seconds = fade(self.oracle_seconds, oracle_seconds)


def speculative(models: Models, out: Output, settings: Decoding, draws: Draws) -> Iterator[Event]:
    oracle, draft, words = models.oracle, models.draft, models.translator
    sampler = sampler_of(settings)
    pace = Pace(settings.draft_tokens) if settings.tree_adaptive else None  # (else draft_tokens a step)
    index = Index()
    start = max(0, len(out.sequence) - decoding.DRAFT_READS)  # the draft reads the text from here (a long prompt's end)
    draft.reuse(words.draft_ids(out.sequence[start:]))
    ran: list[int] = []  # the draft's last proposals it ran: in its cache, uncommitted until it reads the text
    oracle_tail = pending(oracle, out.sequence)
    while not out.reason:
        if len(oracle_tail) > oracle.room():
            return
        room = max(0, min(out.remaining - 1, oracle.room() - len(oracle_tail)))
        guesses = _copied(index, out.sequence, min(room, settings.tree_depth)) if settings.lookup else []
        proposed, k = [], 0
        started = time.perf_counter()
        wanted = (pace.length() if pace else settings.draft_tokens) if room and not guesses else 0
        if wanted:  # the draft reads the text in its words: what it proposed and the text kept, it keeps
            text = words.draft_ids(out.sequence[start:], draft.tokens)
            draft.keep(list(range(draft.committed, draft.committed + shared(ran, text[draft.committed:]))))
            draft.name(text)  # (the proposals it kept were known on the device only)
            draft.rewind(shared(draft.tokens, text[:-1]))
            ran, draft_tail = [], text[draft.committed:]
            if not oracle_first(len(oracle_tail), len(draft_tail)):
                k = min(wanted, draft.room() - len(draft_tail) + 1)
        if k > 0:
            logits = draft.forward(draft_tail, commit=len(draft_tail), last=1).logits[-1]
            tokens = []
            for i in range(k):
                tokens.append(argmax(logits, keepdim=True))
                if i < k - 1:
                    logits = draft.forward(tokens[-1], last=1).logits[-1]
            proposed = torch.cat(tokens).tolist()
            ran = proposed[: k - 1]  # (all but its last)
            yield Verified("draft", k, 0, 0)
            guesses = words.guesses(out.sequence, text, proposed)[:room]
        drafted = time.perf_counter()
        m = len(guesses)
        chain = torch.tensor(list(oracle_tail) + guesses, dtype=torch.long, device=oracle.device)
        result = oracle.forward(chain, commit=len(oracle_tail), last=m + 1)
        logits = result.logits
        if sampler.greedy:
            verdict = accept.greedy_chain(logits, chain[len(oracle_tail):])
        else:  # the one-hot rule: a guess is a draw from a q that puts all its mass on it
            ps = sampler.probs(logits)
            qs = torch.zeros_like(ps[:-1]).scatter_(1, chain[len(oracle_tail):, None], 1.0)
            verdict = accept.sampled_chain(ps, qs, chain[len(oracle_tail):], draws)
        n, final = verdict.tolist()
        if pace:
            pace.timed(k, drafted - started, time.perf_counter() - drafted)
            if k:
                pace.judge(m, n)
        yield Verified("oracle", 1, m, n)
        oracle.keep(list(range(oracle.committed, oracle.committed + n)))
        oracle_tail = [final]
        yield from out.emit(chain_events(guesses, n, final, "draft" if k else "lookup"),
                            out.decided(result, list(range(n + 1))))


def _copied(index: Index, sequence: list[int], room: int) -> list[int]:
    """What followed the latest place the text's end occurred before, where at least COPIED tokens of it did."""
    index.extend(sequence)
    chain = index.guess(sequence, room, 1, room) if room else []
    return [g.token for g in chain] if chain and chain[0].match >= COPIED else []

