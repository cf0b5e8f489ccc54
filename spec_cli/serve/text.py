"""A completion's text as the server hands it out: only text that is final, cut at the first stop string,
the same whether it goes out in one piece or as streamed deltas."""

from __future__ import annotations

from spec_cli.detok import Detokenizer


def overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker` (and not all of it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class TextStream:
    """Tokens in, text deltas out. A delta never holds a part of a multi-byte character (the detokenizer
    waits for the rest), nor text that may still turn out to begin a stop string (held back until it
    cannot), nor anything after a stop string. With `strip`, leading and trailing whitespace are dropped
    (a plain chat transcript's reply, as `spec chat` keeps it). The deltas add up to `text`."""

    def __init__(self, tokenizer, prompt: list[int], stops: list[str] = (), strip: bool = False):
        self.detokenizer = Detokenizer(tokenizer, prompt)
        self.stops = [s for s in stops if s]
        self.strip = strip
        self.decoded = ""  # all the text the tokens make so far
        self.begin = 0  # where the handed-out text starts in `decoded` (after leading whitespace, with strip)
        self.sent = 0  # where it ends
        self.stopped = False  # a stop string came: nothing more is handed out

    @property
    def text(self) -> str:
        return self.decoded[self.begin : self.sent]

    def add(self, token: int) -> str:
        """Take one output token; the text that became final."""
        if self.stopped:
            return ""
        self.decoded += self.detokenizer.add(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The completion ended: whatever was held back and is part of the text."""
        if not self.stopped:
            self.decoded += self.detokenizer.rest()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.decoded)
        for stop in self.stops:
            cut = self.decoded.find(stop, max(0, self.sent - len(stop)))
            if 0 <= cut < end:
                end, self.stopped = cut, True
        if not self.stopped and not final:
            end -= max((overlap(self.decoded, stop) for stop in self.stops), default=0)
        if self.strip:
            if self.sent == self.begin:  # nothing handed out yet: skip leading whitespace
                self.begin = self.sent = len(self.decoded[:end]) - len(self.decoded[:end].lstrip())
            end = max(self.sent, len(self.decoded[:end].rstrip()))  # trailing spaces wait for what follows
        if end <= self.sent:
            return ""
        delta, self.sent = self.decoded[self.sent : end], end
        return delta
