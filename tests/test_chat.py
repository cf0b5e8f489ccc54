"""`spec chat`: piped sessions through the CLI, every command, greedy replies identical to baseline decoding
of the same transcript, the KV cache kept between turns, Ctrl-C, context overflow and chat templates."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import ENV, spec
from rich.console import Console
from terminal import read_until
from tiny import make_model

from spec_cli.chat import commands, reply, templates, terminal
from spec_cli.chat import session as chat_mod
from spec_cli.core.errors import SpecError
from spec_cli.core.events import BONUS, Token
from spec_cli.core.hardware import pick_device
from spec_cli.core.settings import Decoding, ModelRef, Profile
from spec_cli.engine import Engine
from spec_cli.exec import Runner
from spec_cli.models import profiles as profile_store

JINJA = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch):
    """Saved chats and the history go to a temporary data dir, never the user's."""
    home = tmp_path / "data-home"
    monkeypatch.setenv("XDG_DATA_HOME", str(home))
    return home / "spec"


def stats_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "tok/s" in line and "oracle forwards" in line]


@pytest.fixture(scope="module")
def profiles(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-profiles")
    paths = {}
    for arch in ("gpt2", "llama"):
        paths[arch] = folder / f"{arch}.toml"
        paths[arch].write_text(
            f'oracle = "{tiny_dir / f"{arch}-oracle"}"\ndraft = "{tiny_dir / f"{arch}-draft"}"\n'
            'dtype = "float32"\n[decoding]\nmethod = "staged"\nmax_new_tokens = 12\ntree_budget = 8\n'
        )
    return paths


@pytest.fixture(scope="module")
def engines(profiles):
    """One engine per architecture (with the draft) and a baseline-only one, shared by the module."""
    loaded = {}
    for arch, path in profiles.items():
        profile = profile_store.load(str(path))
        loaded[arch] = (profile, Engine(profile, dtype="float32"), Engine(profile, dtype="float32", need_draft=False))
    return loaded


def session(engine, profile, template=None, **settings) -> chat_mod.Chat:
    out, err = io.StringIO(), io.StringIO()
    chat = chat_mod.Chat(engine, profile, profile.decoding.replace(**settings),
                         template or templates.choose_template(profile, engine.tokenizer),
                         out=Console(file=out, highlight=False, soft_wrap=True, no_color=True),
                         err=Console(file=err, highlight=False, soft_wrap=True, no_color=True))
    chat.stdout, chat.stderr = out, err
    return chat


def baseline_tokens(engine, ids: list[int], max_new_tokens: int) -> list[int]:
    settings = Decoding(method="baseline", max_new_tokens=max_new_tokens)
    return [e.token for e in engine.events(ids, settings, reuse=False) if isinstance(e, Token) and e.output]


def check_against_baseline(chat, base_engine, history: list[list[dict]]):
    """Each reply is what the oracle alone gives for the transcript re-rendered from scratch."""
    assert len(chat.turns) == len(history)
    for turn, messages in zip(chat.turns, history):
        ids = templates.prompt_ids(base_engine.tokenizer, chat.template, chat.system, messages)
        assert turn.prompt == ids
        expected = baseline_tokens(base_engine, ids, chat.settings.max_new_tokens)
        if turn.reason == "stop":  # cut where the model began the next "User:" turn
            assert expected[: len(turn.tokens)] == turn.tokens
        else:
            assert turn.reason in ("eos", "length")
            assert turn.tokens == expected


@pytest.mark.parametrize("arch,method", [("gpt2", "staged"), ("gpt2", "speculative"), ("llama", "staged"),
                                         ("llama", "speculative")])
def test_greedy_replies_equal_baseline_and_reuse_the_cache(engines, monkeypatch, arch, method):
    profile, engine, base = engines[arch]
    chat = session(engine, profile, method=method)
    chat.system = "You write Python."
    commits = []  # tokens each oracle forward committed, per turn: the first is the prompt part it ran
    forward = Runner.forward

    def counting(self, tokens, *args, **kwargs):
        if self is engine._runners.get("oracle", (None,))[0]:
            commits[-1].append(kwargs.get("commit", args[0] if args else 0))
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(Runner, "forward", counting)
    history = []
    for text in ("def fib(n):", "import os", "for i in range(10):"):
        commits.append([])
        history.append(chat.messages + [{"role": "user", "content": text}])
        assert chat.send(text) is not None
    commits.append([])
    history.append(chat.messages[:-1])
    previous = chat.messages[-1]["content"]
    chat.command("/regen")
    assert chat.messages[-1]["content"] == previous  # greedy: /regen gives the same reply
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3
    check_against_baseline(chat, base, history)
    for t in range(1, 4):  # later turns run only what the cache does not hold
        new, old = len(chat.turns[t].prompt), len(chat.turns[t - 1].prompt)
        ran = commits[t][0]
        assert ran <= new - old + 1 if t < 3 else ran <= 1, (t, ran, new, old)


def test_piped_session_with_every_command(profiles, tmp_path, data_home):
    saved = tmp_path / "saved.json"
    script = "\n".join([
        "/help", "def fib(n):", "/show", "/set temperature hot", "/set top-k 5", "/set max_tokens 8",
        "/set temperature 0", "/set bogus 1", "/set method nope", "/system You are terse.", "/sytem x",
        '"""', "line one", "line two", '"""', "//slash", "/regen", "/stats", f"/save {saved}", "/clear",
        "/show", "/wat", "/exit", "never read",
    ]) + "\n"
    result = spec("chat", "-p", str(profiles["gpt2"]), "--dtype", "float32", stdin=script)
    assert result.returncode == 0, result.stderr
    out, err = result.stdout, result.stderr
    assert "Traceback" not in err
    device = pick_device("auto").type
    assert f"spec chat · gpt2 · staged · {device} float32 · template plain" in err and "/help for commands" in err
    for command in commands.COMMANDS:
        assert command in out  # /help
    assert "error: temperature must be a float, not 'hot' (settings unchanged)" in err
    assert "top_k = 5" in err and "max_new_tokens = 8" in err
    assert "unknown setting 'bogus'" in err and "method must be one of" in err
    assert "unknown command /sytem (did you mean /system?)" in err and "/help" in err
    assert "unknown command /wat" in err
    assert re.search(r"top_k\s+5", out) and re.search(r"system\s+\(none\)", out)  # /show before and after
    assert re.search(r"system\s+You are terse\.", out)
    assert "replies        4" in out and "tokens per oracle forward" in out and "draft accepted" in out  # /stats
    assert len(stats_lines(err)) == 4  # def fib, the block, //slash, /regen
    assert "conversation cleared" in err
    assert f"saved 6 messages to {saved}" in err
    record = json.loads(saved.read_text())
    assert record["system"] == "You are terse." and record["profile"] == "gpt2"
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == \
        ["def fib(n):", "line one\nline two", "/slash"]
    assert record["settings"]["top_k"] == 5 and record["settings"]["max_new_tokens"] == 8
    assert not (data_home / "chats").exists()  # /clear after /save: nothing left to auto-save


def test_end_of_input_exits_cleanly_and_saves(profiles, data_home):
    result = spec("chat", "-p", str(profiles["gpt2"]), "--dtype", "float32", "-m", "baseline",
                  stdin="def fib(n):\nimport os\n")
    assert result.returncode == 0, result.stderr
    assert len(stats_lines(result.stderr)) == 2
    files = list((data_home / "chats").glob("chat-*.json"))
    assert len(files) == 1 and f"continue it with: spec chat --load {files[0]}" in result.stderr
    record = json.loads(files[0].read_text())
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"] * 2
    assert record["settings"]["method"] == "baseline"
    hint = result.stderr.split("continue it with: ")[1].split()
    assert hint[:3] == ["spec", "chat", "--load"]
    # as printed: the saved profile, no -p (a terminal wide enough for the profile's path on the line)
    again = spec(*hint[1:], "--dtype", "float32", stdin="/show\n", env={"COLUMNS": "300"})
    assert again.returncode == 0 and "spec chat · gpt2 · baseline" in again.stderr, again.stderr
    assert re.search(r"profile\s+gpt2 \(", again.stdout)
    quiet = spec("chat", "-p", str(profiles["gpt2"]), "--dtype", "float32", stdin="/help\n")
    assert quiet.returncode == 0 and "saved" not in quiet.stderr  # no conversation, nothing to save


def test_a_conversation_that_cannot_be_saved_goes_to_the_temporary_folder_else_to_the_screen(
        profiles, data_home, tmp_path, monkeypatch):
    import tempfile

    data_home.parent.mkdir(parents=True)
    data_home.write_text("")  # (the chats folder cannot be made: as a full disk or a read-only home refuses it)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    args = ("chat", "-p", str(profiles["gpt2"]), "--dtype", "float32", "-m", "baseline")
    saved = spec(*args, stdin="def fib(n):\n")
    assert saved.returncode == 0 and "could not save the conversation in" in saved.stderr, saved.stderr
    [path] = (tmp_path / "tmp" / "spec-chats").glob("chat-*.json")
    assert f"saved it in {path.parent} instead" in saved.stderr and f"--load {path}" in saved.stderr
    assert json.loads(path.read_text())["messages"][0]["content"] == "def fib(n):"
    (tmp_path / "tmp").rename(tmp_path / "gone")
    (tmp_path / "tmp").write_text("")  # (nor there)
    shown = spec(*args, stdin="import os\n")
    assert shown.returncode == 0 and "here it is, to keep:" in shown.stderr
    kept = json.loads(shown.stderr[shown.stderr.index("\n{") + 1:shown.stderr.rindex("}") + 1])
    assert kept["messages"][0]["content"] == "import os" and kept["messages"][1]["role"] == "assistant"


def test_save_and_load_round_trip(profiles, tmp_path):
    first, second, third = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    args = ("chat", "-p", str(profiles["gpt2"]), "--dtype", "float32", "-m", "baseline")
    made = spec(*args, "--system", "Be brief.", "-t", "0", stdin=f"def fib(n):\nimport os\n/save {first}\n")
    assert made.returncode == 0, made.stderr
    again = spec(*args, "--load", str(first), stdin=f"/save {second}\n")
    assert again.returncode == 0, again.stderr
    assert f"continuing {first}: 4 messages" in again.stderr
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["system"] == "Be brief." and len(a["messages"]) == 4
    assert (a["system"], a["messages"], a["settings"]) == (b["system"], b["messages"], b["settings"])
    assert a["messages"][1]["content"] in again.stdout  # the loaded conversation is shown
    # /load inside a session, then a new turn continues the loaded conversation
    inside = spec(*args, stdin=f"hello\n/load {first}\n/save {third}\nfor i in x:\n/save {third}\n")
    assert inside.returncode == 0 and f"loaded 4 messages from {first}" in inside.stderr
    c = json.loads(third.read_text())
    assert c["messages"][:4] == a["messages"] and c["messages"][4]["content"] == "for i in x:"
    assert c["system"] == "Be brief."
    # flags given now win over the saved settings
    flagged = spec(*args, "--load", str(first), "-n", "5", stdin=f"/save {second}\n")
    assert json.loads(second.read_text())["settings"]["max_new_tokens"] == 5, flagged.stderr


def test_bad_options_are_one_clear_line(profiles, tmp_path):
    args = ("chat", "-p", str(profiles["gpt2"]), "--dtype", "float32")
    for extra, pattern in ((("--template", str(tmp_path / "none.jinja")), "file not found"),
                           (("--load", str(tmp_path / "none.json")), "no saved conversation"),
                           (("-t", "-1"), "temperature must be >= 0")):
        result = spec(*args, *extra)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and pattern in lines[0], result.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"messages": [{"role": "robot", "content": "x"}]}')
    result = spec(*args, "--load", str(broken))
    assert result.returncode == 2 and "each message needs a role" in result.stderr
    bad_jinja = tmp_path / "bad.jinja"
    bad_jinja.write_text("{% for m in messages %}")
    result = spec(*args, "-m", "baseline", "--template", str(bad_jinja))
    assert result.returncode == 2 and "chat template" in result.stderr and "Traceback" not in result.stderr


