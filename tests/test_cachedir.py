"""`spec cache`: what the cache dir holds, which of it is stale, and clearing it (entries made as spec makes them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import assert_clean_error, spec

from spec_cli import __version__, cachedir
from spec_cli.exec import native
from spec_cli.models import gguf

OLD = time.time() - 2 * cachedir.UNFINISHED


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPEC_NATIVE_DIR", raising=False)
    return tmp_path / "cache"


def gguf_copy(root, model, name, layout=gguf.LAYOUT, finished=True):
    """A read GGUF file's folder, as `gguf._load_model` names it, and the file's hash as `gguf.sha256` keeps it."""
    digest = gguf.sha256(model)
    folder = root / "gguf" / f"{digest[:16]}-{name}-v{layout}"
    folder.mkdir(parents=True)
    (folder / "weights.safetensors").write_bytes(b"\0" * 1000)
    if finished:
        (folder / "source.json").write_text(json.dumps({"file": str(model)}))
    return folder


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.fixture
def filled(root, tmp_path):
    """A cache dir with one entry of each case; returns {name: stale or not}."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\1" * 100)
    moved = tmp_path / "moved.gguf"
    moved.write_bytes(b"GGUF" + b"\2" * 100)
    expect = {}
    expect[gguf_copy(root, model, "bfloat16-file").name] = False
    expect[gguf_copy(root, model, "float32-file", layout=gguf.LAYOUT - 1).name] = True
    expect[gguf_copy(root, moved, "bfloat16-int4").name] = True
    moved.write_bytes(b"GGUF" + b"\3" * 101)  # (its contents changed: that copy is of no file now)
    later = time.time() + 60
    for name, stale in (("touched", False), ("rewritten", True)):  # (both: the same size, a new modification time)
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"GGUF" + name.encode() * 10)
        expect[gguf_copy(root, path, "bfloat16-file").name] = stale
        if stale:
            path.write_bytes(b"GGUF" + name.upper().encode() * 10)
        os.utime(path, (later, later))
    unfinished = gguf_copy(root, model, "float16-file", finished=False)
    os.utime(unfinished, (OLD, OLD))
    expect[unfinished.name] = True
    expect[gguf_copy(root, model, "float32-int8", finished=False).name] = False  # (being written now, perhaps)
    crashed = gguf_copy(root, model, "bfloat16-none", finished=False)
    crashed = crashed.rename(crashed.with_name(crashed.name + ".partial"))  # (as `gguf.build` writes it)
    os.utime(crashed, (OLD, OLD))
    expect[crashed.name] = True
    target = native.variant()
    for tag, stale in ([(native.build_tag(target), False)] if target else []) + [("0123456789ab", True)]:
        (root / "native" / f"int4-{tag}").mkdir(parents=True)
        (root / "native" / f"int4-{tag}" / "spec_int4.so").write_bytes(b"\0" * 10)
        expect[f"int4-{tag}"] = stale
    for made, stale in ((__version__, False), ("0.0.1", True)):
        path = root / "checks" / f"llama-{made}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": {"model_type": "llama", "spec": made}, "ok": True}))
        expect[path.name] = stale
    for pid, stale in ((os.getpid(), False), (dead_pid(), True)):
        (root / "offload" / f"model-pid{pid}").mkdir(parents=True)
        expect[f"model-pid{pid}"] = stale
    (root / "draft2").mkdir()
    (root / "draft2" / "corpus-0123.npz").write_bytes(b"\0" * 50)
    expect["corpus-0123.npz"] = False
    (root / "heads").mkdir()
    (root / "heads" / "0123.pt").write_bytes(b"\0" * 40)
    expect["0123.pt"] = False
    return expect


def test_each_entry_is_found_and_called_stale_exactly_when_it_can_never_be_used(filled):
    found = {e.path.name: e for e in cachedir.entries()}
    assert {name: e.stale is not None for name, e in found.items()} == filled
    stale = {name: e.stale for name, e in found.items() if e.stale}
    assert any("older layout" in why for why in stale.values())
    assert any("gone or changed" in why for why in stale.values())
    assert all(e.bytes > 0 for e in found.values() if e.kind in ("gguf", "native", "draft2", "heads"))


def test_spec_cache_lists_every_entry_and_clears_the_stale_then_a_kind(filled, root):
    listed = spec("cache")
    assert listed.returncode == 0, listed.stderr
    for name in filled:
        assert name in listed.stdout
    stale = sum(filled.values())
    assert f"{stale} stale" in listed.stdout and "--clear stale" in listed.stdout
    cleared = spec("cache", "--clear", "stale")
    assert cleared.returncode == 0 and f"{stale} removed" in cleared.stdout
    left = {e.path.name for e in cachedir.entries()}
    assert left == {name for name, was_stale in filled.items() if not was_stale}
    assert spec("cache", "--clear", "gguf").returncode == 0
    assert not any(e.kind == "gguf" for e in cachedir.entries())
    assert any(e.kind == "draft2" for e in cachedir.entries())
    assert spec("cache", "--clear", "all").returncode == 0 and cachedir.entries() == []
    assert "holds nothing" in spec("cache").stdout


def test_spec_cache_json_lists_each_entry_and_what_a_clearing_removed(filled, root):
    listed = spec("cache", "--json")
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout)
    assert {e["name"]: e["stale"] is not None for e in found["entries"]} == filled
    assert found["bytes"] == sum(e["bytes"] for e in found["entries"]) > found["stale_bytes"] > 0
    cleared = json.loads(spec("cache", "--clear", "stale", "--json").stdout)
    assert {e["name"] for e in cleared["removed"]} == {name for name, stale in filled.items() if stale}
    assert cleared["freed_bytes"] == found["stale_bytes"]
    assert {e.path.name for e in cachedir.entries()} == {name for name, stale in filled.items() if not stale}


def test_clearing_what_spec_does_not_keep_is_one_line(filled):
    assert_clean_error(spec("cache", "--clear", "models"), "--clear takes 'stale'")
    assert len(cachedir.entries()) == len(filled)


def test_unused_for_narrows_the_list_and_the_clearing_to_what_was_not_used_lately(filled, root):
    found = cachedir.entries()
    old = {e.path.name for e in found[::2]}
    for entry in found:
        if entry.path.name in old:
            os.utime(entry.path, (time.time() - 40 * 86400,) * 2)
    listed = spec("cache", "--unused-for", "30")
    assert listed.returncode == 0 and all((name in listed.stdout) == (name in old) for name in filled)
    assert spec("cache", "--clear", "all", "--unused-for", "30").returncode == 0
    assert {e.path.name for e in cachedir.entries()} == set(filled) - old
    assert_clean_error(spec("cache", "--unused-for", "-1"), "--unused-for takes days")
