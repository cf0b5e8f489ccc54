"""`spec chat`: an interactive conversation with the oracle, streamed like `spec generate`.

Each turn renders the whole conversation with the chat template and hands the token ids to the engine with
`reuse=True`: the engine keeps the cached prefix the new prompt shares with the last one, so a turn only
runs what is new. This module is the UI: it knows templates, commands and files, nothing of KV caches.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs
from rich.console import Console
from rich.table import Table
from rich.text import Text

from spec_cli.errors import SpecError
from spec_cli.events import REJECTED, Finished, Stats, Token
from spec_cli.profiles import Decoding, Profile
from spec_cli.view import TokenView, legend, loading, summary

PLAIN = "plain"
USER, ASSISTANT = "User", "Assistant"
PLAIN_STOP = f"\n{USER}:"  # the model starting the next user turn ends its reply (plain transcripts)

ALIASES = {"max_tokens": "max_new_tokens", "n": "max_new_tokens", "t": "temperature"}
NEEDS_DRAFT = ("speculative", "staged")
COMMANDS = {
    "/help": "this list",
    "/exit": "leave (also /quit, Ctrl-D; the conversation is saved)",
    "/clear": "forget the conversation (keeps the system prompt and settings)",
    "/regen": "drop the last reply and generate it again",
    "/system": "/system TEXT sets the system prompt; /system alone removes it",
    "/set": "/set KEY VALUE changes a decoding setting (temperature, top_k, top_p, max_tokens, method, seed, …)",
    "/show": "the profile, template, system prompt and settings",
    "/stats": "this session's speed and acceptance so far",
    "/save": "/save [FILE] writes the conversation as JSON (default: a new file in the data folder)",
    "/load": "/load FILE continues a saved conversation",
}
ALL_COMMANDS = (*COMMANDS, "/quit")
BLOCK = '"""'


# --- templates: the conversation as text, then token ids ---------------------------------------------


@dataclass(frozen=True)
class Template:
    """How a conversation becomes a prompt: the built-in plain transcript or a Jinja chat template."""

    label: str  # shown in the header and /show: "plain", "profile", "tokenizer" or a file path
    jinja: str | None = None  # None with label "tokenizer": the tokenizer's own template

    @property
    def plain(self) -> bool:
        return self.label == PLAIN

    @property
    def stop(self) -> str | None:
        return PLAIN_STOP if self.plain else None


def read_template_option(value: str | None) -> Template | None:
    """--template: `plain` or the path of a Jinja file."""
    if value is None:
        return None
    if value == PLAIN:
        return Template(PLAIN)
    path = Path(value).expanduser()
    if not path.is_file():
        raise SpecError(f"--template must be 'plain' or a Jinja chat template file; file not found: {value}")
    try:
        return Template(str(path), path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read chat template {value}: {e}") from None


def choose_template(profile: Profile, tokenizer, option: Template | None = None) -> Template:
    """--template, else the profile's chat_template, else the tokenizer's own, else plain."""
    if option is not None:
        template = option
    elif profile.chat_template:
        template = Template(PLAIN) if profile.chat_template == PLAIN else Template("profile", profile.chat_template)
    elif getattr(tokenizer, "chat_template", None):
        template = Template("tokenizer")
    else:
        template = Template(PLAIN)
    if not template.plain:  # a broken template is one clear error now, not at the first message
        render(tokenizer, template, "You are helpful.", [{"role": "user", "content": "Hi"}])
    return template


def render(tokenizer, template: Template, system: str | None, messages: list[dict]) -> str:
    """The conversation as the prompt text, ending where the assistant's next reply begins."""
    if template.plain:
        parts = [system.strip() + "\n\n"] if system and system.strip() else []
        for m in messages:
            if m["role"] == "user":
                parts.append(f"{USER}: {m['content']}\n")
            else:
                parts.append(f"{ASSISTANT}: {m['content']}\n\n")
        return "".join(parts) + f"{ASSISTANT}:"
    conversation = ([{"role": "system", "content": system}] if system else []) + list(messages)
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                             chat_template=template.jinja)
    except Exception as e:  # noqa: BLE001 - Jinja errors, raise_exception() in templates, ...
        raise SpecError(f"chat template ({template.label}): {type(e).__name__}: {e}") from None


