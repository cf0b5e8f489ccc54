"""Incremental detokenization: text for each new token, right across multi-token characters and spaces."""

from __future__ import annotations


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
