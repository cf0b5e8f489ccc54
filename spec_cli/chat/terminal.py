"""Where a chat's lines come from: the terminal (readline, history), a pipe, or a list (tests)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

BLOCK = '"""'


def interrupts_reach_the_prompt() -> None:
    """Make Ctrl-C at the prompt work although PyTorch has threads.

    The kernel hands SIGINT to any thread; when it is one of PyTorch's, the main thread, blocked in
    readline's select(), never sees it, and the line stays (Ctrl-C then seems to do nothing until Enter).
    Python writes each signal's number to a wakeup pipe; a watcher thread reading it pokes the main thread
    with SIGUSR1 (whose handler does nothing), so select() returns and the pending KeyboardInterrupt fires.
    """
    import os
    import signal
    import threading
    import time

    if not hasattr(signal, "pthread_kill") or threading.current_thread() is not threading.main_thread():
        return  # pragma: no cover - Windows, or not called from the main thread
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    main = threading.main_thread().ident

    def watch() -> None:
        while True:
            received = os.read(read_end, 64)
            if signal.SIGINT in received:
                for pause in (0.0, 0.05, 0.2):  # again a little later, in case the main thread was not yet
                    time.sleep(pause)            # waiting in select() (it checks signals only when woken)
                    signal.pthread_kill(main, signal.SIGUSR1)

    threading.Thread(target=watch, name="spec-interrupts", daemon=True).start()


def terminal_reader(history: Path | None) -> Callable[[str], str | None]:
    """input() with readline editing and a persistent history, when readline is there."""
    interrupts_reach_the_prompt()
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


def read_block(read: Callable[[str], str | None]) -> str | None:
    lines = []
    while True:
        line = read("... ")
        if line is None or line.strip() == BLOCK:
            return "\n".join(lines) if lines or line is not None else None
        lines.append(line)
