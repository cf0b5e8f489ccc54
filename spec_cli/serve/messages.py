"""Anthropic's Messages API (`POST /v1/messages`), as Claude Code and Anthropic's SDKs speak it: a request's content
blocks, tool uses and tool results turned into the conversation a chat template renders, and a reply (its
thinking, text and tool calls, read as for the OpenAI routes) into content blocks, whole or as the stream of
events Anthropic's clients assemble."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from spec_cli.serve.replies import STEERED, Unanswerable
from spec_cli.serve.tools import Call


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # (cache_control, citations: nothing to do here)
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class Turn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["user", "assistant", "system"]  # (Claude Code sends system turns among the others)
    content: Union[str, list[Block]]


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Turn] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[ToolSpec] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


class CountRequest(MessagesRequest):
    """`/v1/messages/count_tokens`'s: a request's prompt, no output asked for."""

    max_tokens: int | None = None


def _text(content: Union[str, list[TextBlock], None]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content or [])


def conversation(request: MessagesRequest) -> tuple[str | None, list[dict]]:
    """(the system prompt, the messages as chat templates take them): a user turn's tool results become tool
    messages (before its text), an assistant turn's tool uses its tool calls; thinking is left out (templates
    drop earlier turns' thinking); a system turn among the others is a user message where it stands (templates
    take a system message first only)."""
    system = _text(request.system) if request.system is not None else None
    messages = []
    for i, turn in enumerate(request.messages):
        blocks = [TextBlock(type="text", text=turn.content)] if isinstance(turn.content, str) else turn.content
        texts, calls = [], []
        for block in blocks:
            wrong = (block.type == "tool_use" and turn.role != "assistant"
                     or block.type == "tool_result" and turn.role != "user")
            if wrong:
                raise Unanswerable(f"messages[{i}]: a {turn.role} turn cannot hold a {block.type} block",
                                   f"messages.{i}.content")
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif block.type == "tool_result":
                result = _text(block.content)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {result}" if block.is_error else result})
        if texts or calls or not blocks:
            message = {"role": "user" if turn.role == "system" else turn.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return system, messages


def tool_entries(request: MessagesRequest) -> list[dict]:
    """The request's tools as OpenAI's function entries (what `CallStream` and the templates take); none where
    `tool_choice` is none. A choice that forces a call is refused: spec's text stays the model's own."""
    choice = (request.tool_choice or {}).get("type", "auto")
    if choice in ("any", "tool"):
        raise Unanswerable(STEERED, "tool_choice")
    if choice == "none" or not request.tools:
        return []
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in request.tools]


def stop_reason(finish: str, calls: list[Call]) -> str:
    if calls:
        return "tool_use"
    return {"eos": "end_turn", "stop": "stop_sequence", "shutdown": "end_turn"}.get(finish, "max_tokens")


def ident() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use(call: Call) -> dict:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
            "input": json.loads(call.arguments)}


def blocks(reasoning: str | None, text: str, calls: list[Call]) -> list[dict]:
    """A whole reply's content blocks: its thinking, its text, its tool uses."""
    found = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    if text or not (found or calls):
        found.append({"type": "text", "text": text})
    return found + [tool_use(call) for call in calls]


def error_body(status: int, message: str) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class BlockStream:
    """A reply's pieces (thinking, then text) and at its end its calls, as content-block events: a block starts
    where a piece of another kind comes, and stops before the next."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "thinking" or "text"

    def piece(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self.open != kind:
            events += self.close()
            self.index, self.open = self.index + 1, kind
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append(event("content_block_start", {"index": self.index, "content_block": start}))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [event("content_block_delta", {"index": self.index, "delta": delta})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def calls(self, calls: list[Call]) -> list[str]:
        events = self.close()
        for call in calls:
            self.index += 1
            use = tool_use(call)
            events += [event("content_block_start", {"index": self.index, "content_block": {**use, "input": {}}}),
                       event("content_block_delta", {"index": self.index, "delta": {
                           "type": "input_json_delta", "partial_json": call.arguments}}),
                       event("content_block_stop", {"index": self.index})]
        return events
