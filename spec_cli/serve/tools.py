"""Tool calls (OpenAI's `tools`): the calls a reply holds, read back from its text, whole or as it streams.

spec never bends the oracle's text toward a call (its text stays the model's own); a reply that holds calls in a
form models are trained to write (or write anyway) is answered as `tool_calls`:
- Hermes's tags (Qwen2.5 and Qwen3, Hermes, SmolLM3, ...): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one or several, with text around them; inside the tags also Qwen3-Coder's XML and GLM-4.5's argument pairs;
- a fenced JSON block of calls (what Qwen2.5-Coder writes: ```json {"name": ..., "arguments": ...} ```), text around;
- the whole reply one JSON object or a list of them (Llama 3.1-3.3's `{"name": ..., "parameters": {...}}`, Mistral's
  list once its `[TOOL_CALLS]` special token is dropped).
Untagged calls count only when every name is one of the request's tools. A reply whose tagged calls do not parse
(cut short, bad JSON) stays text, whole.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAGGED = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL)
XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
NAMED = re.compile(r'\[?\s*\{\s*"name"')  # a JSON call's start (a list of them: its first)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API gives it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self, index: int | None = None) -> dict:
        """As a message's (or, with its index, a streamed delta's) entry of `tool_calls`."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def _call(value, names: frozenset[str] | None) -> Call | None:
    """A call from a parsed JSON value, or None when it is not one (or names a tool not given, where `names`)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_calls(text: str, names: frozenset[str]) -> list[Call]:
    """The calls a JSON object or list of them is, each naming one of `names` (its first key "name", as models
    write calls: the rule a stream can apply before the object ends); [] if it is not that."""
    if not NAMED.match(text.lstrip()):
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    calls = [_call(v, names) for v in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else []


def _tagged(body: str) -> Call | None:
    """The call a <tool_call> tag holds: Hermes's JSON, Qwen3-Coder's XML (<function=NAME><parameter=KEY>VALUE
    </parameter>...</function>) or GLM-4.5's (NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...); a value
    that reads as JSON (a number, a list, an object) is that, else the text."""
    try:
        return _call(json.loads(body), None)
    except ValueError:
        pass
    function = XML_FUNCTION.fullmatch(body.strip())
    if function:
        name, pairs = function.group(1), XML_PARAMETER.findall(function.group(2))
    elif "<arg_key>" in body:
        name, _, rest = body.partition("<arg_key>")
        name, pairs = name.strip(), GLM_ARGUMENT.findall("<arg_key>" + rest)
    else:
        return None
    if not name or "<" in name:
        return None
    return Call(name, json.dumps({key.strip(): _value(value) for key, value in pairs}, ensure_ascii=False))


def _value(text: str):
    text = text.strip("\n")
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_calls(text: str, names: frozenset[str]) -> tuple[str, list[Call]]:
    """(the text outside the calls, the calls) of a whole reply; (text, []) when it holds none."""
    outside, calls = _split(text, names)
    return (outside.strip(), calls) if calls else (text, [])


def _split(text: str, names: frozenset[str]) -> tuple[str, list[Call]]:
    if OPEN in text:
        calls = []
        for match in TAGGED.finditer(text):
            call = _tagged(match.group(1))
            if call is None:
                return text, []
            calls.append(call)
        return TAGGED.sub("", text), calls
    calls, outside, last = [], [], 0
    for match in FENCED.finditer(text):
        found = _json_calls(match.group(1), names)
        if found:
            calls += found
            outside.append(text[last:match.start()])
            last = match.end()
    if calls:
        return "".join(outside + [text[last:]]), calls
    calls = _json_calls(text.strip(), names) if text.strip()[:1] in ("{", "[") else []
    return ("", calls) if calls else (text, [])


def _may_begin(rest: str) -> bool:
    """Whether `rest` (a reply's text from some point on) is, or may yet grow into, the start of a tagged or
    fenced call (a fence whose JSON starts as a call's)."""
    if rest.startswith(OPEN) or OPEN.startswith(rest):
        return True
    if not rest.startswith("```"):
        return "```".startswith(rest)
    after = rest[3:]
    if len(after) < 4 and "json".startswith(after):
        return True
    after = after.removeprefix("json").lstrip(" \t")
    if not after:
        return True
    if after[0] != "\n":
        return False
    return _may_name(after[1:])


def _may_name(text: str) -> bool:
    """Whether JSON text is, or may yet grow into, the start of a call (`{"name"`, or a list whose first is)."""
    compact = "".join(text.split())[:8]
    return any(start.startswith(compact) or compact.startswith(start) for start in ('{"name"', '[{"name"'))


class CallStream:
    """A reply's text deltas in, the text that may go out now out: all of it but what may be a call (from a tag's
    or a JSON fence's first character on, or the whole reply while it may be one JSON call: while its JSON starts
    as one), held until `end` reads it, and trailing whitespace (a call after it would take it)."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.text = ""
        self.sent = 0

    def add(self, delta: str) -> str:
        self.text += delta
        if not self.text.strip() or self.text.lstrip()[:1] in "{[" and _may_name(self.text):
            return ""
        hold = next((i for i in range(self.sent, len(self.text)) if self.text[i] in "<`" and _may_begin(self.text[i:])),
                    len(self.text))
        hold = max(self.sent, len(self.text[:hold].rstrip()))  # whitespace goes out with what follows it
        out, self.sent = self.text[self.sent:hold], hold
        return out

    def end(self) -> tuple[str, list[Call]]:
        """The text still to go out, and the reply's calls: what went out and this add up to `read_calls`'s text
        (but for whitespace the reply began with)."""
        _, calls = _split(self.text, self.names)
        if not calls:
            return self.text[self.sent:], []
        rest = _split(self.text[self.sent:], self.names)[0].rstrip()
        return (rest if self.text[:self.sent].strip() else rest.lstrip()), calls
