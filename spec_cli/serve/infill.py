"""Fill-in-the-middle: a code model's prompt for the text between a prefix and a suffix (an editor's completion
at the cursor), in the model's own FIM tokens, with other files as context where the model knows how.

Formats, found by the tokenizer's tokens (each a single token of its vocabulary):
- Qwen2.5-Coder and StarCoder2: `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`, other files
  before it as `<|file_sep|>name\\ntext` (Qwen's repository format, as llama.cpp's server writes it);
- CodeLlama: `<PRE> ` prefix ` <SUF>` suffix ` <MID>`;
- DeepSeek-Coder: `<｜fim▁begin｜>` prefix `<｜fim▁hole｜>` suffix `<｜fim▁end｜>`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fim:
    prefix: str
    suffix: str
    middle: str
    file_sep: str | None = None  # before each extra file: `file_sep` name newline text
    repo: str | None = None  # before the extra files: `repo` name newline

    def tokens(self) -> list[str]:
        return [t for t in (self.prefix, self.suffix, self.middle, self.file_sep, self.repo) if t]


FORMATS = (
    Fim("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>"),
    Fim("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<repo_name>"),
    Fim("<PRE>", "<SUF>", "<MID>"),
    Fim("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def _single(tokenizer, text: str) -> int | None:
    ids = tokenizer.convert_tokens_to_ids([text])
    token = ids[0] if ids else None
    return token if token is not None and token != tokenizer.unk_token_id else None


def fim_of(tokenizer) -> Fim | None:
    """The model's FIM format, if its vocabulary has one's prefix, suffix and middle tokens (None: no FIM)."""
    for fim in FORMATS:
        if all(_single(tokenizer, t) is not None for t in (fim.prefix, fim.suffix, fim.middle)):
            found = {t: _single(tokenizer, t) for t in (fim.file_sep, fim.repo) if t}
            return Fim(fim.prefix, fim.suffix, fim.middle,
                       fim.file_sep if found.get(fim.file_sep) is not None else None,
                       fim.repo if found.get(fim.repo) is not None else None)
    return None


def infill_ids(tokenizer, fim: Fim, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
               prompt: str = "") -> list[int]:
    """The prompt's token ids: the user's text encoded piece by piece (so text that spells a FIM token stays
    text), the format's tokens between them; `prompt` continues the prefix (llama.cpp's /infill takes it so)."""
    def text(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"] if s else []

    def token(t: str) -> list[int]:
        return [_single(tokenizer, t)]

    ids: list[int] = []
    if extra and fim.file_sep:
        if fim.repo:
            ids += token(fim.repo) + text("project\n")
        for name, body in extra:
            ids += token(fim.file_sep) + text(f"{name}\n{body}")
        ids += token(fim.file_sep) + text("\n")
    elif extra:  # no file separator: the files as a comment-free preamble of the prefix
        prefix = "".join(f"{body}\n" for _, body in extra) + prefix
    ids += token(fim.prefix) + text(prefix + prompt) + token(fim.suffix) + text(suffix) + token(fim.middle)
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False):
        ids = [bos] + ids
    return ids
