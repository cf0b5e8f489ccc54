"""`spec chat`: an interactive conversation with the oracle, streamed like `spec generate`.

templates.py turns a conversation into a prompt, reply.py shows a reply as it streams, session.py runs the
turns and the loop, commands.py the /commands, store.py the saved conversations, terminal.py the input.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from spec_cli.core.settings import Decoding, Profile


def start(profile: Profile, settings: Decoding, overrides: dict, *, system: str | None = None,
          template: str | None = None, saved: dict | None = None, load: Path | None = None,
          draft2: str | None = None, device: str | None = None, dtype: str | None = None,
          trace: bool = False, compile: bool | None = None) -> int:
    """Load the models and run the session (called by the CLI); the exit code."""
    from spec_cli.chat.session import Chat, asker
    from spec_cli.chat.store import data_dir, saved_settings
    from spec_cli.chat.templates import choose_template, read_template_option
    from spec_cli.chat.terminal import stream_reader, terminal_reader
    from spec_cli.completion import complete
    from spec_cli.core.process import settle
    from spec_cli.decoding.methods import DRAFTED
    from spec_cli.engine import Engine
    from spec_cli.view import fancy, loading, make_console

    option = read_template_option(template)
    if saved:
        settings = saved_settings(saved, settings, overrides)
    err = make_console(stderr=True)
    with loading(err, profile.name):
        engine = Engine(profile, device=device, dtype=dtype, need_draft=settings.method in DRAFTED,
                        compile=compile, fit_draft2=settings.method == "staged")
        plan = engine.plan(settings, draft2)
        settings = plan.settings  # (a draft of another vocabulary runs speculative)
        engine.warm_up(plan)
        if fancy(err):  # the first forwards of each shape are slow (kernel set-up): pay for them here
            warm = dataclasses.replace(settings, max_new_tokens=32, temperature=0.0)
            complete(engine, engine.encode("def"), plan.replace(settings=warm))
    settle()
    for note in engine.notes(plan):
        err.print(note, style="dim")
    chat = Chat(engine, profile, settings, choose_template(profile, engine.tokenizer, option), err=err,
                draft2=plan.draft2, skip=plan.skip, heads=plan.heads, trace=trace)
    if saved:
        chat.restore(saved, overrides)
    if system is not None:
        chat.system = system or None
    chat.header(engine.load_seconds)
    if saved:
        chat.note(f"continuing {load}: {len(chat.messages)} messages")
        chat.replay()
    if sys.stdin.isatty():
        read = terminal_reader(data_dir() / "chat_history")
        chat.confirm = asker(read)
    else:
        read = stream_reader(sys.stdin)
    return chat.run(read)
