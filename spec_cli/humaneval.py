"""HumanEval (OpenAI, MIT licence): 164 Python problems; downloaded once into the cache, or a local file."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import platformdirs

from spec_cli.core.errors import SpecError

URL = "https://github.com/openai/human-eval/raw/master/data/HumanEval.jsonl.gz"
# Codex-style stops: the function is done when a new top-level statement begins
CODE_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def cached_path() -> Path:
    return Path(platformdirs.user_cache_dir("spec")) / "HumanEval.jsonl.gz"


def download(target: Path) -> Path:
    import urllib.request

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    try:
        with urllib.request.urlopen(URL, timeout=30) as response, partial.open("wb") as f:
            f.write(response.read())
    except OSError as e:
        raise SpecError(f"cannot download HumanEval from {URL} ({e}); pass a local copy with --dataset PATH") from None
    partial.rename(target)
    return target


def load(path: str | Path | None = None) -> list[dict]:
    """The problems of a .jsonl or .jsonl.gz file (default: the cached download). A line needs a 'prompt'; one
    without a 'task_id' is named by the file and its place, so any file of prompts is a dataset (no tests: no
    --check)."""
    if path is None:
        path = cached_path()
        if not path.is_file():
            download(path)
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"dataset not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")  # (a prompt file's lines are named by it)
    problems = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecError(f"{path}:{number}: not a JSON object ({e.msg})") from None
                if isinstance(row, dict) and "task_id" not in row:
                    row["task_id"] = f"{name}/{len(problems)}"
                if not isinstance(row, dict) or not isinstance(row.get("task_id"), str) \
                        or not isinstance(row.get("prompt"), str):
                    raise SpecError(f"{path}:{number}: each line needs a string 'prompt' (and 'task_id', if any)")
                problems.append(row)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read the dataset {path}: {e}") from None
    if not problems:
        raise SpecError(f"{path}: no problems in the dataset")
    return problems


def select(problems: list[dict], tasks: list[str] | None, limit: int | None) -> list[dict]:
    """The problems named by `tasks` (ids, numbers and ranges of numbers, each number the id of that number
    under the dataset's first id's prefix: HumanEval/3, or prompts/3 for a file of prompts), then `limit`."""
    if tasks:
        first = problems[0]["task_id"] if problems else ""
        prefix = first.rpartition("/")[0] if "/" in first else "HumanEval"
        known = {p["task_id"] for p in problems}
        wanted = set()
        for item in tasks:
            for part in item.split(","):
                part = part.strip()
                low, dash, high = part.partition("-")
                if dash and low.isdigit() and high.isdigit():  # a range: 100-111
                    wanted.update(f"{prefix}/{i}" for i in range(int(low), int(high) + 1))
                else:
                    wanted.add(part if "/" in part or part in known else f"{prefix}/{part}")
        missing = sorted(wanted - known)
        if missing:
            raise SpecError(f"unknown task(s): {', '.join(missing)}")
        problems = [p for p in problems if p["task_id"] in wanted]
    return problems[:limit] if limit else problems


def truncate(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def check(problem: dict, completion: str, timeout: float = 10.0) -> bool:
    """Run the problem's tests on prompt + completion in a separate Python process. EXECUTES MODEL-WRITTEN CODE."""
    if "test" not in problem or "entry_point" not in problem:
        raise SpecError(f"{problem['task_id']}: the dataset has no tests to --check against")
    program = (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n"
               + f"check({problem['entry_point']})\n")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "check.py"
        script.write_text(program)
        try:
            result = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True, timeout=timeout,
                                    env={"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0
