"""What a chat reply's text holds, for every chat API (OpenAI's chat completions and responses, Anthropic's
messages): a reasoning model's thinking, the text, the tool calls; whole, or piece by piece as it streams."""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.serve.reasoning import ReasoningStream, split_reasoning
from spec_cli.serve.tools import Call, CallStream, read_calls


class Unanswerable(ValueError):
    """A chat request another API's route cannot take: (message, the parameter)."""


STEERED = ("tool_choice: only 'auto' and 'none' are supported (spec does not steer the model's text toward a call: "
           "it stays the model's own)")  # (a forced call: every API's answer)


@dataclass
class ChatReply:
    """How a chat reply's text is answered: the tools whose calls it may hold (None: no tools), whether a
    reasoning model's thinking goes apart, and (once the prompt is encoded) whether the prompt left the model
    thinking."""

    names: frozenset[str] | None = None
    thinking: bool = False
    inside: bool = False

    def whole(self, text: str) -> tuple[str | None, str, list[Call]]:
        """(the thinking, or None where it does not go apart; the text outside it and the calls; the calls)."""
        reasoning, text = split_reasoning(text, self.inside) if self.thinking else (None, text)
        text, calls = read_calls(text, self.names) if self.names else (text, [])
        return reasoning, text, calls

    def pieces(self) -> "ReplyPieces":
        return ReplyPieces(self)


class ReplyPieces:
    """A reply's text deltas in; (thinking, text) pieces out as they settle, and at the end what was held back
    and the calls. The pieces add up to `ChatReply.whole`'s (but for whitespace a reply with calls began with)."""

    def __init__(self, reply: ChatReply):
        self.thinking = ReasoningStream(reply.inside) if reply.thinking else None
        self.calls = CallStream(reply.names) if reply.names else None

    def add(self, delta: str) -> tuple[str, str]:
        reasoning, text = self.thinking.add(delta) if self.thinking else ("", delta)
        return reasoning, self.calls.add(text) if self.calls else text

    def end(self) -> tuple[str, str, list[Call]]:
        reasoning, text = self.thinking.end() if self.thinking else ("", "")
        if not self.calls:
            return reasoning, text, []
        text = self.calls.add(text)
        rest, calls = self.calls.end()
        return reasoning, text + rest, calls
