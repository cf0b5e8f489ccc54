"""What spec keeps in its cache dir (`paths.cache_dir()`), listed and cleared: `spec cache`.

Everything there is derived and made again when missing (a GGUF file read at its quantization, a float model's
quantized copy, the CPU kernels' builds, trigrams, what the controllers learned, exactness verdicts; a model alone's
fitted heads by `spec tune` again), so any of it may go; an entry is *stale* when this spec can never use it again: a GGUF copy of an older layout or of a file no
longer there as it was, a kernel build for other sources or another torch, a verdict of another version, an
unfinished write, a finished process's offloaded weights.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from spec_cli import __version__
from spec_cli.core import hardware
from spec_cli.core.errors import SpecError
from spec_cli.core.paths import cache_dir
from spec_cli.exec import native
from spec_cli.models import gguf

KINDS = ("gguf", "quantized", "native", "draft2", "heads", "learned", "checks", "vocabulary", "offload")
UNFINISHED = 3600.0  # seconds after which a folder without its last file is taken for an abandoned write


@dataclass
class Entry:
    kind: str
    path: Path
    bytes: int
    modified: float
    what: str
    stale: str | None = None  # why this spec can never use it again


def as_dict(entry: Entry) -> dict:
    """An entry as `spec cache --json` prints it."""
    return {"kind": entry.kind, "name": entry.path.name, "path": str(entry.path), "bytes": entry.bytes,
            "used": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(entry.modified)), "what": entry.what,
            "stale": entry.stale}


def size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def entries(root: Path | None = None) -> list[Entry]:
    """Every entry of the cache dir (or `root`), by kind then name; anything else found there is listed as
    'other'."""
    root = root or cache_dir()
    found: list[Entry] = []
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        if not folder.is_dir():
            found.append(_entry("other", folder, folder.name))
            continue
        if folder.name not in KINDS:
            found.append(_entry("other", folder, "not spec's"))
            continue
        describe = DESCRIBE[folder.name]
        if folder.name == "gguf":  # (what every copy is checked against, read once)
            describe = partial(_gguf, present=_present(folder / "hashes.json"), kernels=native.variant() is not None)
        elif folder.name == "native":
            describe = partial(_native, current=_current_build())
        for path in sorted(folder.iterdir()):
            if folder.name == "gguf" and path.name in ("hashes.json", ".locks"):
                continue  # (the files' hashes, a few hundred bytes: what tells a copy's file is still there; the
                # empty files a first read locks)
            found.append(describe(path))
    return found


def _entry(kind: str, path: Path, what: str, stale: str | None = None) -> Entry:
    return Entry(kind, path, size(path), path.stat().st_mtime, what, stale)


def _gguf(path: Path, present: set[str], kernels: bool) -> Entry:
    """A GGUF copy; `present`: the hashes of the files still where they were hashed; `kernels`: spec's CPU
    kernels run here."""
    if path.name.endswith(".partial") and gguf.FOLDER.match(path.name.removesuffix(".partial")):
        return _entry("gguf", path, "a GGUF file being read (or a read a crash ended)", _unfinished(path))
    match = gguf.FOLDER.match(path.name)
    if match is None or not path.is_dir():
        return _entry("gguf", path, "not a read GGUF file", "not spec's layout")
    digest, dtype, precision, layout, kernel = match.groups()
    try:
        source = json.loads((path / "source.json").read_text())
    except (OSError, ValueError):
        source = None
    name = Path(source["file"]).name if source else "a GGUF file"
    how = {"file": "its own quantization", "dequantized": "transformers' dequantizing"}.get(precision, precision) \
        + (", spec's CPU kernels" if kernel else "")
    what = f"{name} read at {how}, {dtype}"
    if not kernel and precision in ("file", "int4") and kernels:
        what += " (read here only with SPEC_NATIVE=0)"
    if int(layout) != gguf.LAYOUT:
        return _entry("gguf", path, what, f"an older layout (v{layout}; this spec reads v{gguf.LAYOUT})")
    if source is None:
        return _entry("gguf", path, what, _unfinished(path))
    if not any(full.startswith(digest) for full in present):
        return _entry("gguf", path, what, f"{source['file']} is gone or changed")
    return _entry("gguf", path, what)


def _present(index: Path) -> set[str]:
    """The hashes of the files in `gguf.sha256`'s index that are still where they were hashed: as they were, or of
    the same size and hashed again (a file copied or touched keeps its copies when its bytes are the same)."""
    try:
        marks = json.loads(index.read_text())
    except (OSError, ValueError):
        return set()
    present = set()
    for mark, full in marks.items():
        parts = mark.rsplit("|", 2)  # (path|size|modification time, as `gguf.sha256` writes it)
        try:
            stat = Path(parts[0]).stat()
        except OSError:
            continue
        if [str(stat.st_size), str(stat.st_mtime_ns)] == parts[1:]:
            present.add(full)
        elif str(stat.st_size) == parts[1]:  # (touched, copied back, mounted again: hashed again, once)
            try:
                present.add(gguf.sha256(Path(parts[0])))
            except OSError:
                continue
    return present


def _unfinished(path: Path) -> str | None:
    """Stale when it was last written to over an hour ago (before that it may be being written now)."""
    return "an unfinished write" if time.time() - path.stat().st_mtime > UNFINISHED else None


def _quantized(path: Path) -> Entry:
    kind = path.name.partition("-")[0]
    return _entry("quantized", path, f"a float model's projections at {kind}")


def _current_build() -> str | None:
    """The name of this spec's kernel build for this CPU (None: no build runs here)."""
    target = native.variant()
    return None if target is None else f"int4-{native.build_tag(target)}"


