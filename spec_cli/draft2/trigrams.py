"""draft2's trigram without the user waiting, fitted once and cached, then used with prompt lookup where the text
repeats (`draft2 = "auto"`, the default). Two kinds:
- a draft's (`sampled_path`): the staged paper's, a Katz back-off trigram on text sampled from the draft (T = 1.5),
  fitted in a niced child process where the cores are not the decoding's (a GPU), or by `spec fit-draft2`.
- a model alone's (`corpus_path`): fitted on a corpus (by default the Python standard library's source) in its
  tokenizer's tokens, so every model of that tokenizer shares it (Qwen2.5-Coder's 0.5B, 1.5B and 7B alike). On a
  CPU the first staged run of a model alone fits it in its own process (~20 s once).
`spec tune` fits one too (per profile and machine); these are the ones a profile gets without asking.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

from spec_cli.core.hardware import alive
from spec_cli.core.paths import cache_dir
from spec_cli.core.settings import ModelRef

TOKENS = int(os.environ.get("SPEC_DRAFT2_TOKENS", 200_000))  # sampled from the draft: what `spec tune` fits on
# SPEC_DRAFT2_CORPUS: files or folders (os.pathsep between) a lone oracle's trigram is fitted on in the background
# (default: Python's standard library)
STALE = 3600.0  # seconds after which a fit's lock is taken to be an abandoned one
RETRY = 86400.0  # seconds after a failed fit before another is tried (its .log says why it failed)


def folder() -> Path:
    return cache_dir() / "draft2"


def draft_key(ref: ModelRef) -> str:
    """The draft's identity (`model_key`) with the fitting settings, so that new ones refit."""
    return model_key(ref, str(TOKENS))


def model_key(ref: ModelRef, *settings: str) -> str:
    """A model's identity: a local folder's config and weight files (names, sizes, times), or a hub id and
    revision; with `settings` (what was fitted on it, and how)."""
    parts = [ref.model, ref.revision or "", ref.gguf_file or "", *settings]
    local = Path(ref.model).expanduser()
    if local.exists():
        parts[0] = str(local.resolve())
        files = sorted(local.iterdir()) if local.is_dir() else [local]
        for f in files:
            if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".gguf", ".pt")):
                stat = f.stat()
                parts.append(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def sampled_path(ref: ModelRef) -> Path:
    """Where a draft's trigram, sampled from it, is kept."""
    return folder() / f"{draft_key(ref)}.npz"


_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its length, its key)


