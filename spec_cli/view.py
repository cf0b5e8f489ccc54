"""Showing a completion as it is decided: Rich colours on a terminal, plain text anywhere else."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from spec_cli.core.events import ACCEPTED, REJECTED, Event, Token
from spec_cli.detok import Detokenizer, released

STYLES = {ACCEPTED: "green", REJECTED: "red strike", "oracle": "blue"}
STAGE_STYLES = {"draft2": "bold green", "lookup": "bold green", "trigram": "bold green", "heads": "bold green"}


def legend(draft2: bool = False, copied: bool = False) -> Text:
    text = Text("  ")
    text.append("accepted draft token", style=STYLES[ACCEPTED])
    text.append("  ")
    if draft2 or copied:
        by = " or ".join(["guessed by draft2"] * draft2 + ["copied from the text"] * copied)
        text.append(f"accepted, {by}", style=STAGE_STYLES["draft2"])
        text.append("  ")
    text.append("rejected draft token", style=STYLES[REJECTED])
    text.append("  ")
    text.append("oracle's own token", style=STYLES["oracle"])
    return text


def make_console(stderr: bool = False, file=None) -> Console:
    """A Console for our output; with NO_COLOR set it writes no escape codes at all (not even dim or bold)."""
    plain = bool(os.environ.get("NO_COLOR"))
    return Console(file=file, stderr=stderr, highlight=False, soft_wrap=True,
                   **({"color_system": None, "no_color": True} if plain else {}))


def fancy(console: Console) -> bool:
    """Whether to draw colours, spinners and live views: a terminal, and NO_COLOR not set."""
    return console.is_terminal and not console.no_color and console.color_system is not None \
        and not os.environ.get("NO_COLOR")


_PICTURES = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {127: 0x2421}


def visible(text: str) -> str:
    """Control characters (an escape byte a model wrote, say) as their visible pictures (␛), so that output
    on a terminal never moves the cursor or changes colours by itself."""
    return text.translate(_PICTURES)


WINDOW = 6  # lines the live view keeps redrawable (with their rejected candidates) before printing them clean


class Screen:
    """Where a completion's text goes.

    - Not a colour terminal: the output text as it comes (with `trace`, rejected candidates as [-text-]).
    - A colour terminal with `trace`: every token inline, rejected candidates red and struck through.
    - A colour terminal: a live window over the last few lines shows the rejected candidates where they
      were made; a line leaving the window, and the whole window when the completion ends, is printed
      clean (accepted green, the oracle's blue), so the finished screen holds just the completion.
    """

    def __init__(self, console: Console, color: bool, trace: bool = False, window: int = WINDOW):
        self.console, self.color, self.trace, self.window = console, color, trace, window
        self.live = None
        self.lines: list[list[tuple[str, str, bool]]] = [[]]  # the window: (text, style, is_output) per line

    @property
    def windowed(self) -> bool:
        return self.color and not self.trace

    def start(self, prefix: str = "", style: str = "dim") -> None:
        """Begin, after `prefix` (the prompt, shown dim on a colour terminal)."""
        if not self.color:
            return
        prefix = visible(prefix)
        head, newline, tail = prefix.rpartition("\n")
        if not self.windowed:
            self.console.print(Text(prefix, style=style), end="")
            return
        if newline:
            self.console.print(Text(head, style=style))
        if tail:
            self.lines[-1].append((tail, style, True))
        from rich.live import Live

        self.live = Live(self._render(), console=self.console, auto_refresh=False, transient=True,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def output(self, text: str, style: str) -> None:
        if not text:
            return
        if not self.color:  # a terminal still gets no control characters from the model, NO_COLOR or not
            self.console.file.write(visible(text) if self.console.is_terminal else text)
            self.console.file.flush()
            return
        text = visible(text)
        if not self.windowed:
            self.console.print(Text(text, style=style), end="")
        else:
            first, *rest = text.split("\n")
            self.lines[-1].append((first, style, True))
            for line in rest:
                self.lines.append([(line, style, True)])
            self._scroll()

    def rejected(self, text: str) -> None:
        if not text:
            return
        if not self.color:
            if self.trace:
                self.console.file.write(f"[-{visible(text) if self.console.is_terminal else text}-]")
                self.console.file.flush()
        elif not self.windowed:
            self.console.print(Text(visible(text), style=STYLES[REJECTED]), end="")
        else:
            self.lines[-1].append((visible(text.replace("\n", "\u21b5")), STYLES[REJECTED], False))
            self._scroll()

    def _scroll(self) -> None:
        """Print the lines that leave the window, clean, above it; redraw the window."""
        if self.live is None:
            return
        width = max(self.console.width, 1)
        limit = max(1, min(self.window, self.console.height - 2))
        while len(self.lines) > 1 and (len(self.lines) > limit or self._rows(width) > max(1, self.console.height - 2)):
            self.live.console.print(self._clean(self.lines.pop(0)))
        self.live.update(self._render(), refresh=True)

    def _rows(self, width: int) -> int:
        return sum(max(1, -(-Text("".join(t for t, _, _ in line)).cell_len // width)) for line in self.lines)

    def _render(self) -> Text:
        text = Text()
        for i, line in enumerate(self.lines):
            if i:
                text.append("\n")
            for piece, style, _ in line:
                text.append(piece, style=style)
        return text

    @staticmethod
    def _clean(line) -> Text:
        text = Text()
        for piece, style, output in line:
            if output:
                text.append(piece, style=style)
        return text

    def close(self) -> None:
        """The completion ended: leave the clean text and end its line."""
        if not self.color:
            self.console.file.write("\n")
            self.console.file.flush()
        elif not self.windowed:
            self.console.print()
        else:
            if self.live is not None:
                self.live.stop()
                self.live = None
            clean = Text("\n").join(self._clean(line) for line in self.lines)
            self.console.print(clean)
            self.lines = [[]]


class TokenView:
    """Consumes events; writes the completion to stdout, coloured and live on a colour terminal. With `stops`, what
    may be the start of one is held back until it cannot be, and the completion ends before the first (`stopped`);
    with `strip`, leading and trailing whitespace are held back too (a chat reply), so what is shown is what is
    kept."""

    def __init__(self, tokenizer, prompt: list[int], stream=None, color: bool | None = None, trace: bool = False,
                 stops: Sequence[str] = (), strip: bool = False):
        self.stream = stream or sys.stdout
        self.console = make_console(file=self.stream)
        self.color = fancy(self.console) if color is None else color
        self.screen = Screen(self.console, self.color, trace)
        self.detok = Detokenizer(tokenizer, prompt)
        self.text = ""  # the output's text so far
        self.stops, self.strip = [s for s in stops if s], strip
        self._longest = max(map(len, self.stops), default=0)
        self.stopped = False  # a stop string came: nothing more is shown
        self._queue: list[list] = []  # [text, style, is_output] not yet written (held back)
        self._start = 0  # offset in self.text of the first queued output text
        self._shown = False  # whether any output text is on the screen yet

    def start(self, title: str = "", draft2: bool = False, prompt: str = "", copied: bool = False) -> None:
        if self.color:
            line = Text(title + "\n", style="dim") if title else Text()
            line.append_text(legend(draft2, copied))
            self.console.print(line, style="dim")
        self.screen.start(prompt)

    def add(self, event: Event) -> None:
        if self.stopped or not isinstance(event, Token):
            return
        if event.kind == REJECTED:
            self._write(self.detok.peek(event.token), STYLES[REJECTED], False)
        else:
            text = self.detok.add(event.token)
            self.text += text
            style = STYLES[ACCEPTED] if event.kind == ACCEPTED else STYLES["oracle"]
            if event.kind == ACCEPTED and event.stage in STAGE_STYLES:
                style = STAGE_STYLES[event.stage]
            self._write(text, style, True)
        if self._held:
            self._flush()

    @property
    def _held(self) -> bool:
        return bool(self.stops) or self.strip

    def _write(self, text: str, style: str, output: bool = True) -> None:
        if not self._held:
            self._show(text, style, output)
        elif text:
            self._queue.append([text, style, output])

    def _show(self, text: str, style: str, output: bool) -> None:
        if output:
            self.screen.output(text, style)
        else:
            self.screen.rejected(text)

    def _flush(self, final: bool = False) -> None:
        full = self.text
        end, self.stopped = released(full, self.stops, max(0, self._start - self._longest), final)
        if self.strip:
            end = len(full[:end].rstrip())
        begin = 0
        if self.strip:  # (nothing but whitespace yet: none of it shown)
            begin = len(full) - len(full.lstrip()) if full.strip() else len(full)
        while self._queue:
            text, style, is_output = self._queue[0]
            if not is_output:  # a rejected proposal, shown where it was made
                self._show(text if self._shown or not self.strip else text.lstrip(), style, False)
                self._queue.pop(0)
                continue
            a, b = max(self._start, begin), min(self._start + len(text), end)
            if b > a:
                self._show(text[a - self._start : b - self._start], style, True)
                self._shown = True
            if self._start + len(text) <= end:
                self._start += len(text)
                self._queue.pop(0)
            else:
                if b > self._start:
                    self._queue[0][0] = text[b - self._start :]
                    self._start = b
                break
        if self.stopped:
            self._queue.clear()

    def finish(self) -> None:
        if self._held and not self.strip:
            self._flush(final=True)  # (the end: what might have begun a stop string is text after all)
        self.screen.close()

    @property
    def completion(self) -> str:
        """The text up to the first stop string (all of it where none came)."""
        text = self.text
        cuts = [cut for stop in self.stops if (cut := text.find(stop)) >= 0]
        return text[: min(cuts)] if cuts else text


def summary(done, load_seconds: float | None = None, memory: tuple[str, int] | None = None,
            compile_seconds: float | None = None, weights: dict | None = None) -> str:
    """The statistics line of a Completion: speed overall, of the prompt and of generation; the oracle's
    forwards and acceptance; and, when given, the load time, the compile time, the weights and peak memory."""
    stats = done.stats
    parts = [f"{stats.new_tokens} tokens in {done.seconds:.2f} s", f"{done.tokens_per_second:.1f} tok/s"]
    prompt_rate, generation_rate = done.prompt_tokens_per_second, done.generation_tokens_per_second
    if prompt_rate is not None:
        plural = "s" * (stats.prompt_tokens != 1)
        parts.append(f"prompt {stats.prompt_tokens} token{plural} at {prompt_rate:.0f} tok/s")
    if generation_rate is not None:
        parts.append(f"generation {generation_rate:.1f} tok/s")
    parts += [f"{stats.oracle_forwards} oracle forwards", f"{stats.tokens_per_oracle_forward:.2f} tokens/forward"]
    if stats.draft_forwards:
        parts.append(f"{stats.new_tokens / stats.draft_forwards:.2f} tokens/draft forward")
    for verifier, label in (("oracle", "draft" if stats.draft_forwards else "guess"), ("draft", "draft2")):
        acceptance = stats.acceptance(verifier)
        if acceptance is not None:
            parts.append(f"{label} acceptance {acceptance:.0%}")
    if stats.finish_reason and stats.finish_reason != "length":
        parts.append(f"stopped: {stats.finish_reason}")
    if load_seconds is not None:
        parts.append(f"load {load_seconds:.2f} s")
    if compile_seconds is not None:
        parts.append(f"compile {compile_seconds:.2f} s")
    if weights is not None:
        parts.append(f"weights {weights['format']} {size(weights['bytes'])}" + placed(weights.get("placement")))
    if memory is not None:
        parts.append(f"peak {memory[0]} {size(memory[1])}")
    return " · ".join(parts)


def placed(placement: dict | None) -> str:
    """Where an offloaded oracle's layers went: ' (layers: 3 cpu, 5 disk)'."""
    if not placement:
        return ""
    return " (layers: " + ", ".join(f"{count} {place}" for place, count in placement.items()) + ")"


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"  # pragma: no cover


def loading(console: Console, name: str):
    """A spinner while a profile's models load: on a colour terminal only."""
    return console.status(f"loading {name}…") if fancy(console) else contextlib.nullcontext()