def test_set_setting():
    base = Decoding()
    assert commands.set_setting(base, "top-k", "7").top_k == 7
    assert commands.set_setting(base, "max_tokens", "9").max_new_tokens == 9
    assert commands.set_setting(base, "Temperature", "0.5").temperature == 0.5
    assert commands.set_setting(base, "seed", "none").seed is None
    assert commands.set_setting(base, "method", "speculative").method == "speculative"
    assert commands.set_setting(base, "tree-budget", "20").tree_budget == 20
    for key, value, pattern in (("top_p", "2", "top_p must be in"), ("top_k", "x", "must be an int"),
                                ("tree_depth", "0", "at least 1"), ("temprature", "1", "did you mean temperature")):
        with pytest.raises(SpecError, match=pattern):
            commands.set_setting(base, key, value)
    with pytest.raises(SpecError, match="needs a draft model"):
        commands.set_setting(base, "method", "speculative", has_draft=False)
    assert commands.set_setting(base, "method", "staged", has_draft=False).method == "staged"  # by lookup


def test_reply_view_stops_at_the_next_user_turn(tiny_dir):
    """The plain transcript's stop marker is cut from the reply and never shown, even split across tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    ids = tokenizer(" Hello world!\n\nUser: and more", add_special_tokens=False)["input_ids"]
    stream = io.StringIO()
    view = reply.ReplyView(tokenizer, [0], templates.PLAIN_STOP, stream=stream, color=False)
    fed = 0
    for token in ids:
        view.add(Token(token, BONUS, "oracle"))
        fed += 1
        if view.stopped:
            break
    view.finish()
    assert view.stopped and fed < len(ids)
    assert view.reply == "Hello world!" and stream.getvalue() == "Hello world!\n"


def test_ctrl_c_mid_reply_keeps_the_session(engines, monkeypatch):
    profile, engine, base = engines["gpt2"]
    chat = session(engine, profile, method="staged", max_new_tokens=30)
    original = Engine.events
    calls = []

    def events(self, ids, settings, reuse=False):
        inner = original(self, ids, settings, reuse=reuse)
        calls.append(ids)

        def interrupted():
            produced = 0
            for event in inner:
                yield event
                produced += isinstance(event, Token) and event.output
                if len(calls) == 1 and produced >= 5:
                    raise KeyboardInterrupt

        return interrupted()

    monkeypatch.setattr(Engine, "events", events)
    code = chat.run(terminal.lines(["def fib(n):", "import os", "/exit"]))
    assert code == 0
    first, second = chat.turns
    assert first.reason == "interrupted" and 5 <= len(first.tokens) < 30
    assert chat.messages[1] == {"role": "assistant", "content": first.reply}  # what came so far is kept
    assert "· interrupted" in chat.stderr.getvalue()
    expected = baseline_tokens(base, first.prompt, 30)
    assert first.tokens == expected[: len(first.tokens)]
    # the turn after the interruption is still exact
    ids = templates.prompt_ids(base.tokenizer, chat.template, None, chat.messages[:3])
    assert second.prompt == ids and second.tokens == baseline_tokens(base, ids, 30)[: len(second.tokens)]
    assert second.reason in ("eos", "length", "stop")


@pytest.fixture(scope="module")
def small_context(tiny_dir, tmp_path_factory):
    """A baseline-only profile whose oracle sees 64 tokens."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("small")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    make_model(folder / "small", "gpt2", len(tokenizer), layers=1, width=32, seed=3, context=64, tokenizer=tokenizer)
    profile = folder / "small.toml"
    profile.write_text(f'oracle = "{folder / "small"}"\n[decoding]\nmethod = "baseline"\nmax_new_tokens = 20\n')
    return profile


