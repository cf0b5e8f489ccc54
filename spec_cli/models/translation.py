"""A draft of another vocabulary (universal assisted decoding, as Hugging Face's and llama-server's): the draft
reads the text in its own tokens and guesses on in them; its guesses reach the oracle as the oracle's tokens of
the same text. The oracle verifies them as guesses of its own (one-hot: accept x with probability p(x)), so the
output is the oracle's whatever the translation makes of them: a poor translation costs speed, never a token.
"""

from __future__ import annotations

WINDOW = 8  # tokens before a boundary decoded with the text after it, so that a word cut there re-joins


class Translator:
    """Text between the oracle's tokens and a draft's. `draft_ids` spells the oracle's text in the draft's
    tokens; `guesses` turns what the draft proposed after them into the oracle's tokens."""

    def __init__(self, oracle_tokenizer, draft_tokenizer):
        self.oracle = oracle_tokenizer
        self.draft = draft_tokenizer
        self._bos = _leading_bos(draft_tokenizer)

    def draft_ids(self, oracle_ids: list[int], known: list[int] = ()) -> list[int]:
        """The draft's tokens of the text `oracle_ids` spell (special tokens as their text), after the draft's
        own BOS where its tokenizer starts with one. `known`: the draft's tokens of an earlier text, kept but for
        their last WINDOW where the text still starts with what they spell (only the rest is encoded: a whole
        encode of a long text is milliseconds a step, the Qwen 1.5B's 2,000 tokens ~4 ms for SmolLM2's)."""
        text = self._spelled(oracle_ids)
        kept = list(known[: max(0, len(known) - WINDOW)])
        head = self.draft.decode(kept[len(self._bos):], skip_special_tokens=False) if len(kept) > len(self._bos) else ""
        if not head or not text.startswith(head):
            kept, head = list(self._bos), ""
        ids = kept + self.draft.encode(text[len(head):], add_special_tokens=False)
        return ids or [self._fallback_start()]

    def guesses(self, oracle_ids: list[int], draft_ids: list[int], proposed: list[int]) -> list[int]:
        """The oracle's tokens for the text the draft proposed (`proposed`, its tokens after `draft_ids`), as
        they continue `oracle_ids`: the text after the boundary encoded with the oracle's last few tokens' text,
        so a token that ends there stays whole; where the oracle's tokens would not keep those last tokens as
        they are, the proposed text encoded alone."""
        window = draft_ids[-WINDOW:]
        before = self.draft.decode(window, skip_special_tokens=False)
        after = self.draft.decode(window + proposed, skip_special_tokens=False)
        if not after.startswith(before):
            return []
        new = after[len(before):].rstrip("\ufffd")  # (an unfinished character at the end)
        if not new:
            return []
        tail = oracle_ids[-WINDOW:]
        joined = self.oracle.encode(self._spelled(tail) + new, add_special_tokens=False)
        if joined[: len(tail)] == tail:
            return joined[len(tail):]
        return self.oracle.encode(new, add_special_tokens=False)

    def _spelled(self, oracle_ids: list[int]) -> str:
        return self.oracle.decode(oracle_ids, skip_special_tokens=False)

    def _fallback_start(self) -> int:
        for token in (self.draft.bos_token_id, self.draft.eos_token_id, 0):
            if token is not None:
                return token
        return 0


def _leading_bos(tokenizer) -> list[int]:
    """[the BOS token] where the tokenizer starts a text with it, else []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if ids and ids[0] == bos else []


def difference(oracle_tokenizer, draft_tokenizer) -> str | None:
    """How two vocabularies differ, in words (None: they are one)."""
    ov, dv = oracle_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ov == dv:
        return None
    only_o = len(set(ov) - set(dv))
    only_d = len(set(dv) - set(ov))
    moved = sum(1 for t, i in dv.items() if t in ov and ov[t] != i)
    return (f"{len(ov)} vs {len(dv)} tokens; {only_o} only in the oracle's, {only_d} only in the draft's, "
            f"{moved} with different ids")