def prompt_ids(tokenizer, template: Template, system: str | None, messages: list[dict]) -> list[int]:
    """Token ids of the rendered conversation. A Jinja template writes its own special tokens (BOS and
    the like), so they are not added again; the plain transcript is tokenized like `spec generate`'s prompt."""
    text = render(tokenizer, template, system, messages)
    ids = tokenizer(text, add_special_tokens=template.plain)["input_ids"]
    if not ids:
        bos = tokenizer.bos_token_id
        if bos is None:
            raise SpecError("the conversation renders to nothing and the tokenizer has no BOS token")
        ids = [bos]
    return ids


# --- the streamed reply ------------------------------------------------------------------------------


def _overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReplyView(TokenView):
    """A TokenView for one reply: leading and trailing whitespace are held back, and so is anything that
    may be the start of the stop marker (the next "User:" turn), so what is shown is what is kept."""

    def __init__(self, tokenizer, prompt: list[int], stop: str | None, stream=None, color: bool | None = None):
        super().__init__(tokenizer, prompt, stream=stream, color=color)
        self.stop = stop
        self.stopped = False  # the marker appeared: the reply is over
        self._queue: list[list] = []  # [text, style, is_output] not yet written
        self._start = 0  # offset in self.text of the first queued output text
        self._output = True
        self._shown = False  # whether any of the reply's text is on the screen yet

    def add(self, event) -> None:
        if self.stopped or not isinstance(event, Token):
            return
        self._output = event.kind != REJECTED
        super().add(event)  # calls self._write for what it would show
        self._flush()

    def _write(self, text: str, style: str) -> None:
        if text:
            self._queue.append([text, style, self._output])

    @property
    def reply(self) -> str:
        """The reply as the conversation keeps it: up to the stop marker, stripped."""
        text = self.text
        if self.stop and (cut := text.find(self.stop)) >= 0:
            text = text[:cut]
        return text.strip()

    def _flush(self) -> None:
        full = self.text
        end = len(full)
        if self.stop and (cut := full.find(self.stop)) >= 0:
            self.stopped, end = True, cut
        elif self.stop:
            end -= _overlap(full, self.stop)
        end = len(full[:end].rstrip())
        begin = len(full) - len(full.lstrip()) if full.strip() else len(full)
        while self._queue:
            text, style, is_output = self._queue[0]
            if not is_output:  # a rejected proposal, shown where it was made
                TokenView._write(self, text if self._shown else text.lstrip(), style)
                self._queue.pop(0)
                continue
            a, b = max(self._start, begin), min(self._start + len(text), end)
            if b > a:
                TokenView._write(self, text[a - self._start : b - self._start], style)
                self._shown = True
            if self._start + len(text) <= end:
                self._start += len(text)
                self._queue.pop(0)
            else:
                if b > self._start:
                    self._queue[0][0] = text[b - self._start :]
                    self._start = b
                break
        if self.stopped:
            self._queue.clear()


# --- the session -------------------------------------------------------------------------------------


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir("spec"))


def chats_dir() -> Path:
    return data_dir() / "chats"


@dataclass
class Turn:
    """One generated reply, for /stats and for tests."""

    prompt: list[int]
    tokens: list[int]
    reply: str
    reason: str  # eos, length, stop (the next turn began), context, interrupted
    seconds: float
    stats: Stats


