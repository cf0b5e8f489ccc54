"""The chain strategies (baseline, speculative) and what every strategy shares. No tokenizer, no UI.

`spec_cli.decoding.methods` picks a strategy by name; `tree` (staged) and `selfspec` (self) build on this module.

Every runner keeps the committed sequence in its cache except a pending tail (at least the last token);
each step feeds that tail first, so a model that skipped a token (the draft never runs its own last
proposal) catches up for free in its next forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from spec_cli.core.events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    REJECTED,
    Event,
    Token,
    Verified,
)
from spec_cli.core.families import Skip
from spec_cli.core.settings import Decoding
from spec_cli.decoding import accept, learned
from spec_cli.decoding.sampling import Draws, Sampler, argmax, verify_candidates
from spec_cli.draft2.ngram import Drafter
from spec_cli.exec import Forward, Runner

# a draft reads at most this much of a prompt (`Runner.window`; a draft of another vocabulary, the text's): its last
# tokens. The Qwen 0.5B read a 4,000-token prompt in ~11 s, more than its guesses then saved over 128 tokens (staged
# 0.77x baseline end to end; with 512: 1.06x, 3.4 tokens an oracle forward against 3.8: benchmarks/reports/
# draft-window-xeon-session34.txt)
DRAFT_READS = 512
READ_FIRST = 32  # the most new text a step speculates over with a draft that has not read it (`oracle_first`)


def oracle_first(oracle_tail: int, draft_tail: int) -> bool:
    """Whether a step is the oracle's alone because it reads new text (a prompt, a chat's next message) of which
    the draft would first read more than READ_FIRST tokens (speculative and staged): the first token comes without
    waiting for the draft's read (the next step's), at the price of that one step's speculation (the real pair,
    staged, HumanEval 60-67 and 90-97: first token 27-31% sooner, the whole within 2.5% either way). A short
    text's read is about one draft forward: speculated as every step is."""
    return oracle_tail > 1 and draft_tail > READ_FIRST


@dataclass
class Output:
    """The tokens decided so far, and when to stop."""

    sequence: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    produced: int = 0
    reason: str | None = None
    logprobs: int | None = None  # `Decoding.logprobs`

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.produced

    def decided(self, result: Forward, rows: list[int]) -> torch.Tensor | None:
        """A forward's logits at `rows` (the rows the step's output tokens were decided from, for `emit`), as
        the oracle gave them (not coupled sampling's scores), copied (a later forward's output may reuse their
        memory: a captured graph's); None where the completion asks for no log-probabilities."""
        if self.logprobs is None:
            return None
        return (result.logits if result.raw is None else result.raw)[rows]

    def emit(self, events: list[Token], rows: torch.Tensor | None = None) -> Iterator[Token]:
        """Yield a step's events in order, appending output tokens, up to EOS or the token limit. `rows`: the
        oracle's logits each output token was decided from, in order (for `logprobs`)."""
        if self.logprobs is not None and rows is not None:
            events = with_logprobs(events, rows, self.logprobs)
        for event in events:
            if self.reason:
                return
            yield event
            if event.output:
                self.sequence.append(event.token)
                self.produced += 1
                if event.token in self.eos:
                    self.reason = "eos"
                elif self.produced >= self.max_new_tokens:
                    self.reason = "length"


def with_logprobs(events: list[Token], rows: torch.Tensor, top: int) -> list[Token]:
    """The events with each output token's log-probability under its row of logits, and the `top` likeliest
    tokens' (one host read)."""
    outputs = [e.token for e in events if e.output]
    logprobs = torch.log_softmax(rows[: len(outputs)].float(), -1)
    chosen = logprobs.gather(1, torch.tensor(outputs, device=logprobs.device)[:, None])[:, 0]
    best = logprobs.topk(top, -1)  # (top 0: empty rows)
    chosen, values, indices = chosen.tolist(), best.values.tolist(), best.indices.tolist()
    found, k = [], 0
    for e in events:
        if e.output:
            e = Token(e.token, e.kind, e.stage, chosen[k], tuple(zip(indices[k], values[k])))
            k += 1
        found.append(e)
    return found


def sampler_of(settings: Decoding) -> Sampler:
    """How a completion turns logits into tokens."""
    return Sampler(settings.temperature, settings.top_k, settings.top_p, settings.coupled)


@dataclass
class Models:
    oracle: Runner
    draft: Runner | None = None
    draft2: Drafter | None = None
    eos: frozenset[int] = field(default_factory=frozenset)
    self_skip: Skip | None = None  # the oracle's own sublayers a self-draft leaves out (method "self")
    translator: object | None = None  # a draft of another vocabulary: `models.translation.Translator`
    heads: object | None = None  # heads fitted on a model alone, guessing from its state: `draft2.heads.Heads`
    # staged's run-time controllers, one per way of decoding (an engine's outlive its completions)
    controllers: dict = field(default_factory=learned.Controllers)


def pending(runner: Runner, sequence: list[int]) -> list[int]:
    """What the runner's cache does not hold yet of `sequence` (a windowed draft's holds it from its `base`)."""
    return sequence[runner.base + runner.committed :]


def pick(logits: torch.Tensor, sampler: Sampler, draws: Draws) -> torch.Tensor:
    """The next token [1] from one row of logits, on the device: the argmax, or a draw from p."""
    if sampler.greedy:
        return argmax(logits, keepdim=True)
    return draws.sample_rows(sampler.probs(logits)[None])


