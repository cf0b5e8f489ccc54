"""`spec` end to end, as a user runs it: output, exit codes, and one clear line for each mistake."""

import contextlib
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest

from spec_cli.cli import main
from tiny import make_model, make_tokenizer

ENV = {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}


def spec(*args, stdin=None, env=None):
    """Run `spec` in this process (fast): exit code, stdout and stderr as a subprocess would give them."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.dict(os.environ, {**ENV, **(env or {})}), mock.patch.object(sys, "argv", ["spec", *args]), \
            mock.patch.object(sys, "stdin", io.StringIO(stdin or "")), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def spec_process(*args, env=None):
    """The real entry point in a child process, for what only a process shows."""
    return subprocess.run([sys.executable, "-m", "spec_cli", *args], capture_output=True, text=True,
                          env={**os.environ, **ENV, **(env or {})}, timeout=300)


def assert_clean_error(result, pattern):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0], lines[0]


@pytest.fixture(scope="module")
def profile(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    path = folder / "tiny.toml"
    path.write_text(
        f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "{tiny_dir / "gpt2-draft"}"\n'
        '[decoding]\nmethod = "speculative"\nmax_new_tokens = 24\ndraft_tokens = 3\n'
    )
    return path


def test_generate_plain_text_equals_baseline(profile):
    spec_run = spec("generate", "-p", str(profile), "def fib(n):", "--dtype", "float32")
    base_run = spec("generate", "-p", str(profile), "def fib(n):", "--dtype", "float32", "--method", "baseline")
    assert spec_run.returncode == 0, spec_run.stderr
    assert spec_run.stdout == base_run.stdout and spec_run.stdout.strip()
    assert "\x1b[" not in spec_run.stdout  # not a terminal: no escape codes
    assert "tok/s" in spec_run.stderr and "oracle forwards" in spec_run.stderr


def test_generate_json_and_stdin(profile):
    result = spec("generate", "-p", str(profile), "-", "--json", "-n", "10", "--dtype", "float32",
                  stdin="import os\n")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["prompt"] == "import os\n" and len(record["tokens"]) == 10
    assert record["stats"]["new_tokens"] == 10 and record["method"] == "speculative"
    assert {e["kind"] for e in record["events"]} <= {"accepted", "rejected", "corrected", "bonus"}
    assert record["dtype"] == "float32"


def test_sampling_flags_are_reproducible(profile):
    args = ("generate", "-p", str(profile), "x = ", "-t", "1.0", "--top-k", "20", "--seed", "7", "--json")
    a, b = spec(*args), spec(*args)
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_colour_view_on_a_terminal(profile):
    """Forced colour (as on a terminal): green accepted, red struck-through rejected, blue oracle tokens."""
    result = spec("generate", "-p", str(profile), "def fib(n):", "-n", "24", "--dtype", "float32",
                  env={"NO_COLOR": "", "FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "accepted draft token" in out and "rejected draft token" in out  # the legend
    assert "\x1b[32m" in out and "\x1b[34m" in out  # green and blue
    assert "\x1b[9;31m" in out or "\x1b[31;9m" in out  # red, struck through


def test_bad_input_is_one_clear_line(profile, tmp_path):
    assert_clean_error(spec("generate", "-p", "nope", "x"), "no profile named 'nope'")
    assert_clean_error(spec("generate", "-p", str(profile), "x", "--dtype", "int3"), "--dtype must be one of")
    assert_clean_error(spec("generate", "-p", str(profile), "x", "-t", "-1"), "temperature must be >= 0")
    missing = tmp_path / "missing.toml"
    missing.write_text('oracle = "./not-here"\n')
    assert_clean_error(spec("generate", "-p", str(missing), "x"), "model folder not found")
    hub = tmp_path / "hub.toml"
    hub.write_text('oracle = "no-such-org/no-such-model"\n')
    assert_clean_error(spec("generate", "-p", str(hub), "x"), "no-such-org/no-such-model")
    broken = tmp_path / "broken.toml"
    broken.write_text('oracle = "x"\n[decoding]\nmax_new_tokens = 1.5\n')
    assert_clean_error(spec("generate", "-p", str(broken), "x"), "broken.toml:3:")


def test_the_real_entry_point(profile, tmp_path):
    result = spec_process("generate", "-p", str(profile), "def fib(n):", "-n", "8")
    assert result.returncode == 0 and result.stdout.strip() and "tok/s" in result.stderr
    assert_clean_error(spec_process("generate", "-p", str(tmp_path / "none.toml"), "x"), "profile file not found")


def test_prompt_longer_than_the_context_window(profile):
    long_prompt = "def f(x):\n    return x\n" * 200
    assert_clean_error(spec("generate", "-p", str(profile), long_prompt), "context window is 256 tokens")


def test_oracle_and_draft_must_share_a_vocabulary(tiny_dir, tmp_path):
    other = make_tokenizer(tmp_path / "other-tok", vocab_size=280)
    make_model(tmp_path / "other", "gpt2", len(other), layers=1, width=32, seed=5, tokenizer=other)
    path = tmp_path / "mismatch.toml"
    path.write_text(f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "{tmp_path / "other"}"\n')
    assert_clean_error(spec("generate", "-p", str(path), "x"), "do not share a vocabulary")


def test_llama_profile_runs(tiny_dir, tmp_path):
    path = tmp_path / "llama.toml"
    path.write_text(f'oracle = "{tiny_dir / "llama-oracle"}"\ndraft = "{tiny_dir / "llama-draft"}"\n')
    spec_run = spec("generate", "-p", str(path), "for i in", "-n", "16", "--json", "--dtype", "float32")
    base_run = spec("generate", "-p", str(path), "for i in", "-n", "16", "--json", "--dtype", "float32",
                    "-m", "baseline")
    assert json.loads(spec_run.stdout)["tokens"] == json.loads(base_run.stdout)["tokens"]


def test_profiles_command(profile):
    listing = spec("profiles")
    assert listing.returncode == 0 and "gpt2l" in listing.stdout and "built-in" in listing.stdout
    shown = spec("profiles", str(profile))
    assert shown.returncode == 0 and "gpt2-oracle" in shown.stdout and "draft_tokens = 3" in shown.stdout


def test_staged_with_each_draft2_equals_baseline(profile, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def fib(n):\n    return n\n" * 50)
    fitted = spec("fit-draft2", str(tmp_path / "corpus.npz"), "-p", str(profile), "--corpus", str(corpus))
    assert fitted.returncode == 0 and (tmp_path / "corpus.npz").is_file(), fitted.stderr
    sampled = spec("fit-draft2", str(tmp_path / "sampled.npz"), "-p", str(profile), "--tokens", "3000")
    assert sampled.returncode == 0 and (tmp_path / "sampled.npz").is_file(), sampled.stderr
    args = ("generate", "-p", str(profile), "def fib(n):", "-n", "20", "--json", "--dtype", "float32")
    expected = json.loads(spec(*args, "-m", "baseline").stdout)["tokens"]
    for draft2 in ("none", "prompt-lookup", str(tmp_path / "corpus.npz"), str(tmp_path / "sampled.npz"),
                   "prompt-lookup+" + str(tmp_path / "corpus.npz")):
        result = spec(*args, "-m", "staged", "--draft2", draft2, "--tree-budget", "10", "--tree-depth", "4")
        record = json.loads(result.stdout)
        assert record["tokens"] == expected, draft2
        assert record["stats"]["forwards"]["draft"] > 0
    assert_clean_error(spec(*args, "-m", "staged", "--draft2", str(tmp_path / "none.npz")), "n-gram file not found")
    assert_clean_error(spec("fit-draft2", str(tmp_path / "x.npz"), "-p", str(profile), "--corpus",
                            str(tmp_path / "nothing")), "corpus path not found")


def test_self_speculative_from_flags_and_from_a_self_draft_profile(profile, tiny_dir, tmp_path):
    base = spec("generate", "-p", str(profile), "def fib(n):", "-m", "baseline", "--dtype", "float32", "--json")
    expected = json.loads(base.stdout)["tokens"]
    flags = spec("generate", "-p", str(profile), "def fib(n):", "-m", "self", "--skip-attention", "1",
                 "--skip-mlp", "0,2", "--dtype", "float32", "--json")
    record = json.loads(flags.stdout)
    assert record["tokens"] == expected and record["method"] == "self"
    assert record["stats"]["forwards"]["draft"] > 0
    selfish = tmp_path / "selfish.toml"
    selfish.write_text(f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "self"\n'
                       '[self_draft]\nskip_attention = [1]\nskip_mlp = [2]\n'
                       '[decoding]\nmax_new_tokens = 24\n')
    for method in ("self", "staged", "speculative"):
        got = spec("generate", "-p", str(selfish), "def fib(n):", "-m", method, "--dtype", "float32", "--json")
        assert json.loads(got.stdout)["tokens"] == expected, method


@pytest.mark.parametrize("args, message", [
    (["-m", "self"], "method 'self' needs a skip set"),
    (["-m", "self", "--skip-mlp", "7"], "skips layer 7, but the oracle has layers 0..2"),
    (["-m", "self", "--skip-attention", "1;2"], "--skip-attention takes layer numbers"),
])
def test_self_speculative_mistakes(profile, args, message):
    assert_clean_error(spec("generate", "-p", str(profile), "x", *args), message)