def test_a_conversation_outgrowing_the_context_drops_its_oldest_exchanges(small_context, tmp_path):
    """Piped (nobody to ask): the oldest exchanges go, the system prompt stays, the reply comes; a message
    that cannot fit even alone is refused; no count ever exceeds the window (it said "65 of 64")."""
    saved = tmp_path / "after.json"
    long_message = "print(i, i * i) " * 20
    script = "\n".join(["for i in x:", "def f():", "import os", "class A:", long_message, "x = 1",
                        f"/save {saved}", "/stats", "/exit"]) + "\n"
    result = spec("chat", "-p", str(small_context), "--dtype", "float32", "--system", "Be brief.", stdin=script)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    err = result.stderr
    assert "dropped the oldest" in err and "the system prompt stays" not in err  # a note, not a question
    assert "this message alone does not fit" in err
    record = json.loads(saved.read_text())
    users = [m["content"] for m in record["messages"] if m["role"] == "user"]
    assert record["system"] == "Be brief."
    assert users[-1] == "x = 1" and long_message not in users and "for i in x:" not in users
    assert len(stats_lines(err)) == 5  # every message but the one that cannot fit was answered
    filled = spec("chat", "-p", str(small_context), "--dtype", "float32", "-n", "60",
                  stdin="print(i, i * i) print(i, i * i) print(i, i * i)\n/stats\n")
    assert "the reply filled the oracle's context window (64 of 64 tokens)" in filled.stderr, filled.stderr
    text = err + result.stdout + filled.stderr + filled.stdout
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+) tokens", text)]
    assert len(counts) >= 3 and all(used <= window == 64 for used, window in counts), counts


