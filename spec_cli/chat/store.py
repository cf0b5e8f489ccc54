"""Saved conversations: where they go, and reading one back (checked)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from pathlib import Path

import platformdirs

from spec_cli.core.errors import SpecError
from spec_cli.core.paths import write_whole
from spec_cli.core.settings import Decoding


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir("spec"))


def chats_dir() -> Path:
    return data_dir() / "chats"


def write(path: Path | None, snapshot: dict) -> Path:
    """Write a conversation (a new file in the data folder when `path` is None); the path written."""
    return write_whole(path or new_chat_path(), json.dumps(snapshot, ensure_ascii=False, indent=2) + "\n")


def new_chat_path(folder: Path | None = None) -> Path:
    """A new conversation's file in `folder` (the data folder's chats/ unless given), named for now."""
    folder = folder or chats_dir()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = folder / f"chat-{stamp}.json"
    n = 2
    while path.exists():
        path = folder / f"chat-{stamp}-{n}.json"
        n += 1
    return path


def saved_settings(saved: dict, settings: Decoding, overrides: dict | None = None) -> Decoding:
    """The settings a saved conversation had (else `settings`), with the flags given now on top."""
    if not saved.get("settings"):
        return settings
    known = {f.name for f in dataclasses.fields(Decoding)}
    restored = Decoding(**{k: v for k, v in saved["settings"].items() if k in known})
    return restored.replace(**(overrides or {}))


def read_saved(path: Path) -> dict:
    """A conversation written by /save, checked."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"no saved conversation at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not a saved conversation (invalid JSON: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("messages", []), list):
        raise SpecError(f"{path} is not a saved conversation (expected an object with 'messages')")
    for m in data.get("messages", []):
        if not (isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)):
            raise SpecError(f"{path}: each message needs a role (user or assistant) and a content string")
    if data.get("profile_args") is not None and not isinstance(data["profile_args"], str):
        raise SpecError(f"{path}: 'profile_args' must be a string")
    if data.get("system") is not None and not isinstance(data["system"], str):
        raise SpecError(f"{path}: 'system' must be a string")
    if data.get("settings") is not None:
        if not isinstance(data["settings"], dict):
            raise SpecError(f"{path}: 'settings' must be an object")
        known = {f.name for f in dataclasses.fields(Decoding)}
        try:
            Decoding(**{k: v for k, v in data["settings"].items() if k in known})
        except TypeError as e:
            raise SpecError(f"{path}: bad settings: {e}") from None
        except SpecError as e:
            raise SpecError(f"{path}: bad settings: {e}") from None
    return data
