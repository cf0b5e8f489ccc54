"""The /commands of a chat, and /set's parsing of a setting from text."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from rich.table import Table

from spec_cli.chat import store
from spec_cli.core.errors import SpecError
from spec_cli.core.settings import Decoding
from spec_cli.decoding.methods import NEEDS_DRAFT

ALIASES = {"max_tokens": "max_new_tokens", "n": "max_new_tokens", "t": "temperature"}
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


def run(chat, line: str) -> bool:
    """Run a /command on `chat`; False when the session should end."""
    name, _, arg = line.partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ("/exit", "/quit"):
        return False
    handler = HANDLERS.get(name)
    if handler is None:
        close = difflib.get_close_matches(name, ALL_COMMANDS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}?)" if close else ""
        chat.note(f"unknown command {name}{hint}; /help lists the commands, // sends a line starting with /",
                  style="yellow")
        return True
    handler(chat, arg)
    return True


def help_(chat, _: str) -> None:
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, text in COMMANDS.items():
        table.add_row(name, text)
    table.add_row('"""', 'a line of just """ starts a multi-line message; another ends it')
    table.add_row("//", "a line starting with // sends it with a single / (not a command)")
    table.add_row("Ctrl-C", "stops a reply (keeps what came so far); at the prompt it clears the line")
    chat.out.print(table)


def clear(chat, _: str) -> None:
    chat.messages = []
    chat.note("conversation cleared (system prompt and settings kept)")


def regen(chat, _: str) -> None:
    if not chat.messages or chat.messages[-1]["role"] != "assistant":
        chat.note("nothing to regenerate yet", style="yellow")
        return
    messages = chat.messages[:-1]
    turn = chat.generate(messages)
    if turn is not None:
        chat.messages = turn.messages + [{"role": "assistant", "content": turn.reply}]
        chat.dirty = True


def system(chat, arg: str) -> None:
    chat.system = arg or None
    chat.dirty = True
    chat.note("system prompt set" if arg else "system prompt removed")


def set_(chat, arg: str) -> None:
    key, _, value = arg.partition(" ")
    value = value.strip()
    if not key or not value:
        chat.note("usage: /set KEY VALUE, e.g. /set temperature 0.7 (keys: " + ", ".join(settable()) + ")",
                  style="yellow")
        return
    try:
        chat.settings = set_setting(chat.settings, key, value, has_draft=chat.engine.has_draft)
    except SpecError as e:
        chat.note(f"error: {e} (settings unchanged)", style="bold red")
        return
    name = canonical_key(key)
    chat.note(f"{name} = {getattr(chat.settings, name)!r}")


def show(chat, _: str) -> None:
    engine = chat.engine
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # (a long path folds onto the next lines, never cut to "...")
    table.add_row("profile", f"{chat.profile.name} ({chat.profile.source})")
    table.add_row("device", f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}")
    table.add_row("template", chat.template.label)
    table.add_row("system", chat.system if chat.system else "(none)")
    table.add_row("messages", f"{len(chat.messages)} (context window {engine.oracle.context} tokens)")
    for key, value in vars(chat.settings).items():
        table.add_row(key, repr(value))
    chat.out.print(table)


def stats(chat, _: str) -> None:
    if not chat.turns:
        chat.out.print("no replies yet")
        return
    from spec_cli.core.events import Stats

    total = Stats()
    for turn in chat.turns:
        total.merge(turn.stats)
    seconds = sum(t.seconds for t in chat.turns)
    rate = total.new_tokens / seconds if seconds > 0 else 0.0
    interrupted = sum(t.reason == "interrupted" for t in chat.turns)
    lines = [
        f"replies        {len(chat.turns)}" + (f" ({interrupted} interrupted)" if interrupted else ""),
        f"tokens         {total.new_tokens} in {seconds:.2f} s, {rate:.1f} tok/s",
        f"prompt         {total.prompt_tokens} tokens run (the rest came from the cache)",
        f"per forward    {total.tokens_per_oracle_forward:.2f} tokens per oracle forward "
        f"({total.oracle_forwards} forwards)",
    ]
    for verifier, label in (("oracle", "draft"), ("draft", "draft2")):
        acceptance = total.acceptance(verifier)
        if acceptance is not None:
            lines.append(f"{label + ' accepted':<14} {acceptance:.0%}")
    lines.append(f"context        {chat.context_used()} of {chat.engine.oracle.context} tokens after the last reply")
    for line in lines:
        chat.out.print(line, markup=False)


def save(chat, arg: str) -> None:
    try:
        path = chat.save(Path(arg).expanduser() if arg else None)
    except OSError as e:
        chat.note(f"error: cannot save: {e.strerror or e}", style="bold red")
        return
    chat.note(f"saved {len(chat.messages)} messages to {path}")


def load(chat, arg: str) -> None:
    if not arg:
        chat.note("usage: /load FILE", style="yellow")
        return
    try:
        chat.restore(store.read_saved(Path(arg).expanduser()))
    except SpecError as e:
        chat.note(f"error: {e}", style="bold red")
        return
    chat.note(f"loaded {len(chat.messages)} messages from {arg}")
    chat.replay()


HANDLERS = {"/help": help_, "/clear": clear, "/regen": regen, "/system": system, "/set": set_, "/show": show,
            "/stats": stats, "/save": save, "/load": load}


# --- /set -------------------------------------------------------------------------------------------


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