def tokenizer_key(tokenizer) -> str:
    """A tokenizer's identity: its whole definition (vocabulary, merges, normalisation; ~0.1 s for Qwen2.5's, so
    remembered while its length stays what it was)."""
    known = _keys.get(tokenizer)
    if known is not None and known[0] == len(tokenizer):
        return known[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    _keys[tokenizer] = (len(tokenizer), key)
    return key


def corpus_path(tokenizer) -> Path:
    """Where the trigram fitted on a corpus in `tokenizer`'s tokens is kept (the last corpus fitted for it)."""
    return folder() / f"corpus-{tokenizer_key(tokenizer)}.npz"


def separate_draft(profile) -> ModelRef | None:
    """The profile's separate draft model, the one a sampled trigram is fitted from (None: alone, or a self-draft)."""
    draft = profile.draft
    return draft if draft is not None and draft.model != "self" else None


def ready(profile, tokenizer) -> Path | None:
    """The trigram `draft2 = "auto"` uses for `profile` (models of `tokenizer`), if it is fitted yet: a separate
    draft's sampled one, else (a model alone) its tokenizer's corpus one, whose guesses go to the oracle directly
    on the steps `spec_cli.decoding.staged` verifies without a draft. (The corpus one as a pair's draft2 was no
    faster: the Qwen pair on a Xeon drafted 0.48-0.50 forwards a token against 0.58-0.63 by lookup alone, but
    verified 3.4-3.7 tokens an oracle forward against 3.8-4.0, benchmarks/reports.)"""
    draft = separate_draft(profile)
    path = sampled_path(draft) if draft is not None else corpus_path(tokenizer)
    return path if path.is_file() else None


def fits_here(device: str) -> bool:
    """Whether the corpus trigram is fitted in this process at its first use: on a CPU, unless
    SPEC_BACKGROUND_FIT says otherwise (1: in a child, as elsewhere; 0: not at all). A child competes for the
    cores the decoding threads need, and a fit on a corpus is quick: Python's library in Qwen2.5's tokens took
    ~15-30 s on 2 cores, once; with it the 1.5B alone ran 1.29x its plain decoding on code prompts against 1.16x
    with prompt lookup alone (a Xeon, benchmarks/reports)."""
    return device == "cpu" and os.environ.get("SPEC_BACKGROUND_FIT") is None


def fit_here(ref: ModelRef, tokenizer, say) -> Path | None:
    """Fit the corpus trigram of `tokenizer` (the oracle `ref`'s) on SPEC_DRAFT2_CORPUS, else Python's library, in
    this process, into the cache, saying so (`say`: a line); its path if it is there now. A failure is one line
    and a .failed file (not tried again for a day); another process fitting it is left to it."""
    from spec_cli.core.errors import first_line
    from spec_cli.core.paths import write_whole
    from spec_cli.core.settings import Profile
    from spec_cli.draft2.fit import fit_from_corpus

    target = corpus_path(tokenizer)
    failed, lock = target.with_suffix(".failed"), target.with_suffix(".lock")
    fd = _claim(target)
    if fd is None:
        return None
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    chosen = [Path(p) for p in os.environ.get("SPEC_DRAFT2_CORPUS", "").split(os.pathsep) if p]
    corpus = "your corpus" if chosen else "Python's standard library"
    say(f"fitting draft2's trigram for this tokenizer on {corpus} (once, ~20 s; cached in {folder()})")
    quarters = {"shown": 0}

    def progress(done: int, files: int) -> None:
        if 4 * done // files > quarters["shown"] and done < files:
            quarters["shown"] = 4 * done // files
            say(f"draft2's trigram: {done}/{files} files read")

    try:
        model = fit_from_corpus(Profile("draft2", "", ref, None), chosen or None, progress, tokenizer)
        write_whole(target, model.save)
        failed.unlink(missing_ok=True)
        return target
    except Exception as e:
        failed.write_text(f"{type(e).__name__}: {e}\n")
        say(f"draft2's trigram was not fitted ({first_line(e)}): prompt lookup alone")
        return None
    finally:
        lock.unlink(missing_ok=True)


def _claim(target: Path) -> int | None:
    """The lock of a fit into `target`, created (its descriptor, for the fitting process's pid), unless the last
    fit failed within RETRY (not tried on every run) or a live process holds the lock (one that died, or held it
    past STALE, left it: taken over); None if not."""
    target.parent.mkdir(parents=True, exist_ok=True)
    failed, lock = target.with_suffix(".failed"), target.with_suffix(".lock")
    if failed.exists() and time.time() - failed.stat().st_mtime < RETRY:
        return None
    if lock.exists():
        try:
            pid = int(lock.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        if pid and alive(pid) and time.time() - lock.stat().st_mtime < STALE:
            return None
        lock.unlink(missing_ok=True)
    try:
        return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None


def fit_in_background(ref: ModelRef, device: str = "cpu", tokenizer=None) -> bool:
    """Start fitting a trigram in a niced child process unless it is fitted or being fitted: the draft `ref`'s,
    sampled from it, or with `tokenizer` (the oracle `ref`'s) the corpus one, on Python's standard library; True
    if this call started it. On a CPU only with SPEC_BACKGROUND_FIT=1: there the child competes for the cores the
    decoding threads need (a first run measured many times slower while it fitted); SPEC_BACKGROUND_FIT=0 turns
    it off everywhere."""
    setting = os.environ.get("SPEC_BACKGROUND_FIT")
    if setting == "0" or (setting is None and device == "cpu"):
        return False
    if ref is None or ref.model == "self":
        return False
    target = corpus_path(tokenizer) if tokenizer is not None else sampled_path(ref)
    if target.is_file():
        return False
    fd = _claim(target)
    if fd is None:
        return False
    args = json.dumps({"model": ref.model, "revision": ref.revision, "dtype": ref.dtype,
                       "gguf_file": ref.gguf_file, "device": device, "out": str(target),
                       "corpus": tokenizer is not None})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(target.with_suffix(".log"), "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "spec_cli.draft2.trigrams", args], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=log, env=env, start_new_session=True)
    os.write(fd, f"{child.pid}\n".encode())
    os.close(fd)
    return True


def _fit(args: dict) -> None:
    import torch

    from spec_cli.core.paths import write_whole
    from spec_cli.core.settings import Profile
    from spec_cli.draft2.fit import fit_from_corpus, fit_from_draft

    if hasattr(os, "nice"):
        os.nice(19)
    torch.set_num_threads(1)
    ref = ModelRef(args["model"], args["revision"], args["dtype"], args["gguf_file"])
    out = Path(args["out"])
    try:
        if args.get("corpus"):
            chosen = os.environ.get("SPEC_DRAFT2_CORPUS", "").split(os.pathsep)
            model = fit_from_corpus(Profile("draft2", "", ref, None), [Path(p) for p in chosen if p])
        else:
            model, _ = fit_from_draft(Profile("draft2", "", ref, ref), TOKENS, 1.5, 0, args["device"])
        write_whole(out, model.save)  # (whole or not at all; the cache may have been cleared meanwhile)
        out.with_suffix(".failed").unlink(missing_ok=True)
    except BaseException as e:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}\n")
        raise
    finally:
        out.with_suffix(".lock").unlink(missing_ok=True)


if __name__ == "__main__":
    _fit(json.loads(sys.argv[1]))