def test_dropping_old_exchanges_is_offered_and_can_be_declined(small_context):
    profile = profile_store.load(str(small_context))
    engine = Engine(profile, dtype="float32")
    questions = []
    for answer in (False, True):
        chat = session(engine, profile)
        chat.confirm = lambda question: questions.append(question) or answer
        for text in ("for i in x:", "def f():", "import os", "class A:", "y = 2"):
            chat.send(text)
        assert questions and "Drop the oldest" in questions[-1] and "(the system prompt stays)" in questions[-1]
        firsts = [m["content"] for m in chat.messages if m["role"] == "user"]
        if answer:  # dropped: the conversation fits again, with room for a whole reply
            assert firsts[0] != "for i in x:" and firsts[-1] == "y = 2"
            assert len(chat.turns[-1].prompt) + 20 <= 64
        else:  # declined: nothing dropped; a turn that still fits runs (its reply may be cut by the window)
            assert firsts[0] == "for i in x:"
            assert all(len(t.prompt) < 64 for t in chat.turns)
            assert all(chat.context_used(t) <= 64 for t in chat.turns)


def test_jinja_chat_template(engines, profiles, tmp_path, tiny_dir):
    profile, engine, base = engines["gpt2"]
    template = templates.Template("profile", JINJA)
    text = templates.render(engine.tokenizer, template, "Be brief.", [{"role": "user", "content": "hi"}])
    assert text == "<|system|>Be brief.<|endoftext|><|user|>hi<|endoftext|><|assistant|>"
    ids = templates.prompt_ids(engine.tokenizer, template, "Be brief.", [{"role": "user", "content": "hi"}])
    assert ids.count(0) == 2 and ids == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = session(engine, profile, template=template)
    chat.system = "Be brief."
    history = []
    for message in ("def fib(n):", "import os"):
        history.append(chat.messages + [{"role": "user", "content": message}])
        chat.send(message)
    check_against_baseline(chat, base, history)
    # a template file on the command line, and one in the profile
    path = tmp_path / "chat.jinja"
    path.write_text(JINJA)
    by_file = spec("chat", "-p", str(profiles["gpt2"]), "-m", "baseline", "--template", str(path), stdin="hi\n")
    assert by_file.returncode == 0 and f"template {path}" in by_file.stderr and len(stats_lines(by_file.stderr)) == 1
    in_profile = tmp_path / "templated.toml"
    in_profile.write_text(profiles["gpt2"].read_text().replace("[decoding]",
                                                               f"chat_template = {json.dumps(JINJA)}\n[decoding]"))
    by_profile = spec("chat", "-p", str(in_profile), "-m", "baseline", stdin="hi\n")
    assert by_profile.returncode == 0 and "template profile" in by_profile.stderr, by_profile.stderr


