"""Incremental detokenization: text for each new token, right across multi-token characters and spaces; and a
completion's text as it is handed out, cut at the first stop string (`TextStream`: the server, `spec generate`)."""

from __future__ import annotations

import json
from collections.abc import Sequence


class Detokenizer:
    """Decodes a growing token sequence piece by piece (the prefix-offset method of TGI and vLLM)."""

    def __init__(self, tokenizer, context: list[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(context[-8:])
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _new_text(self, ids: list[int]) -> str:
        before = self._decode(ids[self.prefix : self.read])
        after = self._decode(ids[self.prefix :])
        if after.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its other tokens
            return ""
        return after[len(before) :]

    def add(self, token: int) -> str:
        """Append `token`; the text that became final."""
        self.ids.append(token)
        text = self._new_text(self.ids)
        if text:
            self.prefix, self.read = self.read, len(self.ids)
        return text

    def rest(self) -> str:
        """The text still held back at the end (an unfinished multi-byte character), as decoding gives it."""
        before = self._decode(self.ids[self.prefix : self.read])
        return self._decode(self.ids[self.prefix :])[len(before) :]

    def peek(self, token: int) -> str:
        """The text `token` would add here, without adding it (for showing rejected proposals)."""
        text = self._new_text(self.ids + [token])
        return text or self._decode([token])

def overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker` (and not all of it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def released(text: str, stops: Sequence[str], start: int = 0, final: bool = False) -> tuple[int, bool]:
    """How much of `text` may go out, and whether a stop string ended it: up to the first of `stops` found from
    `start` on (what came before was searched already), else all of it but an end that may still begin one (all
    of it when `final`)."""
    end, stopped = len(text), False
    for stop in stops:
        cut = text.find(stop, start)
        if 0 <= cut < end:
            end, stopped = cut, True
    if not stopped and not final:
        end -= max((overlap(text, stop) for stop in stops), default=0)
    return end, stopped


class TextStream:
    """Tokens in, text deltas out. A delta never holds a part of a multi-byte character (the detokenizer
    waits for the rest), nor text that may still turn out to begin a stop string (held back until it
    cannot), nor anything after a stop string. With `strip`, leading and trailing whitespace are dropped
    (a plain chat transcript's reply, as `spec chat` keeps it). The deltas add up to `text`."""

    def __init__(self, tokenizer, prompt: list[int], stops: list[str] = (), strip: bool = False):
        self.detokenizer = Detokenizer(tokenizer, prompt)
        self.stops = [s for s in stops if s]
        self.longest = max(map(len, self.stops), default=0)
        self.strip = strip
        self.decoded = ""  # all the text the tokens make so far
        self.begin = 0  # where the handed-out text starts in `decoded` (after leading whitespace, with strip)
        self.sent = 0  # where it ends
        self.stopped = False  # a stop string came: nothing more is handed out

    @property
    def text(self) -> str:
        return self.decoded[self.begin : self.sent]

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        if not self.stopped:
            return None
        return min((s for s in self.stops if s in self.decoded[self.sent:]),
                   key=lambda s: self.decoded.find(s, self.sent))

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
        end, self.stopped = released(self.decoded, self.stops, max(0, self.sent - self.longest), final)
        if self.strip:
            if self.sent == self.begin:  # nothing handed out yet: skip leading whitespace
                self.begin = self.sent = len(self.decoded[:end]) - len(self.decoded[:end].lstrip())
            end = max(self.sent, len(self.decoded[:end].rstrip()))  # trailing spaces wait for what follows
        if end <= self.sent:
            return ""
        delta, self.sent = self.decoded[self.sent : end], end
        return delta


class TokenBytes:
    """Each token's own bytes, which a multi-byte character's tokens each hold a part of (OpenAI's `bytes` of a
    log-probability): byte-level BPE's symbols mapped back to their bytes (GPT-2, Llama 3, Qwen), SentencePiece's
    byte pieces (`<0x0A>`) and its "▁" as a space (Llama 2, Gemma, Mistral); otherwise the token's decoded text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        decoder = json.loads(decoder.__getstate__()) if decoder is not None else {}  # (the decoder's JSON alone)
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self.byte_level = "ByteLevel" in kinds
        self.pieces = "ByteFallback" in kinds or "Metaspace" in kinds
        self.symbols = {c: b for b, c in _byte_symbols().items()}

    def __call__(self, token: int) -> bytes:
        if self.byte_level or self.pieces:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if self.byte_level and piece and all(c in self.symbols for c in piece):
                return bytes(self.symbols[c] for c in piece)
            if self.pieces and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            if self.pieces:
                return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token]).encode()


def token_text(raw: bytes) -> str:
    """A token's bytes as text; a part of a character as OpenAI writes it (`bytes:\\xe2\\x80`)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's printable symbol."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b], extra = chr(256 + extra), extra + 1
    return symbols
