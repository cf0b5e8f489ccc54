"""Running `spec` in a pseudo-terminal, and what a terminal would show afterwards (pyte emulates one)."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time

SIGINT_BACK = (  # as in a shell: a test runner may have left SIGINT ignored for its children
    "import signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
)


def spawn(args, env, columns=120, lines=40, prelude=""):
    """`spec ARGS` on a new pty that is its controlling terminal; (process, master fd)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))

    def controlling_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    code = SIGINT_BACK + prelude + "from spec_cli.cli import main\nsys.argv = ['spec'] + sys.argv[1:]\nmain()\n"
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(lines), **env}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                            preexec_fn=controlling_terminal, close_fds=True)
    os.close(slave)
    return proc, master


def read_until(fd, pattern: bytes, seen: bytearray, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pattern not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                return False
            if not chunk:
                return False
            seen.extend(chunk)
    return True


def run(args, env, columns=120, lines=40, timeout=120, prelude="") -> tuple[int, bytes]:
    """Run to the end: (exit code, everything written to the terminal)."""
    proc, master = spawn(args, env, columns, lines, prelude)
    seen = bytearray()
    try:
        read_until(master, b"\x00never", seen, timeout)  # until the child closes the terminal
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, bytes(seen)


def screen(data: bytes, columns=120, lines=40):
    """The pyte screen after `data`: .display (rows of text) and .buffer (characters with attributes)."""
    import pyte

    terminal = pyte.Screen(columns, lines)
    stream = pyte.ByteStream(terminal)
    stream.feed(data)
    return terminal
