"""A chat reply on screen: streamed like `spec generate`, holding back what may not stay in the reply."""

from __future__ import annotations

from spec_cli.core.events import Token
from spec_cli.view import TokenView


def _overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReplyView(TokenView):
    """A TokenView for one reply: leading and trailing whitespace are held back, and so is anything that
    may be the start of the stop marker (the next "User:" turn), so what is shown is what is kept."""

    def __init__(self, tokenizer, prompt: list[int], stop: str | None, stream=None, color: bool | None = None,
                 trace: bool = False):
        super().__init__(tokenizer, prompt, stream=stream, color=color, trace=trace)
        self.stop = stop
        self.stopped = False  # the marker appeared: the reply is over
        self._queue: list[list] = []  # [text, style, is_output] not yet written
        self._start = 0  # offset in self.text of the first queued output text
        self._shown = False  # whether any of the reply's text is on the screen yet
        self.screen.start()

    def add(self, event) -> None:
        if self.stopped or not isinstance(event, Token):
            return
        super().add(event)  # calls self._write for what it would show
        self._flush()

    def _write(self, text: str, style: str, output: bool = True) -> None:
        if text:
            self._queue.append([text, style, output])

    @property
    def reply(self) -> str:
        """The reply as the conversation keeps it: up to the stop marker, stripped."""
        text = self.text
        if self.stop and (cut := text.find(self.stop)) >= 0:
            text = text[:cut]
        return text.strip()

    def _flush(self) -> None:
        full = self.text
        end = len(full)
        if self.stop and (cut := full.find(self.stop)) >= 0:
            self.stopped, end = True, cut
        elif self.stop:
            end -= _overlap(full, self.stop)
        end = len(full[:end].rstrip())
        begin = len(full) - len(full.lstrip()) if full.strip() else len(full)
        while self._queue:
            text, style, is_output = self._queue[0]
            if not is_output:  # a rejected proposal, shown where it was made
                TokenView._write(self, text if self._shown else text.lstrip(), style, False)
                self._queue.pop(0)
                continue
            a, b = max(self._start, begin), min(self._start + len(text), end)
            if b > a:
                TokenView._write(self, text[a - self._start : b - self._start], style, True)
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
