"""The Hugging Face hub: one way to fetch from it, failing at once and in one line when it cannot be reached."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from spec_cli.core.errors import SpecError, first_line

T = TypeVar("T")
FRESH = 60.0  # seconds a look-up of the hub's address is trusted (a server started offline comes back online)
_looked: tuple[float, bool] | None = None


def host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"


def reachable() -> bool:
    """A fast look-up of the hub's address, so an offline machine fails at once instead of retrying."""
    global _looked
    now = time.monotonic()
    if _looked is None or now - _looked[0] > FRESH:
        import socket

        try:
            socket.getaddrinfo(host(), 443)
            _looked = (now, True)
        except OSError:
            _looked = (now, False)
    return _looked[1]


def fetch(cached: Callable[[], T], online: Callable[[], T], what: str, command: str, elsewhere: str) -> T:
    """`cached()` (the hub's cache only), else `online()`; each failure one line. `what`: the thing asked for,
    as the messages name it; `command`: how to download it once online; `elsewhere`: what else to do."""
    try:
        return cached()
    except Exception:  # noqa: BLE001 - not cached: fetch it below
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SpecError(f"{what} is not in the Hugging Face cache and HF_HUB_OFFLINE=1; fetch it once online "
                        f"with: {command}")
    if not reachable():
        raise SpecError(f"{what} is not in the Hugging Face cache, and the hub ({host()}) cannot be reached "
                        f"from here; download it once online with `{command}`, or {elsewhere}")
    try:
        return online()
    except Exception as e:  # noqa: BLE001 - any hub failure is one line
        raise SpecError(f"cannot get {what} from the hub ({first_line(e)}). Check the name, or download it "
                        f"when online with `{command}`, or {elsewhere}") from None
