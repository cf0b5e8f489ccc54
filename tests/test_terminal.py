"""What a terminal shows: the live view's finished screen, the trace, and NO_COLOR (in a pseudo-terminal)."""

from __future__ import annotations

import json
import re
import sys

import pytest
from helpers import spec
from terminal import run, screen

from spec_cli.view import visible

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
COLOUR = {"NO_COLOR": "", "HF_HUB_OFFLINE": "1"}
ARGS = ["-n", "48", "--dtype", "float32", "-m", "staged", "--fixed-tree"]  # a tree every step: rejections
PROMPT = "def fib(n):\n"


def _reference(profile):
    record = json.loads(spec("generate", "-p", str(profile), PROMPT, *ARGS, "--json").stdout)
    assert any(e["kind"] == "rejected" for e in record["events"])  # there is something to clean up
    return record


def _rows(terminal) -> str:
    return "\n".join(row.rstrip() for row in terminal.display)


def test_the_finished_screen_holds_the_clean_completion(profile):
    """Rejected candidates show (struck through) while generating; afterwards the screen holds exactly the
    prompt and the completion, as the oracle alone would write it, and nothing struck through."""
    record = _reference(profile)
    code, data = run(["generate", "-p", str(profile), PROMPT, *ARGS], COLOUR)
    assert code == 0, data.decode(errors="replace")
    assert re.search(rb"\x1b\[[0-9;]*\b9[;m]", data)  # strike-through was drawn live
    terminal = screen(data)
    clean = "\n".join(line.rstrip() for line in visible(PROMPT + record["completion"]).split("\n"))
    assert clean in _rows(terminal), (_rows(terminal), clean)
    first = next(y for y, row in enumerate(terminal.display) if row.startswith("def fib(n):"))
    struck = [c.data for y in range(first, terminal.lines) for c in terminal.buffer[y].values() if c.strikethrough]
    assert not struck  # (the legend above, "rejected draft token", is struck through on purpose)
    assert "tok/s" in _rows(terminal).split(clean)[1]  # the statistics line below it


def test_trace_keeps_the_rejected_candidates(profile):
    record = _reference(profile)
    code, data = run(["generate", "-p", str(profile), PROMPT, *ARGS, "--trace"], COLOUR)
    assert code == 0
    terminal = screen(data)
    first = next(y for y, row in enumerate(terminal.display) if row.startswith("def fib(n):"))
    struck = [c.data for y in range(first, terminal.lines) for c in terminal.buffer[y].values() if c.strikethrough]
    assert struck  # still on the screen at the end
    plain = spec("generate", "-p", str(profile), PROMPT, *ARGS, "--trace")  # no colour: [-rejected-] inline
    assert plain.returncode == 0 and "[-" in plain.stdout
    assert re.sub(r"\[-.*?-\]", "", plain.stdout, flags=re.S) == record["completion"] + "\n"


def test_no_color_means_no_escape_codes_at_all(profile):
    code, data = run(["generate", "-p", str(profile), PROMPT, *ARGS], {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1"})
    assert code == 0 and b"tok/s" in data
    assert b"\x1b" not in data, data
    code, data = run(["-h"], {"NO_COLOR": "1"})
    assert code == 0 and b"Usage: spec" in data and b"\x1b" not in data, data
