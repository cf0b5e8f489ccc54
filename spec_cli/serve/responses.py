"""OpenAI's Responses API (`POST /v1/responses`), as OpenAI's newer clients and agents speak it (Codex CLI, the
Agents SDK): input items (messages, function calls and their outputs) turned into the conversation a chat
template renders, and a reply (its thinking, text and calls) into output items, whole or as the stream of events
the `openai` client assembles. Stateless: `previous_response_id` is refused (clients send the whole input)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from spec_cli.serve.replies import STEERED, Unanswerable
from spec_cli.serve.tools import Call


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["input_text", "output_text", "text"]
    text: str


class Item(BaseModel):
    """A message (role and content), a function call, or a call's output; reasoning items are passed over."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Union[str, list[ContentPart], None] = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Union[str, list[ContentPart], None] = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: Union[str, list[Item]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict, None] = None
    previous_response_id: str | None = None


def _text(content: Union[str, list[ContentPart], None]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content or [])


def conversation(request: ResponsesRequest) -> tuple[str | None, list[dict]]:
    """(the system prompt: the instructions, and a first system or developer message; the messages as chat
    templates take them): function calls join the assistant's message before them, their outputs are tool
    messages; a later system message is a user message where it stands."""
    if request.previous_response_id:
        raise Unanswerable("previous_response_id: this server keeps no responses; send the whole input",
                           "previous_response_id")
    items = [Item(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    system, messages = [request.instructions] if request.instructions else [], []
    for i, item in enumerate(items):
        if item.type == "message":
            if item.role is None:
                raise Unanswerable(f"input[{i}]: a message needs a role", f"input.{i}.role")
            if item.role in ("system", "developer") and not messages:
                system.append(_text(item.content))
            else:
                role = "user" if item.role in ("system", "developer") else item.role
                messages.append({"role": role, "content": _text(item.content)})
        elif item.type == "function_call":
            if not (item.call_id and item.name):
                raise Unanswerable(f"input[{i}]: a function call needs its call_id and name", f"input.{i}")
            try:
                arguments = json.loads(item.arguments or "{}")
            except ValueError:
                arguments = item.arguments
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id or "", "content": _text(item.output)})
    return "\n\n".join(system) or None, messages


def tool_entries(request: ResponsesRequest) -> list[dict]:
    """The request's tools as the chat route's function entries; none where `tool_choice` is none. A choice
    that forces a call is refused: spec's text stays the model's own."""
    if request.tool_choice == "required" or isinstance(request.tool_choice, dict):
        raise Unanswerable(STEERED, "tool_choice")
    if request.tool_choice == "none" or not request.tools:
        return []
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in request.tools]


def ident(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None
            else []}


def call_item(call: Call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": call.id.replace("call_", "fc_", 1), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def output(reasoning: str | None, text: str, calls: list[Call]) -> list[dict]:
    """A whole reply's output items: its thinking, its message, its calls."""
    items = [reasoning_item(ident("rs"), reasoning)] if reasoning else []
    if text or not (items or calls):
        items.append(message_item(ident("msg"), text))
    return items + [call_item(call) for call in calls]


def response(ident_: str, model: str, request: ResponsesRequest, items: list[dict], status: str,
             usage: dict | None, incomplete: str | None = None) -> dict:
    return {"id": ident_, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": items, "parallel_tool_calls": True,
            "tool_choice": request.tool_choice if isinstance(request.tool_choice, str) else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "instructions": request.instructions, "temperature": request.temperature, "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens, "previous_response_id": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None, "error": None, "usage": usage}


class EventStream:
    """A reply's pieces (thinking, then text) and at its end its calls, as the Responses API's events, each
    numbered: an output item is added where a piece of another kind comes, and done before the next."""

    def __init__(self):
        self.number = -1
        self.items: list[dict] = []  # the output so far, each item whole once done
        self.open: str | None = None  # "reasoning" or "message": the item being written
        self.text = ""

    def event(self, kind: str, **data) -> str:
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.number, **data}, ensure_ascii=False)}\n\n"

    def piece(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self.open != kind:
            events += self.close()
            self.open, self.text = kind, ""
            if kind == "reasoning":
                item = {"type": "reasoning", "id": ident("rs"), "summary": [], "content": []}
            else:
                item = message_item(ident("msg"), None, "in_progress")
            self.items.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=part))
        self.text += text
        item, where = self.items[-1], dict(item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                                           content_index=0)
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", delta=text, **where)]
        return events + [self.event("response.output_text.delta", delta=text, logprobs=[], **where)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        kind, text, self.open = self.open, self.text, None
        where = dict(item_id=self.items[-1]["id"], output_index=len(self.items) - 1)
        if kind == "reasoning":
            self.items[-1] = reasoning_item(self.items[-1]["id"], text)
            part = self.items[-1]["content"][0]
            done = self.event("response.reasoning_text.done", text=text, content_index=0, **where)
        else:
            self.items[-1] = message_item(self.items[-1]["id"], text)
            part = self.items[-1]["content"][0]
            done = self.event("response.output_text.done", text=text, logprobs=[], content_index=0, **where)
        return [done, self.event("response.content_part.done", content_index=0, part=part, **where),
                self.event("response.output_item.done", output_index=where["output_index"], item=self.items[-1])]

    def calls(self, calls: list[Call]) -> list[str]:
        events = self.close()
        for call in calls:
            item = call_item(call)
            self.items.append(item)
            where = dict(item_id=item["id"], output_index=len(self.items) - 1)
            events += [self.event("response.output_item.added", output_index=where["output_index"],
                                  item={**item, "arguments": "", "status": "in_progress"}),
                       self.event("response.function_call_arguments.delta", delta=call.arguments, **where),
                       self.event("response.function_call_arguments.done", arguments=call.arguments, **where),
                       self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        return events
