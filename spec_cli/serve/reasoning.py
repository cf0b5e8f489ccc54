"""A reasoning model's thinking (Qwen3, DeepSeek-R1 and its distillations, QwQ, ...): the text between `<think>` and
`</think>` answered apart from the reply, as `reasoning_content`, as llama.cpp's server and vLLM answer it.

A model thinks when its chat template knows the closing tag (such templates drop the thinking of earlier turns).
Its reply thinks from the start when it begins with `<think>`, or when the prompt ends with it (templates that open
the block for the model); the thinking ends at `</think>`, or with the reply (cut short while thinking).
"""

from __future__ import annotations

from spec_cli.chat.templates import Template, source
from spec_cli.detok import overlap

OPEN, CLOSE = "<think>", "</think>"


def thinks(tokenizer, template: Template) -> bool:
    return CLOSE in source(tokenizer, template)


def opened(prompt_text: str) -> bool:
    """Whether the prompt leaves the model inside a thinking block."""
    return prompt_text.rstrip().endswith(OPEN)


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """(the thinking, or None where the reply does not think; the reply after it)."""
    stripped = text.lstrip()
    if stripped.startswith(OPEN):
        text, inside = stripped[len(OPEN):], True
    if not inside:
        return None, text
    reasoning, _, content = text.partition(CLOSE)
    return reasoning.strip(), content.lstrip()


class ReasoningStream:
    """A reply's text deltas in, (thinking, reply) pieces out as they settle: what may still be the opening tag at
    the start, or a part of the closing tag, waits for the text after it; so do the thinking's leading
    whitespace and the whitespace around the closing tag. The pieces add up to `split_reasoning`'s."""

    def __init__(self, inside: bool):
        self.text = ""
        self.inside = inside
        self.started = False  # whether the reply's start is settled (opening tag or not)
        self.thought = 0  # how much of the thinking went out (of the text after the opening tag)
        self.sent = 0  # how much of the reply went out (of the text after the closing tag)
        self.body = 0  # where the thinking starts in `text`
        self.closed = -1  # where the reply starts in `text` (-1: still thinking)

    def add(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        if not self.started:
            stripped = self.text.lstrip()
            if not final and (not stripped or OPEN.startswith(stripped)):
                return "", ""
            self.started = True
            if stripped.startswith(OPEN):
                self.inside, self.body = True, len(self.text) - len(stripped) + len(OPEN)
        if not self.inside:
            out, self.sent = self.text[self.sent:], len(self.text)
            return "", out
        if self.closed < 0:
            end = self.text.find(CLOSE, self.body)
            if end < 0:
                thinking = self.text[self.body:]
                settled = thinking if final else thinking[:len(thinking) - overlap(thinking, CLOSE)]
                return self._think(settled.strip() if final else settled.lstrip().rstrip()), ""
            self.closed = end + len(CLOSE)
            reasoning = self._think(self.text[self.body:end].strip())
        else:
            reasoning = ""
        reply = self.text[self.closed:].lstrip()
        out, self.sent = reply[self.sent:], len(reply)
        return reasoning, out

    def _think(self, settled: str) -> str:
        """The part of the settled thinking (stripped of leading whitespace) not yet sent."""
        out, self.thought = settled[self.thought:], max(self.thought, len(settled))
        return out

    def end(self) -> tuple[str, str]:
        return self.add("", final=True)
