"""What goes wrong in a way the user can act on (one line, no traceback), and lines said beside the output."""

from __future__ import annotations

import sys


class SpecError(Exception):
    """An error the user can act on: the CLI prints its message as one line, without a traceback."""


class OutOfMemory(SpecError):
    """The device ran out of memory: a server answers 503 with the message and keeps serving."""


class PromptTooLong(SpecError):
    """The prompt leaves no room for a new token in the context window: a server answers 400."""


def check_room(prompt_tokens: int, context: int, model: str = "oracle") -> None:
    """PromptTooLong unless a prompt of `prompt_tokens` leaves room for a new token in the `model`'s `context`."""
    if prompt_tokens >= context:
        raise PromptTooLong(f"the prompt is {prompt_tokens} tokens, but the {model}'s context window is {context} "
                            "tokens (it must leave room for at least one new token)")


def say(line: str) -> None:
    """One line on stderr: a note or progress, beside the output (a load's progress, a first read)."""
    print(line, file=sys.stderr, flush=True)


def first_line(e: BaseException) -> str:
    """An exception as one line: its message's first line, else its type's name."""
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def described(e: BaseException) -> str:
    """An exception as one line naming its type: `ValueError: the message's first line`."""
    message = str(e).splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {message}" if message else type(e).__name__
