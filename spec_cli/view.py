"""Showing a completion as it is decided: Rich colours on a terminal, plain text anywhere else."""

from __future__ import annotations

import contextlib
import os
import sys

from rich.console import Console
from rich.text import Text

from spec_cli.detok import Detokenizer
from spec_cli.events import ACCEPTED, REJECTED, Event, Stats, Token

STYLES = {ACCEPTED: "green", REJECTED: "red strike", "oracle": "blue"}
STAGE_STYLES = {"draft2": "bold green"}


def legend(draft2: bool = False) -> Text:
    text = Text("  ")
    text.append("accepted draft token", style=STYLES[ACCEPTED])
    text.append("  ")
    if draft2:
        text.append("accepted, guessed by draft2", style=STAGE_STYLES["draft2"])
        text.append("  ")
    text.append("rejected draft token", style=STYLES[REJECTED])
    text.append("  ")
    text.append("oracle's own token", style=STYLES["oracle"])
    return text


class TokenView:
    """Consumes events; writes the completion to stdout, coloured when stdout is a colour terminal."""

    def __init__(self, tokenizer, prompt: list[int], stream=None, color: bool | None = None):
        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True)
        if color is None:
            color = self.console.is_terminal and not os.environ.get("NO_COLOR") and not self.console.no_color
        self.color = color
        self.detok = Detokenizer(tokenizer, prompt)
        self.pieces: list[tuple[str, Token]] = []

    def start(self, title: str = "", draft2: bool = False) -> None:
        if self.color:
            line = Text(title + "\n", style="dim") if title else Text()
            line.append_text(legend(draft2))
            self.console.print(line, style="dim")

    def add(self, event: Event) -> None:
        if not isinstance(event, Token):
            return
        if event.kind == REJECTED:
            if self.color:
                self._write(self.detok.peek(event.token), STYLES[REJECTED])
            return
        text = self.detok.add(event.token)
        self.pieces.append((text, event))
        style = STYLES[ACCEPTED] if event.kind == ACCEPTED else STYLES["oracle"]
        if event.kind == ACCEPTED and event.stage in STAGE_STYLES:
            style = STAGE_STYLES[event.stage]
        self._write(text, style)

    def _write(self, text: str, style: str) -> None:
        if not text:
            return
        if self.color:
            self.console.print(Text(text, style=style), end="")
        else:
            self.stream.write(text)
            self.stream.flush()

    def finish(self) -> None:
        if self.color:
            self.console.print()
        else:
            self.stream.write("\n")
            self.stream.flush()

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


def summary(stats: Stats, seconds: float) -> str:
    rate = stats.new_tokens / seconds if seconds > 0 else 0.0
    parts = [
        f"{stats.new_tokens} tokens in {seconds:.2f} s",
        f"{rate:.1f} tok/s",
        f"{stats.oracle_forwards} oracle forwards",
        f"{stats.tokens_per_oracle_forward:.2f} tokens/forward",
    ]
    if stats.draft_forwards:
        parts.append(f"{stats.new_tokens / stats.draft_forwards:.2f} tokens/draft forward")
    for verifier, label in (("oracle", "draft"), ("draft", "draft2")):
        acceptance = stats.acceptance(verifier)
        if acceptance is not None:
            parts.append(f"{label} acceptance {acceptance:.0%}")
    if stats.finish_reason and stats.finish_reason != "length":
        parts.append(f"stopped: {stats.finish_reason}")
    return " · ".join(parts)


def loading(console: Console, name: str):
    """A spinner while a profile's models load: on a terminal only."""
    return console.status(f"loading {name}…") if console.is_terminal else contextlib.nullcontext()
