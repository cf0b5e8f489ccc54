"""What staged's controllers learned, kept on disk, so that a new process starts where the last one ended.

A controller learns how long each model's forwards take by their size, how often the oracle takes what the
draft or the lookup offered, and whether speculating pays (`adapt.Controller.state`). That holds for one oracle
and draft (or skip set), one dtype and one machine, so it is kept per those, in the cache dir
(`<cache>/learned/<hash>.json`, one entry per way of decoding), written atomically at the end of every
completion. A file that cannot be read, or was written for something else, is ignored: it only costs what a
first run costs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from spec_cli.core.paths import cache_dir, write_whole
from spec_cli.decoding import adapt

FORMAT = 1


def folder() -> Path:
    return cache_dir() / "learned"


def path(key: dict) -> Path:
    text = json.dumps(key, sort_keys=True, default=str)
    return folder() / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def name(way) -> str:
    """A controller's way of decoding, (rule, sampler), as a name."""
    rule, sampler = way
    return json.dumps([rule, sampler.temperature, sampler.top_k, sampler.top_p, sampler.coupled])


class Controllers(dict):
    """staged's controllers for one draft (one per way of decoding), each starting from what the last process
    learned; `save()` keeps what they learned since. Without a key: fresh ones, kept by nobody (a bare `Models`)."""

    def __init__(self, key: dict | None = None, persist: bool = True):
        """`persist`: whether `save` writes (False: a server's slot, whose steps cost what they cost beside the
        others': it starts from the costs and calibration kept, measures whether speculating pays itself and
        keeps nothing)."""
        super().__init__()
        self.key, self.persist = key, persist and key is not None  # (no key: this process's alone, nothing read)
        self.file = path(key) if key is not None else None
        self.saved = self._read() if key is not None else {}

    def _read(self) -> dict:
        try:
            data = json.loads(self.file.read_text())
            if data.get("format") == FORMAT and data.get("key") == json.loads(json.dumps(self.key, default=str)):
                return dict(data["ways"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass
        return {}

    def __missing__(self, way) -> adapt.Controller:
        controller = adapt.Controller()
        state = self.saved.get(name(way))
        if state is not None:
            try:
                controller.restore(state)
                if not self.persist:
                    controller.forget_rates()
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                controller = adapt.Controller()  # written by another version: start afresh
        self[way] = controller
        return controller

    def save(self) -> None:
        """Write every way's state (and those of ways this process did not use, as they were), atomically: a
        reader sees the old file or the new one, never a part."""
        if not self or not self.persist:
            return
        self.saved.update({name(way): controller.state() for way, controller in self.items()})
        data = {"format": FORMAT, "key": self.key, "ways": self.saved}
        try:
            write_whole(self.file, json.dumps(data, default=str))
        except OSError:  # a read-only cache only costs a first run's probes next time
            pass
