"""The part of a vocabulary a draft drafts from (FR-Spec, Zhao et al. 2025): the words most frequent in text
like what it will draft, ranked once per tokenizer on Python's own library (its code and docstrings: this
machine always has it, and none of it is a prompt a benchmark asks) and kept in the cache folder."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

from spec_cli.core.paths import cache_dir, write_whole

CORPUS_BYTES = 6 << 20  # of Python's library: enough to rank the words a draft mostly needs


def _corpus() -> list[str]:
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        size += len(text)
        if size > CORPUS_BYTES:
            break
    return texts


def _key(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def ranked(tokenizer) -> torch.Tensor:
    """Every word id, most frequent in the corpus first (ties: the lower id), special tokens first of all."""
    path = cache_dir() / "vocabulary" / f"{_key(tokenizer)}.pt"
    try:
        return torch.load(path)
    except (OSError, RuntimeError, EOFError):
        pass
    size = len(tokenizer)
    counts = torch.zeros(size, dtype=torch.long)
    for text in _corpus():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=size)[:size]
    for special in tokenizer.all_special_ids:
        if 0 <= special < size:
            counts[special] = counts.max() + 1
    order = sorted(range(size), key=lambda i: (-int(counts[i]), i))
    ranking = torch.tensor(order, dtype=torch.int32)
    try:
        write_whole(path, lambda partial: torch.save(ranking, partial))
    except OSError:  # a read-only cache: ranked again next time
        pass
    return ranking


def frequent(tokenizer, count: int) -> torch.Tensor:
    """The `count` most frequent word ids, ascending."""
    return ranked(tokenizer)[:count].to(torch.long).sort().values
