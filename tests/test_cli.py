"""`spec` end to end, as a user runs it: output, exit codes, and one clear line for each mistake."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ENV, assert_clean_error, spec

from spec_cli.flags import FLAGS, SETTINGS


def spec_process(*args, env=None, stdin=None):
    """The real entry point in a child process, for what only a process shows."""
    return subprocess.run([sys.executable, "-m", "spec_cli", *args], capture_output=True, text=True,
                          env={**os.environ, **ENV, **(env or {})}, timeout=300, input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


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


def test_generate_json_gives_each_tokens_logprob_with_logprobs(profile):
    """--logprobs 3: every output token's log-probability and the three likeliest, the same (bfloat16: bit for bit)
    from staged as from baseline; without it, none."""
    runs = [json.loads(spec("generate", "-p", str(profile), "def fib(n):", "--json", "-n", "12", "--dtype", "bfloat16",
                            "-m", method, "--logprobs", "3").stdout) for method in ("baseline", "staged")]
    scored = [[(e["token"], e["logprob"], e["top"]) for e in r["events"] if e["kind"] != "rejected"] for r in runs]
    assert scored[0] == scored[1] and len(scored[0]) == 12
    assert all(len(top) == 3 and top[0][1] >= logprob for _, logprob, top in scored[0])
    plain = json.loads(spec("generate", "-p", str(profile), "def fib(n):", "--json", "-n", "4").stdout)
    assert all("logprob" not in e for e in plain["events"])
    bad = spec("generate", "-p", str(profile), "x", "--logprobs", "21")
    assert bad.returncode == 2 and "logprobs must be between 0 and 20" in bad.stderr


def test_stop_ends_the_completion_before_the_text_on_screen_and_in_json(profile):
    """--stop: the completion ends at the first of the given texts, cut before it, the same piped (nothing past
    it ever written, though the token that brought it carries more) and in JSON; reason "stop"."""
    args = ("generate", "-p", str(profile), "def fib(n):", "-n", "24", "--dtype", "float32", "--method", "staged")
    full = json.loads(spec(*args, "--json").stdout)["completion"]
    assert len(full) > 8 and "\n" in full
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # (from the middle: it may span tokens)
    cut = full[: full.find(stop)]
    record = json.loads(spec(*args, "--json", "--stop", "never there", "--stop", stop).stdout)
    assert record["completion"] == cut and record["stats"]["finish_reason"] == "stop"
    assert record["stats"]["new_tokens"] < 24 or full.find(stop) >= len(full) - 3
    piped = spec(*args, "--stop", stop)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.rstrip("\n") == cut.rstrip("\n") and "stopped: stop" in piped.stderr
    newline = spec(*args, "--json", "--stop", "\\n")  # (typed as backslash-n)
    assert json.loads(newline.stdout)["completion"] == full[: full.find("\n")]


def test_a_command_keeps_what_it_loaded_out_of_the_collectors_full_passes_while_it_runs(profile, monkeypatch):
    """Once loaded, a command's models, tokenizer and tables are frozen out of the garbage collector's full
    passes (a full pass over a loaded pair took ~230 ms, every thread stopped), and are the collector's again at
    its end (so that a process running commands in turn frees what each made)."""
    import gc

    from spec_cli.core import process

    frozen = []
    real = process.settle
    monkeypatch.setattr(process, "settle", lambda: (real(), frozen.append(gc.get_freeze_count())))
    result = spec("generate", "-p", str(profile), "def fib(n):", "-n", "8", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert len(frozen) == 1 and frozen[0] > 10_000 and gc.get_freeze_count() == 0


def test_a_command_makes_no_full_collector_pass_while_it_loads(profile, monkeypatch):
    """From the CLI's start until `settle`, the garbage collector makes no full pass (importing torch and loading a
    pair made ~11, 1.6 s of a 9.4 s start); after, they are on again, and the defaults are back at the end."""
    import gc

    from spec_cli.core import process
    from spec_cli.engine import Engine

    kept, passes, settled = [], [], []
    real_init, real_settle = Engine.__init__, process.settle

    def heavy_init(self, *args, **kwargs):  # a load that makes many lasting objects, as a real one does
        real_init(self, *args, **kwargs)
        kept.append([[i] for i in range(len(gc.get_objects()))])

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2 and not settled:
            passes.append(info)

    monkeypatch.setattr(Engine, "__init__", heavy_init)
    monkeypatch.setattr(process, "settle", lambda: (settled.append(gc.get_threshold()), real_settle()))
    before = gc.get_threshold()
    gc.callbacks.append(watch)
    try:
        result = spec("generate", "-p", str(profile), "def fib(n):", "-n", "8", "--dtype", "float32")
    finally:
        gc.callbacks.remove(watch)
    assert result.returncode == 0, result.stderr
    assert not passes and settled and settled[0][2] > 10**6
    assert gc.get_threshold() == before


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


def test_profile_names_never_wrap_in_80_columns():
    from spec_cli.models import profiles

    listing = spec("profiles", env={"COLUMNS": "80"})
    assert listing.returncode == 0
    lines = listing.stdout.split("\n\n")[0].splitlines()  # the table (the hint below it is soft-wrapped)
    assert max(len(line) for line in lines) <= 80
    for name in profiles.available():
        assert any(line.startswith(name + " ") for line in lines), (name, listing.stdout)


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
        result = spec(*args, "-m", "staged", "--draft2", draft2, "--tree-budget", "10", "--tree-depth", "4",
                      "--fixed-tree")  # (the controller kept from the last run might not draft in 20 tokens)
        record = json.loads(result.stdout)
        assert record["tokens"] == expected, draft2
        assert record["stats"]["forwards"]["draft"] > 0
    assert_clean_error(spec(*args, "-m", "staged", "--draft2", str(tmp_path / "none.npz")), "n-gram file not found")
    assert_clean_error(spec("fit-draft2", str(tmp_path / "x.npz"), "-p", str(profile), "--corpus",
                            str(tmp_path / "nothing")), "corpus path not found")


def test_every_decoding_flag_sets_its_setting(profile):
    """Each flag of spec_cli/flags.py that names a Decoding field sets it (a flag added there needs a value here)."""
    values = dict(method="staged", max_new_tokens=3, temperature=0.5, top_k=7, top_p=0.9, seed=3, sampling="rejection",
                  draft_tokens=2, tree_budget=9, tree_depth=3, tree_branching=2, tree_width=2, draft2_tokens=2,
                  tree_rule="specinfer", tree_mass=0.8, tree_adaptive=False, lookup=False, self_threshold=0.7,
                  logprobs=2)
    args = []
    for name in FLAGS.keys() & SETTINGS:
        flag, value = FLAGS[name].names[0], values[name]
        if isinstance(value, bool):
            on, off = flag.split("/")
            args.append(on if value else off)
        else:
            args += [flag, str(value)]
    result = spec("generate", "-p", str(profile), "def fib(n):", "--json", *args)
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert {name: settings[name] for name in FLAGS.keys() & SETTINGS} == values


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
    (["-m", "self"], "`spec tune --profile PROFILE --only skip` finds one"),  # the profile as it was given: a path
    (["-m", "self", "--skip-mlp", "7"], "skips layer 7, but the oracle has layers 0..2"),
    (["-m", "self", "--skip-attention", "1;2"], "--skip-attention takes layer numbers"),
])
def test_self_speculative_mistakes(profile, args, message):
    assert_clean_error(spec("generate", "-p", str(profile), "x", *args), message.replace("PROFILE", str(profile)))


@pytest.mark.parametrize("args, code, shown, line", [
    (["-h"], 0, "Usage: spec [OPTIONS] COMMAND", None),
    ([], 0, "Usage: spec [OPTIONS] COMMAND", None),
    (["generate", "-h"], 0, "Usage: spec generate", None),
    (["bench"], 0, "Usage: spec bench", None),
    (["gen", "x"], 2, None, "unknown command 'gen' for spec (did you mean generate?)"),
    (["bench", "humanevl"], 2, None, "unknown command 'humanevl' for spec bench (did you mean humaneval?)"),
    (["generate", "--temp", "0.5", "x"], 2, None,
     "unknown option --temp for spec generate (did you mean --temperature?)"),
    (["generate", "--top", "3", "x"], 2, None, "unknown option --top for spec generate (did you mean --top-k or --top-p?)"),
    (["generate", "-t", "abc", "x"], 2, None, "--temperature/-t takes a number, not 'abc'"),
    (["bench", "humaneval", "--limit"], 2, None, "option --limit needs a value"),
    (["generate", "def", "fib"], 2, None, "spec generate: unexpected extra argument(s): fib (put quotes around a "
                                          "prompt that has spaces)"),
])
def test_usage_through_the_real_entry_point(args, code, shown, line):
    """-h is --help, bare `spec` is the help, and each usage mistake is one line naming it, exit 2."""
    result = spec_process(*args)
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr and "Error" not in result.stderr + result.stdout
    if shown:
        assert shown in result.stdout and not result.stderr.strip()
    else:
        assert [x for x in result.stderr.splitlines() if x.strip()] == [f"error: {line}"] and not result.stdout


@pytest.mark.parametrize("command", [["generate", "x"], ["chat"], ["bench", "humaneval"], ["tune"]])
def test_dtype_is_checked_in_one_place(command):
    assert_clean_error(spec(*command, "--dtype", "int3"), "--dtype must be one of auto, float32, bfloat16, "
                                                          "float16, not 'int3'")


def test_a_piped_prompt_needs_no_argument(profile):
    args = ("generate", "-p", str(profile), "-n", "8", "--dtype", "float32", "--json")
    piped, dash = spec(*args, stdin="import os\n"), spec(*args, "-", stdin="import os\n")
    assert json.loads(piped.stdout)["prompt"] == "import os\n"
    assert json.loads(piped.stdout)["tokens"] == json.loads(dash.stdout)["tokens"]
    assert_clean_error(spec(*args, tty=True), "missing prompt: give it as an argument, or pipe it")
    assert_clean_error(spec(*args, stdin=""), "nothing came on standard input")
    real = spec_process("generate", "-p", str(profile), "-n", "8", "--dtype", "float32", stdin="import os\n")
    assert real.returncode == 0 and real.stdout.strip() and "tok/s" in real.stderr, real.stderr


def test_a_pair_without_a_profile(profile, tiny_dir, tmp_path):
    """--oracle/--draft name the models for generate, chat, bench and tune; hints repeat them."""
    pair = ("--oracle", str(tiny_dir / "gpt2-oracle"), "--draft", str(tiny_dir / "gpt2-draft"))
    common = ("-n", "12", "--dtype", "float32")
    record = json.loads(spec("generate", *pair, "def fib(n):", *common, "--json").stdout)
    base = json.loads(spec("generate", "-p", str(profile), "def fib(n):", *common, "--json", "-m", "baseline").stdout)
    assert record["tokens"] == base["tokens"] and record["method"] == "staged"
    assert record["stats"]["forwards"]["draft"] > 0 and "gpt2-oracle+" in record["profile"]
    chat = spec("chat", *pair, "-m", "speculative", *common, stdin="hi\n")
    assert chat.returncode == 0 and f"spec chat · {record['profile']} · speculative" in chat.stderr, chat.stderr
    dataset = tmp_path / "one.jsonl"
    dataset.write_text(json.dumps({"task_id": "T/0", "prompt": "def add(a, b):\n"}) + "\n")
    bench = spec("bench", "humaneval", *pair, "--dataset", str(dataset), "--out", str(tmp_path / "b"), *common,
                 "--modes", "greedy", "--methods", "baseline,staged")
    assert bench.returncode == 0, bench.stderr
    assert all(r["identical"] for r in map(json.loads, (tmp_path / "b" / "results.jsonl").read_text().splitlines()))
    shown = spec("tune", *pair, "--show", env={"XDG_DATA_HOME": str(tmp_path / "data")})
    assert shown.returncode == 0 and f"run `spec tune {' '.join(pair)}`" in shown.stdout
    alone = json.loads(spec("generate", *pair[:2], "def fib(n):", *common, "--json").stdout)  # no draft: lookup
    plain = json.loads(spec("generate", *pair[:2], "def fib(n):", *common, "--json", "-m", "baseline").stdout)
    assert alone["method"] == "staged" and alone["tokens"] == plain["tokens"] == base["tokens"]
    assert "draft" not in alone["stats"]["forwards"]
    chat = spec("chat", *pair[:2], *common, stdin="hi\n")  # the oracle alone chats too, staged by lookup
    assert chat.returncode == 0 and f"spec chat · {alone['profile']} · staged" in chat.stderr, chat.stderr
    assert_clean_error(spec("generate", *pair[:2], "x", "-m", "speculative"), "method 'speculative' needs a draft model")
    assert_clean_error(spec("generate", *pair[2:], "x"), "--draft needs --oracle MODEL")


def test_statistics_people_compare(profile):
    """Load time, prompt processing apart from generation, and peak memory, on the line and in --json."""
    args = ("generate", "-p", str(profile), "def fib(n):", "-n", "16", "--dtype", "float32")
    line = [x for x in spec(*args).stderr.splitlines() if "tok/s" in x][0]
    for pattern in (r"^16 tokens in \d+\.\d\d s · \d+\.\d tok/s · prompt 5 tokens at \d+ tok/s · generation "
                    r"\d+\.\d tok/s · ", r" · load \d+\.\d\d s", r" · peak RAM \d+(\.\d)? (MiB|GiB)$"):
        assert re.search(pattern, line), (pattern, line)
    record = json.loads(spec(*args, "--json").stdout)
    assert record["prompt_tokens"] == 5 and record["stats"]["prompt_tokens"] == 5
    assert 0 < record["first_token_seconds"] < record["seconds"] and record["load_seconds"] > 0
    assert record["prompt_tokens_per_second"] > 0 and record["generation_tokens_per_second"] > 0
    assert record["peak_memory"]["kind"] == "RAM" and record["peak_memory"]["bytes"] > 50 * 2**20


def test_every_options_help_shows_whole_with_its_default():
    """An option's help reaches --help whole: rich took '[default: ...]' for a style and dropped it."""
    import typer

    from spec_cli.cli import app

    def commands(group, path):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):  # (a group: typer's own click, not the click package)
                yield from commands(command, path + [name])
            else:
                yield path + [name], command

    checked = 0
    for path, command in commands(typer.main.get_command(app), []):
        shown = " ".join(spec(*path, "--help", env={"COLUMNS": "300"}).stdout.replace("│", " ").split())
        for param in command.params:
            for default in re.findall(r"\[default: [^\]]*\]", getattr(param, "help", None) or ""):
                assert default.replace("\\", "") in shown, (path, param.name)
                checked += 1
    assert checked >= 8
