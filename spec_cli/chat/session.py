"""A chat session: the conversation, one reply per turn, the context window, and the read-reply loop.

Each turn renders the whole conversation with the chat template and hands the token ids to the engine with
`reuse=True`: the engine keeps the cached prefix the new prompt shares with the last one, so a turn only
runs what is new. This is the UI side: it knows templates, commands and files, nothing of KV caches.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from spec_cli.chat import commands, store
from spec_cli.chat.reply import ReplyView
from spec_cli.chat.templates import Template, prompt_ids
from spec_cli.chat.terminal import BLOCK, read_block
from spec_cli.completion import complete
from spec_cli.core.errors import SpecError
from spec_cli.core.events import Stats, Token
from spec_cli.core.settings import Decoding, Profile
from spec_cli.decoding.methods import NEEDS_DRAFT
from spec_cli.engine import Plan
from spec_cli.models.profiles import profile_args
from spec_cli.view import fancy, legend, make_console, summary


@dataclass
class Turn:
    """One generated reply, for /stats and for tests."""

    prompt: list[int]
    tokens: list[int]
    reply: str
    reason: str  # eos, length, stop (the next turn began), context, interrupted
    seconds: float
    stats: Stats
    messages: list[dict] = field(default_factory=list)  # the conversation it answered (after any dropping)


@dataclass
class Chat:
    engine: Any  # spec_cli.engine.Engine: .tokenizer, .oracle.context, .has_draft, .events(ids, plan, reuse)
    profile: Profile
    settings: Decoding
    template: Template
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    out: Console = field(default_factory=make_console)
    err: Console = field(default_factory=lambda: make_console(stderr=True))
    draft2: Any = None  # the second stage staged replies use
    skip: Any = None  # the self-draft's skip set
    heads: bool = False  # whether a model alone's fitted heads guess (`engine.Plan.heads`)
    trace: bool = False  # leave rejected candidates in the replies on screen
    turns: list[Turn] = field(default_factory=list)
    dirty: bool = False  # changed since it was last saved or loaded
    generations: int = 0
    confirm: Callable[[str], bool] | None = None  # asks a yes/no question (None: not interactive, so yes)

    # -- one turn --

    def send(self, text: str) -> Turn | None:
        """Add the user's message and generate the reply; on failure the message is not kept."""
        turn = self.generate(self.messages + [{"role": "user", "content": text}])
        if turn is not None:
            self.messages = turn.messages + [{"role": "assistant", "content": turn.reply}]
            self.dirty = True
        return turn

    def generate(self, messages: list[dict]) -> Turn | None:
        try:
            fitted = self.fit(messages)
        except SpecError as e:
            self.err.print(f"error: {e}", style="bold red", markup=False)
            return None
        if fitted is None:
            return None
        messages, ids = fitted
        settings = self.settings
        if settings.seed is not None and self.generations:  # reproducible, yet /regen samples anew
            settings = dataclasses.replace(settings, seed=settings.seed + self.generations)
        self.generations += 1
        view = ReplyView(self.engine.tokenizer, ids, self.template.stop, stream=self.out.file,
                         color=fancy(self.out), trace=self.trace)

        def watch(event) -> bool:
            if isinstance(event, Token):
                view.add(event)
                return view.stopped
            return False

        try:
            done = complete(self.engine, ids, Plan(settings, self.draft2, self.skip, self.heads), reuse=True, watch=watch)
        except SpecError as e:
            view.finish()
            self.err.print(f"error: {e}", style="bold red", markup=False)
            return None
        turn = Turn(ids, done.tokens, view.reply, done.reason, done.seconds, done.stats, messages)
        self.turns.append(turn)  # kept before anything else can be interrupted (a second Ctrl-C)
        try:
            self.report(view, turn, done, settings)
        except KeyboardInterrupt:
            pass
        return turn

    def report(self, view: ReplyView, turn: Turn, done, settings: Decoding) -> None:
        """End the reply on screen and print its statistics line and notes."""
        view.finish()
        quiet = dataclasses.replace(done, stats=dataclasses.replace(done.stats, finish_reason=None))
        line = summary(quiet)  # in a chat, stopping at EOS is the norm
        if done.reason == "length":
            line += f" · cut at max_new_tokens={settings.max_new_tokens}"
        elif done.reason == "interrupted":
            line += " · interrupted"
        elif done.reason == "context":
            line += " · the context window is full"
        self.err.print(line, style="dim", markup=False)
        if not turn.reply and done.reason in ("eos", "stop"):
            self.note("(the model ended its reply without writing anything; /regen or /set temperature may help)")
        if done.reason == "context":
            self.note(f"the reply filled the oracle's context window ({self.context_used(turn)} of "
                      f"{self.engine.oracle.context} tokens); the next message will offer to drop the oldest "
                      "exchanges", style="yellow")

    def fit(self, messages: list[dict]) -> tuple[list[dict], list[int]] | None:
        """The conversation to send and its token ids: when it leaves no room for a whole reply, offer to
        drop the oldest exchanges (the system prompt stays). None: the message cannot be sent."""
        context, reply = self.engine.oracle.context, self.settings.max_new_tokens
        ids = self.ids(messages)
        if len(ids) + reply <= context:
            return messages, ids
        for drop in range(1, len(messages) // 2 + 1):  # whole exchanges: a user message and its reply
            shorter = messages[2 * drop:]
            shorter_ids = self.ids(shorter)
            if len(shorter_ids) + reply <= context or drop == len(messages) // 2:
                break
        else:
            drop, shorter, shorter_ids = 0, messages, ids
        fits = len(ids) < context
        room = f"{len(ids)} tokens, and the reply may take {reply} more" if fits else f"{len(ids)} tokens"
        head = f"the conversation is {room}: the oracle's context window is {context} tokens"
        if drop and len(shorter_ids) < context and self.ask(
                f"{head}. Drop the oldest {_exchanges(drop)} (the system prompt stays)?"):
            self.note(f"dropped the oldest {_exchanges(drop)}: {len(shorter_ids)} tokens now")
            return shorter, shorter_ids
        if fits:
            self.note(f"{head}; the reply may be cut short", style="yellow")
            return messages, ids
        if not drop or len(shorter_ids) >= context:
            self.note(f"{head}: this message alone does not fit; shorten it (or /set max_tokens lower)",
                      style="yellow")
        else:
            self.note(f"{head}: that message was not added; /clear starts over", style="yellow")
        return None

    def ids(self, messages: list[dict]) -> list[int]:
        return prompt_ids(self.engine.tokenizer, self.template, self.system, messages)

    def ask(self, question: str) -> bool:
        if self.confirm is None:  # not interactive: nobody to ask, so make room
            self.note(question.rsplit(". ", 1)[0], style="yellow")
            return True
        return self.confirm(question)

    def context_used(self, turn: Turn | None = None) -> int:
        """Tokens of the window the conversation used after `turn` (the last one by default). The last
        token decided is never run, so at a full window this is the window's size, not one more."""
        turn = turn or (self.turns[-1] if self.turns else None)
        if turn is None:
            return 0
        return min(len(turn.prompt) + len(turn.tokens), self.engine.oracle.context)

    # -- commands --

    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end."""
        return commands.run(self, line)

    def note(self, text: str, style: str = "dim") -> None:
        self.err.print(text, style=style, markup=False)

    def snapshot(self) -> dict:
        return {
            "system": self.system,
            "messages": self.messages,
            "settings": {k: v for k, v in vars(self.settings).items()},
            "profile": self.profile.name,
            "profile_args": profile_args(self.profile, durable=True),
            "template": self.template.label,
            "saved": _dt.datetime.now().isoformat(timespec="seconds"),
        }

    def save(self, path: Path | None = None) -> Path:
        path = store.write(path, self.snapshot())
        self.dirty = False
        return path

    def restore(self, saved: dict, overrides: dict | None = None) -> None:
        """Continue a conversation from read_saved(); its settings, with `overrides` (flags) on top."""
        self.settings = store.saved_settings(saved, self.settings, overrides)
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

    def header(self, load_seconds: float | None = None) -> None:
        s, engine = self.settings, self.engine
        draft2 = s.method == "staged" and self.draft2 is not None and engine.has_draft
        loaded = f" · loaded in {load_seconds:.1f} s" if load_seconds is not None else ""
        line = Text(f"spec chat · {self.profile.name} · {s.method} · {engine.device.type} "
                    f"{str(engine.dtype).removeprefix('torch.')} · template {self.template.label}{loaded}",
                    style="dim")
        self.err.print(line)
        if fancy(self.out) and not os.environ.get("NO_COLOR"):
            self.err.print(legend(draft2, s.method == "staged" and s.lookup), style="dim")
        self.err.print("/help for commands, /exit or Ctrl-D to leave", style="dim")

    def run(self, read: Callable[[str], str | None]) -> int:
        """The read-reply loop. `read(prompt)` returns a line, None at end of input (Ctrl-D), or raises
        KeyboardInterrupt (Ctrl-C at the prompt: the line is dropped and a new prompt shown)."""
        try:
            while True:
                try:
                    line = read(">>> ")
                    if line is not None and line.strip() == BLOCK:
                        line = read_block(read)
                except KeyboardInterrupt:
                    self.err.print()
                    continue
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
        except OSError as e:  # (a full disk, a read-only home: the temporary folder, else the screen)
            failed = f"could not save the conversation in {store.chats_dir()}: {e.strerror or e}"
            try:
                path = self.save(store.new_chat_path(Path(tempfile.gettempdir()) / "spec-chats"))
            except OSError:
                self.note(f"{failed}; here it is, to keep:", style="yellow")
                print(json.dumps(self.snapshot(), ensure_ascii=False, indent=2), file=sys.stderr, flush=True)
                return
            self.note(f"{failed}; saved it in {path.parent} instead", style="yellow")
        self.note(f"conversation saved; continue it with: spec chat --load {shlex.quote(str(path))}")


def _exchanges(n: int) -> str:
    return f"{n} exchange{'s' * (n != 1)}"


def asker(read: Callable[[str], str | None]) -> Callable[[str], bool]:
    """A yes/no question at the terminal: Enter or y is yes; n, Ctrl-C and Ctrl-D are no."""

    def ask(question: str) -> bool:
        try:
            answer = read(f"{question} [Y/n] ")
        except KeyboardInterrupt:
            return False
        return answer is not None and answer.strip().lower() in ("", "y", "yes")

    return ask

