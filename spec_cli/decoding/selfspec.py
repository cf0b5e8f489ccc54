"""Self-speculative decoding (Draft & Verify, Zhang et al. 2023): the oracle drafts for itself.

The draft is the oracle with some attention and MLP sublayers skipped. It shares the oracle's cache: the
committed prefix holds full-model entries, which the draft reads (so accepted tokens are never re-run by
the draft); the draft's own tokens live in scratch slots (no entry at all in a skipped attention layer)
that the verifying full forward overwrites from the first one. Drafting stops early when the draft's
confidence falls under a threshold that adapts to the running acceptance rate.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from spec_cli.core.events import Event, Verified
from spec_cli.core.settings import Decoding
from spec_cli.decoding.chain import (
    Models,
    Output,
    _verify_chain,
    chain_events,
    pending,
    sampler_of,
)
from spec_cli.decoding.sampling import Draws, argmax

# Draft & Verify's defaults: acceptance smoothing, target acceptance, threshold step, threshold smoothing
B1, ALPHA, EPSILON, B2 = 0.5, 0.9, 0.01, 0.9


@dataclass
class ExitThreshold:
    """Adaptive draft exiting: stop drafting when the draft's top probability falls under `value`."""

    value: float
    adaptive: bool = True
    acceptance: float = ALPHA

    def update(self, proposed: int, accepted: int, hit_limit: bool) -> None:
        if not self.adaptive or proposed == 0:
            return
        self.acceptance = B1 * self.acceptance + (1 - B1) * accepted / proposed
        if self.acceptance < ALPHA:
            target = self.value + EPSILON  # too many rejections: draft less eagerly
        elif hit_limit:
            target = self.value  # the draft length cap, not the threshold, stopped this draft
        else:
            target = self.value - EPSILON
        self.value = min(1.0, max(0.0, B2 * self.value + (1 - B2) * target))


def self_speculative(models: Models, out: Output, settings: Decoding, draws: Draws,
                     greedy_draft: bool = False) -> Iterator[Event]:
    """Leviathan's chain with the oracle's own skipped-sublayer draft, in one shared cache.

    When sampling, the draft samples from its distribution q, or with `greedy_draft` takes its argmax
    (then q is one-hot: accept with probability p(x), else resample from p with x removed).
    """
    runner, skip = models.oracle, models.self_skip
    sampler = sampler_of(settings)
    threshold = ExitThreshold(settings.self_threshold, settings.self_adaptive)
    while not out.reason:
        tail = pending(runner, out.sequence)
        if len(tail) > runner.room():
            return
        if len(tail) > 1:  # the prompt (or a resumed conversation): the full model commits all but the last
            runner.forward(tail[:-1], commit=len(tail) - 1, last=1)
            yield Verified("oracle", 1, 0, 0)
            tail = tail[-1:]
        limit = min(settings.draft_tokens, out.remaining - 1, runner.room() - 1)
        proposals: list[int] = []
        qs: list[torch.Tensor] = []
        if limit > 0:
            logits = runner.forward(tail, last=1, skip=skip).logits[-1]
            forwards = 1
            while True:
                if sampler.greedy or greedy_draft:
                    token = int(argmax(logits))
                    confidence = float(torch.softmax(logits, -1)[token])
                    if not sampler.greedy:
                        qs.append(_one_hot(token, logits))
                else:
                    q = sampler.probs(logits)
                    token = draws.sample(q)
                    confidence = float(q.max())
                    qs.append(q)
                proposals.append(token)
                if len(proposals) == limit or confidence < threshold.value:
                    break
                logits = runner.forward([token], last=1, skip=skip).logits[-1]
                forwards += 1
            yield Verified("draft", forwards, 0, 0)
            runner.keep([])  # the draft's entries are scratch: the full forward overwrites those slots

        k = len(proposals)
        result = runner.forward(tail + proposals, commit=1, last=k + 1)
        n, final = _verify_chain(result.logits, proposals, qs, sampler, draws)
        yield Verified("oracle", 1, k, n)
        threshold.update(k, n, k == limit)
        runner.keep(list(range(runner.committed, runner.committed + n)))
        yield from out.emit(chain_events(proposals, n, final), out.decided(result, list(range(n + 1))))


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