def baseline(models: Models, out: Output, settings: Decoding, draws: Draws) -> Iterator[Event]:
    """The oracle alone, one token per forward: the reference every other method must reproduce. Each token
    goes back in from the device; reading it for the event is the step's one host read. Where the device queues
    forwards (`Runner.queues`), the next one is queued before that read: the host's work overlaps it."""
    oracle = models.oracle
    sampler = sampler_of(settings)
    tail, token = pending(oracle, out.sequence), None
    while not out.reason:
        if token is None:
            if len(tail) > oracle.room():
                return
            result = oracle.forward(tail, commit=len(tail), last=1)
            token, row = pick(result.logits[-1], sampler, draws), out.decided(result, [-1])
        following = ahead(oracle, token, out, sampler, draws) if getattr(oracle, "queues", False) else None
        yield Verified("oracle", 1, 0, 0)
        yield from out.emit([Token(int(token), BONUS, "oracle")], row)
        tail, (token, row) = token, following or (None, None)


def ahead(oracle, token: torch.Tensor, out: Output, sampler: Sampler,
          draws: Draws) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The token after `token` (on the device, not read yet) and the logits it comes from ([1, V]), its forward
    queued now where the completion may go on; None where it cannot. Should the completion stop at `token` after
    all, that forward only committed `token`, which the sequence holds: the cache stays a prefix of it."""
    if out.remaining > 1 and oracle.room() > 0:
        result = oracle.forward(token, commit=1, last=1)
        return pick(result.logits[-1], sampler, draws), out.decided(result, [-1])
    return None


def speculative(models: Models, out: Output, settings: Decoding, draws: Draws) -> Iterator[Event]:
    """Leviathan et al.: the draft proposes a chain, the oracle scores it in one forward. The chain stays on
    the device from the draft's first forward to the oracle's verdict, read back once per step."""
    oracle, draft = models.oracle, models.draft
    sampler = sampler_of(settings)
    tails = {oracle: pending(oracle, out.sequence), draft: pending(draft, out.sequence)}
    while not out.reason:
        oracle_tail, draft_tail = tails[oracle], tails[draft]
        if len(oracle_tail) > oracle.room():
            return
        k = min(
            settings.draft_tokens,
            out.remaining - 1,
            oracle.room() - len(oracle_tail),
            draft.room() - len(draft_tail) + 1,
        )
        if oracle_first(len(oracle_tail), len(draft_tail)):
            k = 0
        proposals, qs = [], []
        if k > 0:
            logits = draft.forward(draft_tail, commit=len(draft_tail), last=1).logits[-1]
            for i in range(k):
                if not sampler.greedy:
                    qs.append(sampler.probs(logits))
                proposals.append(pick(logits, sampler, draws) if sampler.greedy else
                                 draws.sample_rows(qs[-1][None]))
                if i < k - 1:
                    logits = draft.forward(proposals[-1], last=1).logits[-1]
            yield Verified("draft", k, 0, 0)
        chain = torch.cat([_on(oracle_tail, oracle.device)] + proposals)
        result = oracle.forward(chain, commit=len(oracle_tail), last=k + 1)
        logits = result.logits
        if k == 0:
            verdict = torch.stack([torch.zeros((), dtype=torch.long, device=oracle.device),
                                   pick(logits[-1], sampler, draws)[0]])
        elif sampler.greedy:
            verdict = accept.greedy_chain(logits, chain[-k:])
        else:
            verdict = accept.sampled_chain(sampler.probs(logits), torch.stack(qs), chain[-k:], draws)
        read = torch.cat([chain[-k:] if k else chain[:0], verdict]).tolist()  # the step's one host read
        drafted, n, final = read[:k], read[k], read[k + 1]
        yield Verified("oracle", 1, k, n)

        oracle.keep(list(range(oracle.committed, oracle.committed + n)))
        if k > 0:
            draft.keep(list(range(draft.committed, draft.committed + min(n, k - 1))))
        last = verdict[1:]
        if k == 0:  # the draft did not run: its tail grows
            tails = {oracle: last, draft: torch.cat([_on(draft_tail, draft.device), last])}
        else:
            tails = {oracle: last, draft: torch.cat([chain[-1:], last]) if n == k else last}
        yield from out.emit(chain_events(drafted, n, final), out.decided(result, list(range(n + 1))))


def _on(tokens: list[int] | torch.Tensor, device) -> torch.Tensor:
    """Tokens as a tensor on the device (an upload only when the host has them: the prompt)."""
    return tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long, device=device)


def chain_events(proposals: list[int], accepted: int, final: int, stage: str = "draft") -> list[Token]:
    """A verified chain as events: the accepted proposals, the first rejected one (`stage` proposed them), the
    oracle's token."""
    events = [Token(t, ACCEPTED, stage) for t in proposals[:accepted]]
    if accepted < len(proposals):
        events.append(Token(proposals[accepted], REJECTED, stage))
    events.append(Token(final, CORRECTED if accepted < len(proposals) else BONUS, "oracle"))
    return events


def _verify_chain(logits, proposals, qs, sampler, draws: Draws) -> tuple[int, int]:
    """(number of proposals accepted, the oracle's token after them)."""
    if sampler.greedy:
        targets = argmax(logits).tolist()
        n = 0
        while n < len(proposals) and proposals[n] == targets[n]:
            n += 1
        return n, targets[n]
    ps = sampler.probs(logits)
    for i, x in enumerate(proposals):
        accepted, residual = verify_candidates(ps[i], [x], "iid", draws, qs[i])
        if accepted is None:
            return i, draws.sample(residual)
    return len(proposals), draws.sample(ps[len(proposals)])