@dataclass
class Chat:
    engine: Any  # spec_cli.engine.Engine: .tokenizer, .oracle.context, .draft, .events(ids, settings, reuse)
    profile: Profile
    settings: Decoding
    template: Template
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    out: Console = field(default_factory=lambda: Console(highlight=False, soft_wrap=True))
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False, soft_wrap=True))
    turns: list[Turn] = field(default_factory=list)
    dirty: bool = False  # changed since it was last saved or loaded
    generations: int = 0

    # -- one turn --

    def send(self, text: str) -> Turn | None:
        """Add the user's message and generate the reply; on failure the message is not kept."""
        messages = self.messages + [{"role": "user", "content": text}]
        turn = self.generate(messages)
        if turn is not None:
            self.messages = messages + [{"role": "assistant", "content": turn.reply}]
            self.dirty = True
        return turn

    def generate(self, messages: list[dict]) -> Turn | None:
        try:
            ids = prompt_ids(self.engine.tokenizer, self.template, self.system, messages)
        except SpecError as e:
            self.err.print(f"error: {e}", style="bold red", markup=False)
            return None
        context = self.engine.oracle.context
        if len(ids) >= context:
            self._too_long(len(ids))
            return None
        settings = self.settings
        if settings.seed is not None and self.generations:  # reproducible, yet /regen samples anew
            settings = dataclasses.replace(settings, seed=settings.seed + self.generations)
        self.generations += 1
        view = ReplyView(self.engine.tokenizer, ids, self.template.stop, stream=self.out.file)
        stats, tokens, reason = Stats(), [], None
        start = time.perf_counter()
        events = None
        try:
            events = self.engine.events(ids, settings, reuse=True)
            for event in events:
                stats.add(event)
                if isinstance(event, Token):
                    view.add(event)
                    if event.output:
                        tokens.append(event.token)
                    if view.stopped:
                        reason = "stop"
                        break
                elif isinstance(event, Finished):
                    reason = event.reason
        except KeyboardInterrupt:
            reason = "interrupted"
        except SpecError as e:
            view.finish()
            if "context window" in str(e):
                self._too_long(len(ids))
            else:
                self.err.print(f"error: {e}", style="bold red", markup=False)
            return None
        finally:
            if events is not None and hasattr(events, "close"):
                events.close()
        seconds = time.perf_counter() - start
        view.finish()
        turn = Turn(ids, tokens, view.reply, reason or "length", seconds, stats)
        line_stats = dataclasses.replace(stats, finish_reason=None)  # in a chat, stopping at EOS is the norm
        line = summary(line_stats, seconds)
        if reason == "length":
            line += f" · cut at max_new_tokens={settings.max_new_tokens}"
        elif reason == "interrupted":
            line += " · interrupted"
        self.err.print(line, style="dim", markup=False)
        if not turn.reply and reason in ("eos", "stop"):
            self.note("(the model ended its reply without writing anything; /regen or /set temperature may help)")
        if reason == "context":
            self._too_long(len(ids) + len(tokens), mid_reply=True)
            return None
        self.turns.append(turn)
        return turn

    def _too_long(self, tokens: int, mid_reply: bool = False) -> None:
        context = self.engine.oracle.context
        what = "the reply filled" if mid_reply else "the conversation no longer fits"
        self.err.print(f"{what} the oracle's context window ({tokens} of {context} tokens): that message "
                       f"was not added; /clear starts over", style="yellow", markup=False)

    # -- commands --

    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end."""
        name, _, arg = line.partition(" ")
        name, arg = name.lower(), arg.strip()
        handler: Callable[[str], bool | None] | None = {
            "/help": self.cmd_help, "/exit": lambda _: False, "/quit": lambda _: False,
            "/clear": self.cmd_clear, "/regen": self.cmd_regen, "/system": self.cmd_system,
            "/set": self.cmd_set, "/show": self.cmd_show, "/stats": self.cmd_stats,
            "/save": self.cmd_save, "/load": self.cmd_load,
        }.get(name)
        if handler is None:
            close = difflib.get_close_matches(name, ALL_COMMANDS, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]}?)" if close else ""
            self.note(f"unknown command {name}{hint}; /help lists the commands, // sends a line starting with /",
                      style="yellow")
            return True
        return handler(arg) is not False

    def note(self, text: str, style: str = "dim") -> None:
        self.err.print(text, style=style, markup=False)

    def cmd_help(self, _: str) -> None:
        table = Table(box=None, pad_edge=False, show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for name, text in COMMANDS.items():
            table.add_row(name, text)
        table.add_row('"""', 'a line of just """ starts a multi-line message; another ends it')
        table.add_row("//", "a line starting with // sends it with a single / (not a command)")
        table.add_row("Ctrl-C", "stops a reply (keeps what came so far); at the prompt it leaves, like Ctrl-D")
        self.out.print(table)

    def cmd_clear(self, _: str) -> None:
        self.messages = []
        self.note("conversation cleared (system prompt and settings kept)")

    def cmd_regen(self, _: str) -> None:
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.note("nothing to regenerate yet", style="yellow")
            return
        messages = self.messages[:-1]
        turn = self.generate(messages)
        if turn is not None:
            self.messages = messages + [{"role": "assistant", "content": turn.reply}]
            self.dirty = True

    def cmd_system(self, arg: str) -> None:
        self.system = arg or None
        self.dirty = True
        self.note("system prompt set" if arg else "system prompt removed")

    def cmd_set(self, arg: str) -> None:
        key, _, value = arg.partition(" ")
        value = value.strip()
        if not key or not value:
            self.note("usage: /set KEY VALUE, e.g. /set temperature 0.7 (keys: "
                      + ", ".join(settable()) + ")", style="yellow")
            return
        try:
            self.settings = set_setting(self.settings, key, value, has_draft=self.engine.has_draft)
        except SpecError as e:
            self.note(f"error: {e} (settings unchanged)", style="bold red")
            return
        name = canonical_key(key)
        self.note(f"{name} = {getattr(self.settings, name)!r}")

    def cmd_show(self, _: str) -> None:
        engine = self.engine
        table = Table(box=None, pad_edge=False, show_header=False)
        table.add_column(style="bold")
        table.add_column()
        table.add_row("profile", f"{self.profile.name} ({self.profile.source})")
        table.add_row("device", f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}")
        table.add_row("template", self.template.label)
        table.add_row("system", self.system if self.system else "(none)")
        table.add_row("messages", f"{len(self.messages)} (context window {engine.oracle.context} tokens)")
        for key, value in vars(self.settings).items():
            table.add_row(key, repr(value))
        self.out.print(table)

    def cmd_stats(self, _: str) -> None:
        if not self.turns:
            self.out.print("no replies yet")
            return
        total = Stats()
        for turn in self.turns:
            for table, source in ((total.forwards, turn.stats.forwards), (total.proposed, turn.stats.proposed),
                                  (total.accepted, turn.stats.accepted)):
                for key, value in source.items():
                    table[key] = table.get(key, 0) + value
            total.new_tokens += turn.stats.new_tokens
        seconds = sum(t.seconds for t in self.turns)
        rate = total.new_tokens / seconds if seconds > 0 else 0.0
        lines = [
            f"replies        {len(self.turns)}" + (f" ({sum(t.reason == 'interrupted' for t in self.turns)} "
                                                    "interrupted)" if any(t.reason == "interrupted"
                                                                          for t in self.turns) else ""),
            f"tokens         {total.new_tokens} in {seconds:.2f} s, {rate:.1f} tok/s",
            f"per forward    {total.tokens_per_oracle_forward:.2f} tokens per oracle forward "
            f"({total.oracle_forwards} forwards)",
        ]
        for verifier, label in (("oracle", "draft"), ("draft", "draft2")):
            acceptance = total.acceptance(verifier)
            if acceptance is not None:
                lines.append(f"{label + ' accepted':<14} {acceptance:.0%}")
        last = self.turns[-1]
        lines.append(f"context        {len(last.prompt) + len(last.tokens)} of {self.engine.oracle.context} tokens "
                     "after the last reply")
        for line in lines:
            self.out.print(line, markup=False)

    def snapshot(self) -> dict:
        return {
            "system": self.system,
            "messages": self.messages,
            "settings": {k: v for k, v in vars(self.settings).items()},
            "profile": self.profile.name,
            "template": self.template.label,
            "saved": _dt.datetime.now().isoformat(timespec="seconds"),
        }

    def save(self, path: Path | None = None) -> Path:
        path = path or new_chat_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.snapshot(), ensure_ascii=False, indent=2) + "\n")
        self.dirty = False
        return path

    def cmd_save(self, arg: str) -> None:
        try:
            path = self.save(Path(arg).expanduser() if arg else None)
        except OSError as e:
            self.note(f"error: cannot save: {e.strerror or e}", style="bold red")
            return
        self.note(f"saved {len(self.messages)} messages to {path}")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            self.note("usage: /load FILE", style="yellow")
            return
        try:
            saved = read_saved(Path(arg).expanduser())
            self.restore(saved)
        except SpecError as e:
            self.note(f"error: {e}", style="bold red")
            return
        self.note(f"loaded {len(self.messages)} messages from {arg}")
        self.replay()

    def restore(self, saved: dict, overrides: dict | None = None) -> None:
        """Continue a conversation from read_saved(); its settings, with `overrides` (flags) on top."""
        self.settings = saved_settings(saved, self.settings, overrides)
        if self.settings.method in NEEDS_DRAFT and not self.engine.has_draft:
            self.note(f"(the saved method {self.settings.method} needs a draft model, and this profile names "
                      "none: using baseline)")
            self.settings = dataclasses.replace(self.settings, method="baseline")
        self.system = saved.get("system")
        self.messages = list(saved.get("messages", []))
        self.dirty = False
        if saved.get("profile") and saved["profile"] != self.profile.name:
            self.note(f"(saved with profile {saved['profile']}; continuing with {self.profile.name})")

    def replay(self) -> None:
        """Show a loaded conversation."""
        if self.system:
            self.out.print(Text(f"system: {self.system}", style="dim"))
        for m in self.messages:
            if m["role"] == "user":
                self.out.print(Text(">>> " + m["content"].replace("\n", "\n... "), style="bold"))
            else:
                self.out.print(m["content"], markup=False, highlight=False)

    # -- the loop --

    def header(self) -> None:
        s, engine = self.settings, self.engine
        draft2 = s.method == "staged" and getattr(engine, "draft2", None) is not None
        line = Text(f"spec chat · {self.profile.name} · {s.method} · {engine.device.type} "
                    f"{str(engine.dtype).removeprefix('torch.')} · template {self.template.label}", style="dim")
        self.err.print(line)
        if self.out.is_terminal and not os.environ.get("NO_COLOR") and not self.out.no_color:
            self.err.print(legend(draft2), style="dim")
        self.err.print("/help for commands, /exit or Ctrl-D to leave", style="dim")

    def run(self, read: Callable[[str], str | None]) -> int:
        """The read-reply loop. `read(prompt)` returns a line, None at end of input, or raises
        KeyboardInterrupt (Ctrl-C at the prompt): both end the session cleanly."""
        try:
            while True:
                try:
                    line = read(">>> ")
                    if line is not None and line.strip() == BLOCK:
                        line = read_block(read)
                except KeyboardInterrupt:
                    self.err.print()
                    break
                if line is None:
                    break
                if not line.strip():
                    continue
                try:
                    if line.startswith("//"):
                        self.send(line[1:])
                    elif line.startswith("/"):
                        if not self.command(line.strip()):
                            break
                    else:
                        self.send(line)
                except KeyboardInterrupt:  # outside a reply's decoding (which handles its own)
                    self.note("interrupted")
        finally:
            self.autosave()
        return 0

    def autosave(self) -> None:
        if not self.dirty or not self.messages:
            return
        try:
            path = self.save()
        except OSError as e:
            self.note(f"could not save the conversation: {e.strerror or e}", style="yellow")
            return
        self.note(f"conversation saved to {path} (spec chat --load it to continue)")


def read_block(read: Callable[[str], str | None]) -> str | None:
    lines = []
    while True:
        line = read("... ")
        if line is None or line.strip() == BLOCK:
            return "\n".join(lines) if lines or line is not None else None
        lines.append(line)


# --- settings ----------------------------------------------------------------------------------------


def settable() -> list[str]:
    return [f.name for f in dataclasses.fields(Decoding)]


def canonical_key(key: str) -> str:
    key = key.strip().lower().replace("-", "_")
    return ALIASES.get(key, key)


def set_setting(settings: Decoding, key: str, value: str, has_draft: bool = True) -> Decoding:
    """A new Decoding with KEY set from the text VALUE; SpecError (settings unchanged) when invalid."""
    name = canonical_key(key)
    types = {f.name: str(f.type) for f in dataclasses.fields(Decoding)}
    if name not in types:
        close = difflib.get_close_matches(name, types, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise SpecError(f"unknown setting '{key}'{hint}; settings: {', '.join(types)}")
    kind = types[name]
    text = value.strip()
    try:
        if "None" in kind and text.lower() in ("none", "random", "off"):
            parsed: Any = None
        elif kind.startswith("bool"):
            lowered = text.lower()
            if lowered not in ("true", "false", "on", "off", "yes", "no", "1", "0"):
                raise ValueError
            parsed = lowered in ("true", "on", "yes", "1")
        elif kind.startswith("int"):
            parsed = int(text)
        elif kind.startswith("float"):
            parsed = float(text)
        else:
            parsed = text
    except ValueError:
        expected = kind.split("|")[0].strip()
        raise SpecError(f"{name} must be {'an' if expected == 'int' else 'a'} {expected}, not '{text}'") from None
    updated = dataclasses.replace(settings, **{name: parsed})  # validates: SpecError with the reason
    if name == "method" and parsed in NEEDS_DRAFT and not has_draft:
        raise SpecError(f"method '{parsed}' needs a draft model, and the profile names none (try method self)")
    return updated


# --- files -------------------------------------------------------------------------------------------


def new_chat_path() -> Path:
    folder = chats_dir()
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


# --- input -------------------------------------------------------------------------------------------


def terminal_reader(history: Path | None) -> Callable[[str], str | None]:
    """input() with readline editing and a persistent history, when readline is there."""
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        readline = None
    if readline is not None and history is not None:
        try:
            readline.read_history_file(history)
        except (OSError, UnicodeDecodeError):
            pass
        readline.set_history_length(1000)

        import atexit

        def write() -> None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(history)
            except OSError:
                pass

        atexit.register(write)

    def read(prompt: str) -> str | None:
        try:
            if sys.stdout.isatty():
                return input(prompt)
            sys.stderr.write(prompt)  # stdout goes to a file: keep the prompts out of it
            sys.stderr.flush()
            return input()
        except EOFError:
            print(file=sys.stderr)
            return None

    return read


def stream_reader(stream) -> Callable[[str], str | None]:
    """Lines from a pipe or file, without prompts."""

    def read(prompt: str) -> str | None:
        line = stream.readline()
        if not line:
            return None
        return line.rstrip("\n").rstrip("\r")

    return read


def lines(items: list[str]) -> Callable[[str], str | None]:
    """Lines from a list (tests)."""
    it: Iterator[str] = iter(items)
    return lambda prompt: next(it, None)


# --- entry point (called by the CLI) -----------------------------------------------------------------


def start(profile: Profile, settings: Decoding, overrides: dict, *, system: str | None = None,
          template: str | None = None, load: Path | None = None, draft2: str | None = None,
          device: str | None = None, dtype: str | None = None) -> int:
    from spec_cli.engine import Engine

    option = read_template_option(template)
    saved = read_saved(Path(load).expanduser()) if load else None
    if saved:
        settings = saved_settings(saved, settings, overrides)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    with loading(err, profile.name):
        engine = Engine(profile, device=device, dtype=dtype, need_draft=settings.method in NEEDS_DRAFT,
                        draft2=draft2)
        if err.is_terminal:  # the first forwards of each shape are slow (kernel set-up): pay for them here
            warm = dataclasses.replace(settings, max_new_tokens=32, temperature=0.0)
            for _ in engine.events(engine.encode("def"), warm):
                pass
    chat = Chat(engine, profile, settings, choose_template(profile, engine.tokenizer, option), err=err)
    if saved:
        chat.restore(saved, overrides)
    if system is not None:
        chat.system = system or None
    chat.header()
    if saved:
        chat.note(f"continuing {load}: {len(chat.messages)} messages")
        chat.replay()
    interactive = sys.stdin.isatty()
    read = terminal_reader(data_dir() / "chat_history") if interactive else stream_reader(sys.stdin)
    return chat.run(read)
