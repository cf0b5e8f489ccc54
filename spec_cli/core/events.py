"""What decoding yields: the UI, the benchmark and the tests all consume these."""

from __future__ import annotations

from dataclasses import dataclass, field

ACCEPTED = "accepted"  # a speculative token the verifier kept
REJECTED = "rejected"  # a speculative token the verifier threw away (not part of the output)
CORRECTED = "corrected"  # the oracle's own token in place of a rejected one
BONUS = "bonus"  # the oracle's own token after every speculative token was kept (or when none was offered)


@dataclass(frozen=True, slots=True)
class Token:
    token: int
    kind: str
    stage: str  # who proposed it: "oracle", "draft", "draft2", "lookup", "trigram" or "heads"
    # where a completion asks for them (`Decoding.logprobs`), an output token's log-probability under the oracle
    # (its raw distribution: no temperature, no top-k or top-p), and the likeliest tokens' ((token, logprob), ...)
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()

    @property
    def output(self) -> bool:
        return self.kind != REJECTED


@dataclass(frozen=True, slots=True)
class Verified:
    """A verifier (the oracle, or the draft checking draft2) scored proposals in `forwards` forward passes."""

    verifier: str
    forwards: int
    proposed: int
    accepted: int


@dataclass(frozen=True, slots=True)
class Started:
    """A completion began: `prompt` tokens, of which the first `cached` were already in the oracle's cache."""

    prompt: int
    cached: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # "eos", "length" or "context"


Event = Started | Token | Verified | Finished


@dataclass
class Stats:
    """Counts folded from events; timing is the consumer's business."""

    new_tokens: int = 0
    forwards: dict[str, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    by_stage: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    prompt_tokens: int = 0  # the prompt tokens the oracle ran (not those it had cached)

    def add(self, event: Event) -> None:
        if isinstance(event, Started):
            self.prompt_tokens += event.prompt - event.cached
        elif isinstance(event, Token):
            if event.output:
                self.new_tokens += 1
                self.by_stage[event.stage] = self.by_stage.get(event.stage, 0) + 1
        elif isinstance(event, Verified):
            for table, value in ((self.forwards, event.forwards), (self.proposed, event.proposed),
                                 (self.accepted, event.accepted)):
                table[event.verifier] = table.get(event.verifier, 0) + value
        elif isinstance(event, Finished):
            self.finish_reason = event.reason

    def merge(self, other: "Stats") -> None:
        """Add another completion's counts (a chat session's total)."""
        self.new_tokens += other.new_tokens
        self.prompt_tokens += other.prompt_tokens
        for table, source in ((self.forwards, other.forwards), (self.proposed, other.proposed),
                              (self.accepted, other.accepted), (self.by_stage, other.by_stage)):
            for key, value in source.items():
                table[key] = table.get(key, 0) + value

    @property
    def oracle_forwards(self) -> int:
        return self.forwards.get("oracle", 0)

    @property
    def draft_forwards(self) -> int:
        return self.forwards.get("draft", 0)

    @property
    def tokens_per_oracle_forward(self) -> float:
        return self.new_tokens / self.oracle_forwards if self.oracle_forwards else 0.0

    def acceptance(self, verifier: str = "oracle") -> float | None:
        proposed = self.proposed.get(verifier, 0)
        return self.accepted.get(verifier, 0) / proposed if proposed else None

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "oracle_forwards": self.oracle_forwards,
            "forwards": dict(self.forwards),
            "proposed": dict(self.proposed),
            "accepted": dict(self.accepted),
            "acceptance": {v: self.acceptance(v) for v in self.proposed},
            "tokens_per_oracle_forward": round(self.tokens_per_oracle_forward, 4),
            "tokens_by_stage": dict(self.by_stage),
            "finish_reason": self.finish_reason,
        }
