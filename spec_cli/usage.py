"""Mistakes on the command line as one line that names what was wrong and the nearest right thing.

The parser's exceptions are typer's own (typer >= 0.29 vendors click) or click's (older typer): both are
recognised by what they carry, not by their module.
"""

from __future__ import annotations

import difflib
import re


def is_parser_error(e: BaseException) -> bool:
    module = type(e).__module__ or ""
    return module.split(".")[0] in ("typer", "click") and hasattr(e, "format_message")


def usage_error(e: BaseException) -> tuple[int, str | None, str | None] | None:
    """(exit code, the error line or None, text for stdout or None) for a parser exception, else None."""
    if not is_parser_error(e):
        return None
    name = type(e).__name__
    if name == "NoArgsIsHelpError":  # bare `spec` or `spec bench`: the help (typer's rich help is already out)
        return 0, None, e.format_message() or None
    ctx = getattr(e, "ctx", None)
    command = getattr(ctx, "command_path", None) or "spec"
    code = getattr(e, "exit_code", 2)
    code = code if isinstance(code, int) and code else 2
    message = getattr(e, "message", None) or str(e)
    if name == "NoSuchOption":
        option = getattr(e, "option_name", None) or message.rsplit(" ", 1)[-1]
        near = nearest(option, _options(ctx)) if option.startswith("--") else []
        hint = f" (did you mean {_either(near)}?)" if near else f"; `{command} -h` lists the options"
        return code, f"unknown option {option} for {command}{hint}", None
    found = re.match(r"No such command '([^']+)'", message)
    if found:
        typo = found.group(1)
        commands = _commands(ctx)
        near = nearest(typo, commands)
        hint = f" (did you mean {_either(near)}?)" if near else f"; commands: {', '.join(commands)}"
        return code, f"unknown command '{typo}' for {command}{hint}", None
    param = getattr(e, "param", None)
    if name == "MissingParameter" and param is not None:
        what = getattr(param, "param_type_name", "argument")
        label = _flags(param) if what == "option" else (param.name or "").upper()
        return code, f"{command}: missing {what} {label}", None
    if name == "BadParameter" and param is not None:
        return code, _bad_value(e, param), None
    found = re.match(r"Option '(.+)' requires an argument", message)
    if found:
        return code, f"option {found.group(1)} needs a value", None
    found = re.match(r"Option '(.+)' does not take a value", message)
    if found:
        return code, f"option {found.group(1)} takes no value", None
    found = re.match(r"Got unexpected extra argument(?:\(s\)|s)? \((.*)\)", message)
    if found:
        hint = " (put quotes around a prompt that has spaces)" if command.endswith("generate") else ""
        return code, f"{command}: unexpected extra argument(s): {found.group(1)}{hint}", None
    text = e.format_message() if hasattr(e, "format_message") else message
    return code, (text[:1].lower() + text[1:]).rstrip("."), None


def nearest(word: str, choices: list[str]) -> list[str]:
    """The choices `word` begins (all of them), else the closest one."""
    starts = [c for c in choices if c.startswith(word)]
    if starts:
        return starts[:3]
    return difflib.get_close_matches(word, choices, n=1, cutoff=0.6)


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"


def _options(ctx) -> list[str]:
    if ctx is None:
        return []
    names = list(getattr(ctx, "help_option_names", []) or [])
    for param in getattr(ctx.command, "params", []):
        if getattr(param, "param_type_name", "") == "option":
            names += [o for o in list(param.opts) + list(getattr(param, "secondary_opts", [])) if o.startswith("--")]
    return sorted(set(n for n in names if n.startswith("--")))


def _commands(ctx) -> list[str]:
    try:
        return list(ctx.command.list_commands(ctx))
    except AttributeError:
        return []


def _flags(param) -> str:
    opts = sorted(param.opts, key=lambda o: (not o.startswith("--"), o))
    return "/".join(opts)


KINDS = {"float_parsing": "a number", "int_parsing": "a whole number", "int_from_float": "a whole number",
         "bool_parsing": "true or false"}


def _bad_value(e, param) -> str:
    """`-t abc`: which option, what it takes, what it got."""
    label = _flags(param) if getattr(param, "param_type_name", "") == "option" else (param.name or "").upper()
    value, kind = None, None
    cause = e.__cause__
    if cause is not None and hasattr(cause, "errors"):  # pydantic's ValidationError (typer >= 0.29)
        try:
            first = cause.errors()[0]
            value, kind = first.get("input"), KINDS.get(first.get("type"))
        except Exception:  # noqa: BLE001 - only a nicer message is lost
            pass
    if kind is not None and value is not None:
        return f"{label} takes {kind}, not '{value}'"
    message = getattr(e, "message", "") or str(e)
    return f"invalid value for {label}: {message[:1].lower() + message[1:]}"