def _native(path: Path, current: str | None) -> Entry:
    this = path.name == current
    what = "spec's CPU kernels" + (", this version's" if this else "")
    if not any(path.glob("*.so")):
        return _entry("native", path, what, _unfinished(path))
    return _entry("native", path, what, None if this else "built from other sources or for another torch")


def _draft2(path: Path) -> Entry:
    if path.suffix == ".npz":
        what = ("a model alone's trigram on Python's library (for its tokenizer)" if path.name.startswith("corpus-")
                else "a draft's trigram, fitted on its own text")
        return _entry("draft2", path, what)
    return _entry("draft2", path, "a trigram fit's " + ("lock" if path.suffix == ".lock" else "log"))


def _heads(path: Path) -> Entry:
    return _entry("heads", path, "a model alone's fitted heads (`spec tune`), guessing from its last state")


def _learned(path: Path) -> Entry:
    try:
        key = json.loads(path.read_text())["key"]
        drafter = key["drafter"]
        how = {"none": " alone", "heads": " alone, with its fitted heads",
               "self-draft": " drafting for itself"}.get(drafter["draft"])
        what = (f"what the controller learned of {_model(key['oracle']['model'])}"
                + (how or f" with {_model(drafter['model']['model'])}") + f" ({key['weights']})")
    except (OSError, ValueError, KeyError, TypeError):
        what = "what a controller learned"
    return _entry("learned", path, what)


def _model(name: str) -> str:
    """A model as a line names it: a file by its name, a folder by its last two (pyfam/oracle), a hub id whole."""
    path = Path(name)
    if not path.is_absolute():
        return name
    return "/".join(path.parts[-2:]) if path.is_dir() else path.name


def _checks(path: Path) -> Entry:
    try:
        key = json.loads(path.read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return _entry("checks", path, "an exactness verdict", "unreadable")
    what = f"the exactness verdict of a {key.get('model_type')} model"
    made = key.get("spec")
    return _entry("checks", path, what, None if made == __version__ else f"made by spec {made}")


def _vocabulary(path: Path) -> Entry:
    return _entry("vocabulary", path, "a tokenizer's words by frequency (a draft's part of the vocabulary)")


def _offload(path: Path) -> Entry:
    pid = path.name.rpartition("-pid")[2]
    alive = pid.isdigit() and hardware.alive(int(pid))
    return _entry("offload", path, "a process's offloaded weights", None if alive else "its process has ended")


DESCRIBE = {"gguf": _gguf, "quantized": _quantized, "native": _native, "draft2": _draft2, "heads": _heads,
            "learned": _learned,
            "checks": _checks, "vocabulary": _vocabulary, "offload": _offload}


def select(found: list[Entry], which: list[str]) -> list[Entry]:
    """The entries `which` names: 'stale', 'all', kinds, or entries' names (as `spec cache` lists them)."""
    known = {*KINDS, "other", "stale", "all"}
    names = {e.path.name for e in found}
    unknown = [w for w in which if w not in known and w not in names]
    if unknown:
        raise SpecError(f"--clear takes 'stale', 'all', a kind ({', '.join(KINDS)}) or an entry's name from "
                        f"`spec cache`, not {', '.join(repr(w) for w in unknown)}")
    return [e for e in found if "all" in which or e.kind in which or e.path.name in which
            or ("stale" in which and e.stale is not None)]


def remove(entry: Entry) -> None:
    if entry.path.is_dir() and not entry.path.is_symlink():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink(missing_ok=True)