def test_choose_template(tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    bare = Profile(name="x", source="x", oracle=ModelRef("x"))
    assert templates.choose_template(bare, tokenizer).plain
    tokenizer.chat_template = JINJA
    assert templates.choose_template(bare, tokenizer).label == "tokenizer"
    assert templates.choose_template(Profile("x", "x", ModelRef("x"), chat_template="plain"), tokenizer).plain
    assert templates.choose_template(bare, tokenizer, templates.Template("plain")).plain
    plain = templates.render(tokenizer, templates.Template("plain"), "Sys.",
                            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                             {"role": "user", "content": "c"}])
    assert plain == "Sys.\n\nUser: a\nAssistant: b\n\nUser: c\nAssistant:"


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_ctrl_c_in_a_real_terminal(profiles, data_home, tmp_path):
    """The real thing: a pty, readline, Ctrl-C typed mid-reply, the prompt back, Ctrl-C at the prompt
    clearing the line, /exit with code 0.
    Each oracle forward is slowed down (in the child only) so that a 200-token reply takes seconds."""
    import fcntl
    import pty
    import termios

    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as in a shell; a test runner may ignore it
        "from spec_cli.exec import runner\n"
        "forward = runner.Runner.forward\n"
        "def slow(self, *a, **k):\n"
        "    time.sleep(0.05)\n"
        "    return forward(self, *a, **k)\n"
        "runner.Runner.forward = slow\n"
        "from spec_cli.cli import main\n"
        "sys.argv = ['spec'] + sys.argv[1:]\n"
        "main()\n"
    )
    master, slave = pty.openpty()

    def controlling_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {**os.environ, **ENV, "XDG_DATA_HOME": str(data_home.parent), "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-c", code, "chat", "-p", str(profiles["gpt2"]), "-m", "baseline",
                             "-n", "200"], stdin=slave, stdout=slave, stderr=slave, env=env,
                            preexec_fn=controlling_terminal, close_fds=True)
    os.close(slave)
    seen = bytearray()
    try:
        assert read_until(master, b">>> ", seen, 120), seen.decode(errors="replace")
        os.write(master, b"def fib(n):\r")
        assert read_until(master, b"def fib(n):\r\n", seen, 10), seen.decode(errors="replace")
        start = len(seen)
        deadline = time.monotonic() + 5  # the reply takes 200 x 50 ms: plenty of time to interrupt it
        while len(seen) - start < 10 and time.monotonic() < deadline:  # some of the reply on the screen
            read_until(master, b"\x00never", seen, 0.05)
        os.write(master, b"\x03")
        assert read_until(master, b"interrupted", seen, 10), seen.decode(errors="replace")
        deadline = time.monotonic() + 10  # the next prompt (the first one is in `seen` already)
        while seen.count(b">>> ") < 2 and time.monotonic() < deadline:
            read_until(master, b"\x00never", seen, 0.1)
        prompts = seen.count(b">>> ")
        assert prompts == 2, seen.decode(errors="replace")
        os.write(master, b"half a line")  # Ctrl-C at the prompt drops the line, as a shell does, and stays
        assert read_until(master, b"half a line", seen, 10), seen.decode(errors="replace")
        os.write(master, b"\x03")
        deadline = time.monotonic() + 10
        while seen.count(b">>> ") == prompts and time.monotonic() < deadline:
            read_until(master, b"\x00never", seen, 0.1)
        assert seen.count(b">>> ") == prompts + 1 and proc.poll() is None, seen.decode(errors="replace")
        os.write(master, b"/exit\r")
        assert proc.wait(timeout=20) == 0, seen.decode(errors="replace")
        read_until(master, b"\x00never", seen, 0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = seen.decode(errors="replace")
    assert "Traceback" not in text
    assert "conversation saved; continue it with: spec chat --load" in text
    assert (data_home / "chat_history").is_file()  # readline history, kept for the next session
    assert "def fib(n):" in (data_home / "chat_history").read_text()
    stats = [line for line in text.splitlines() if "tok/s" in line]
    assert len(stats) == 1 and "interrupted" in stats[0] and not stats[0].startswith("200 tokens")  # one reply
