"""Fitting the n-gram draft2: on text sampled from the draft (the paper: T = 1.5), or on the user's files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from spec_cli.core.errors import SpecError
from spec_cli.core.hardware import pick_device
from spec_cli.core.settings import Profile
from spec_cli.draft2.ngram import KatzTrigram
from spec_cli.models.loading import load, load_tokenizer

BATCH = 64  # corpus files tokenized at a time
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".js", ".ts", ".c", ".h", ".cpp", ".java", ".go", ".rs", ".json"}


def _files(paths: list[Path]) -> list[Path]:
    out = []
    for path in paths:
        if path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            out.append(path)
        else:
            raise SpecError(f"corpus path not found: {path}")
    if not out:
        raise SpecError("the corpus has no text files")
    return out


def standard_library() -> list[Path]:
    """Python's own library as a corpus (its .py files, no site-packages): every machine that runs spec has
    it, and code models write text like it (the 1.5B alone: a trigram on it verified 1.6 tokens a forward on
    code prompts, benchmarks/reports)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def corpus_files(paths: list[Path] | None) -> list[Path]:
    """The text files of `paths` (files, or folders' text files), or with none `standard_library()`."""
    return _files(paths) if paths else standard_library()


def fit_from_corpus(profile: Profile, paths: list[Path] | None = None, progress=None, tokenizer=None) -> KatzTrigram:
    """A trigram on the files (or the folders' text files) in `paths` (none: `standard_library()`), in the
    oracle's tokens (`tokenizer`: the oracle's, already loaded); `progress(files done, files)` as it reads them.
    Files are tokenized BATCH at a time (a fast tokenizer spreads a batch over the cores: Python's library in
    Qwen2.5's tokens, 7.9M, took 27 s file by file on 2 cores, half that in batches)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = tokenizer or load_tokenizer(profile.oracle)
    files = corpus_files(paths)

    def streams():
        for start in range(0, len(files), BATCH):
            part = files[start:start + BATCH]
            yield from tokenizer([path.read_text(errors="replace") for path in part])["input_ids"]
            if progress is not None:
                progress(start + len(part), len(files))

    return KatzTrigram.fit(streams(), len(tokenizer))


def fit_from_draft(profile: Profile, tokens: int, temperature: float, seed: int, device: str | None,
                   console=None, batch: int = 128, length: int = 256, progress=None) -> tuple[KatzTrigram, int]:
    """The paper's draft2: a trigram fitted on text sampled from the draft. Ctrl-C keeps what was sampled.

    Returns the model and how many tokens it was fitted on (fewer than asked when interrupted).
    """
    if profile.draft is None or profile.draft.model == "self":
        raise SpecError("the profile names no separate draft model to sample from")
    dev = pick_device(device or profile.device)
    draft = load(profile.draft, dev, torch.float32 if dev.type == "cpu" else torch.float16)
    bos = draft.tokenizer.bos_token_id if draft.tokenizer.bos_token_id is not None else draft.tokenizer.eos_token_id
    torch.manual_seed(seed)
    streams, total = [], 0
    batch = max(1, min(batch, -(-tokens // length)))
    try:
        while total < tokens:
            start = torch.full((batch, 1), bos, device=dev)
            with torch.no_grad():
                out = draft.model.generate(start, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                           max_new_tokens=length, min_new_tokens=length, pad_token_id=bos)
            streams += out.tolist()
            total += out.numel()
            if progress is not None:
                progress(min(total, tokens), tokens)
            elif console is not None:
                console.print(f"sampled {min(total, tokens)}/{tokens} tokens", style="dim")
    except KeyboardInterrupt:
        if not streams:
            raise
    vocab = max(draft.model.config.vocab_size, len(draft.tokenizer))
    return KatzTrigram.fit(streams, vocab), total
