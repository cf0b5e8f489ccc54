"""Where spec keeps what it derives (verdicts, quantized copies, kernels, what the controllers learned)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Where spec keeps what it derives from models (verdicts, dequantized GGUF files): SPEC_CACHE_DIR or
    the user cache dir."""
    return Path(os.environ.get("SPEC_CACHE_DIR") or platformdirs.user_cache_dir("spec"))


def write_whole(path: Path, content: str | Callable[[Path], None]) -> Path:
    """Write `path` whole or not at all: into a file beside it named for this process, then renamed over it,
    so a reader (another process, the next run after a Ctrl-C) sees the old file or the new one, never a part.
    `content`: text, or a function that writes the file it is given (`torch.save`). Makes the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(content):
            content(partial)
        else:
            partial.write_text(content)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def used(path: Path) -> None:
    """Mark what the cache dir holds as used now (its modification time, which `spec cache` shows)."""
    try:
        os.utime(path)
    except OSError:  # (a read-only cache)
        pass
