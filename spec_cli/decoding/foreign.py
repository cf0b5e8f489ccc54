"""Speculative decoding with a draft of another vocabulary (`Models.translator`: `models.translation`).

Each step the draft reads what it has not read of the text, in its own tokens, and proposes `draft_tokens` more
(greedily: its guesses are deterministic); the translator turns the text they spell into the oracle's tokens, and
the oracle verifies those in one forward as guesses of its own: greedily (or by coupled scores) while each is
its argmax, and when sampling by the one-hot rule (x kept with probability p(x), else the token drawn from p
without x). So the text is the oracle alone's, as with any draft. Afterwards the draft keeps the part of its cache
that still spells the text in its tokens (a word the oracle ended otherwise may re-tokenize what came before it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from spec_cli.core.events import Event, Verified
from spec_cli.core.settings import Decoding
from spec_cli.decoding import accept
from spec_cli.decoding.chain import (
    Models,
    Output,
    chain_events,
    oracle_first,
    pending,
    sampler_of,
)
from spec_cli.decoding.sampling import Draws, argmax


def speculative(models: Models, out: Output, settings: Decoding, draws: Draws) -> Iterator[Event]:
    oracle, draft, words = models.oracle, models.draft, models.translator
    sampler = sampler_of(settings)
    text = words.draft_ids(out.sequence)
    draft.reuse(text)
    oracle_tail = pending(oracle, out.sequence)
    while not out.reason:
        if len(oracle_tail) > oracle.room():
            return
        draft_tail = text[draft.committed:]
        k = min(settings.draft_tokens, draft.room() - len(draft_tail) + 1)
        proposed: list[int] = []
        if k > 0 and not oracle_first(len(oracle_tail), len(draft_tail)):
            logits = draft.forward(draft_tail, commit=len(draft_tail), last=1).logits[-1]
            tokens = []
            for i in range(k):
                tokens.append(argmax(logits, keepdim=True))
                if i < k - 1:
                    logits = draft.forward(tokens[-1], last=1).logits[-1]
            proposed = torch.cat(tokens).tolist()
            yield Verified("draft", k, 0, 0)
        room = min(out.remaining - 1, oracle.room() - len(oracle_tail))
        guesses = words.guesses(out.sequence, text[: draft.committed], proposed)[: max(room, 0)] if proposed else []
        m = len(guesses)
        chain = torch.tensor(list(oracle_tail) + guesses, dtype=torch.long, device=oracle.device)
        logits = oracle.forward(chain, commit=len(oracle_tail), last=m + 1).logits
        if sampler.greedy:
            verdict = accept.greedy_chain(logits, chain[len(oracle_tail):])
        else:  # the one-hot rule: a guess is a draw from a q that puts all its mass on it
            ps = sampler.probs(logits)
            qs = torch.zeros_like(ps[:-1]).scatter_(1, chain[len(oracle_tail):, None], 1.0)
            verdict = accept.sampled_chain(ps, qs, chain[len(oracle_tail):], draws)
        n, final = verdict.tolist()
        yield Verified("oracle", 1, m, n)
        oracle.keep(list(range(oracle.committed, oracle.committed + n)))
        oracle_tail = [final]
        yield from out.emit(chain_events(guesses, n, final))
        text = words.draft_ids(out.sequence)
        ran = proposed[: k - 1]  # (the draft ran all but its last proposal: in its cache, uncommitted)
        kept = _shared(ran, text[draft.committed:])
        draft.keep(list(range(draft.committed, draft.committed + kept)))
        draft.rewind(_shared(draft.tokens, text[:-1]))


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
