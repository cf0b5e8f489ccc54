"""The OpenAI-compatible HTTP API (FastAPI): requests checked into a Job for the worker, its messages turned
into OpenAI's response objects or server-sent event chunks, every mistake into an OpenAI-style JSON error."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from spec_cli.chat.templates import Template, prompt_ids, takes_tools
from spec_cli.core.errors import SpecError
from spec_cli.core.events import Token
from spec_cli.core.settings import MAX_LOGPROBS, Decoding
from spec_cli.detok import TokenBytes, token_text
from spec_cli.serve import messages as messages_api
from spec_cli.serve import responses as responses_api
from spec_cli.serve.infill import Fim, infill_ids
from spec_cli.serve.reasoning import opened, thinks
from spec_cli.serve.replies import STEERED, ChatReply, Unanswerable
from spec_cli.serve.worker import (
    Done,
    Failed,
    Job,
    Refused,
    Result,
    Started,
    Text,
    Worker,
)


@dataclass
class Service:
    """What the API serves: the worker (and through it the engine), the model's name, the settings a
    request starts from (greedy or sampling: `spec tune` may have found a shape for each), the chat template."""

    name: str
    worker: Worker
    tokenizer: object
    context: int
    defaults: Callable[[float | None], Decoding]  # the settings for a request's temperature (None: the default)
    template: Template
    encode: Callable[[str], list[int]]
    log: Callable[[str], None]
    api_key: str | None = None
    created: int = 0
    debug: bool = False
    fim: Fim | None = None  # the model's fill-in-the-middle tokens (None: it has none)
    prefixes: Callable[[], dict] = dict  # each model's prefix cache (`exec.prefixes`), for /metrics
    aliases: frozenset[str] = frozenset()  # other names a request may give the model (`model_aliases`), lowercase


def model_aliases(model: str) -> frozenset[str]:
    """The names a request may also give the oracle `model` (a hub id, folder or GGUF file), lowercase: its id and
    the part after the owner, or its file's or folder's name, with and without `.gguf` (what an editor's settings
    say: `qwen2.5-coder-1.5b-instruct-q4_k_m`, not the served name spec makes of a path)."""
    path = Path(model)
    names = {path.name, path.name.removesuffix(".gguf")} if path.is_absolute() else {model, model.split("/")[-1]}
    return frozenset(n.lower() for n in names if n)


# -- requests --

class StreamOptions(BaseModel):
    include_usage: bool = False


class Params(BaseModel):
    """What both endpoints take; fields of OpenAI's API that do not change the output here are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's, but llama-server's and vLLM's
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: Union[bool, int, None] = None


class CompletionRequest(Params):
    prompt: Union[str, list[str]]
    suffix: str | None = None  # fill in the middle: the text after the completion


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    filename: str = ""
    text: str = ""


class InfillRequest(Params):
    """llama.cpp's /infill, as its editor plugins send it (llama.vim, llama.vscode)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = []
    prompt: str = ""  # continues the prefix
    n_predict: int | None = None  # llama.cpp's word for max_tokens (-1 or 0: the server's default)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str = "{}"  # a JSON object's text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None


class Function(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: Function


class ChatRequest(Params):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict, None] = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict | None = None  # more variables for the template (Qwen3's enable_thinking, ...)
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None  # llama.cpp's: "none" leaves it in content


def template_message(m: Message) -> dict:
    """A message as chat templates take it (a call's arguments as an object, as Hugging Face's templates write
    them)."""
    content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
    message = {"role": m.role, "content": content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
    if m.role == "tool":
        message.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
    return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# -- errors --

def error(status: int, message: str, code: str | None = None, param: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "missing" and param:
        return f"missing required parameter '{param}'", param
    got = first.get("input")
    shown = json.dumps(got)[:80] if got is not None and first.get("type") != "model_attributes_type" else None
    return f"{param or 'body'}: {first.get('msg')}" + (f" (got {shown})" if shown else ""), param


# -- the app --

def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="spec", docs_url=None, redoc_url=None, openapi_url=None)

    def answer_error(request: Request, status: int, message: str, code: str | None = None, param: str | None = None,
                     headers: dict | None = None) -> JSONResponse:
        """An error in the form of the route's API: Anthropic's on /v1/messages, else OpenAI's."""
        if request.url.path.startswith("/v1/messages"):
            return JSONResponse(messages_api.error_body(status, message), status_code=status, headers=headers)
        return error(status, message, code, param, headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        service.log(f"{request.method} {request.url.path} {exc.status} · {exc.message}")
        return answer_error(request, exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        service.log(f"{request.method} {request.url.path} {exc.status_code} · {exc.detail}")
        return answer_error(request, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    def guard(endpoint):
        """An endpoint whose unexpected exceptions are a 500 JSON error (the traceback with --debug)."""

        @functools.wraps(endpoint)
        async def guarded(*args, **kwargs):
            try:
                return await endpoint(*args, **kwargs)
            except ApiError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug answers 500 and the server keeps serving
                if service.debug:
                    traceback.print_exc()
                request = kwargs["request"]
                service.log(f"{request.method} {request.url.path} 500 · {type(exc).__name__}: {exc}")
                return answer_error(request, 500, f"{type(exc).__name__}: {exc}", "internal_error")

        return guarded

    async def parse(request: Request, kind: type[BaseModel]):
        try:
            return kind.model_validate_json(await request.body())
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, "invalid_request", param) from None

    def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer":  # (Anthropic's clients send it as x-api-key)
            token = request.headers.get("x-api-key", "")
        if not token or not hmac.compare_digest(token.strip().encode(), service.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' (or "
                                "'x-api-key: KEY')", "invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != service.name and name.lower() not in service.aliases:
            also = f" (or {', '.join(repr(a) for a in sorted(service.aliases))})" if service.aliases else ""
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{service.name}'{also}",
                           "model_not_found", "model")

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():  # (a client's check that a server answers here)
        return {"status": "ok", "model": service.name}

    @app.get("/health")
    async def health():
        worker = service.worker
        recent = [result for _, result in worker.finished]
        tokens, seconds = sum(r.completion_tokens for r in recent), sum(r.seconds for r in recent)
        return {"status": "shutting down" if worker.stopping.is_set() else "ok", "model": service.name,
                "generating": worker.decoding, "slots": worker.parallel, "warming": not worker.warmed.is_set(),
                "queued": worker.jobs.qsize(),
                "completed": worker.completed,
                "tokens_per_second": round(tokens / seconds, 1) if seconds else None}

    @app.get("/metrics")
    async def metrics():
        """Prometheus's text format: requests decoding and queued, and by method the requests, tokens, seconds,
        tokens per second, tokens per oracle forward and draft acceptance; the prefix cache's hits."""
        worker = service.worker
        lines = [f"spec_requests_decoding {worker.decoding}", f"spec_requests_queued {worker.jobs.qsize()}",
                 f"spec_requests_completed_total {worker.completed}", f"spec_slots {worker.parallel}"]
        if worker.lockstep is not None:  # the slots' shared forwards: how many, and how full
            counts = worker.lockstep.counts
            lines += [f"spec_shared_forwards_total {counts.forwards}",
                      f"spec_shared_forward_sequences_total {counts.sequences}",
                      f"spec_shared_forward_rows_total {counts.rows}",
                      f"spec_shared_forward_seconds_total {counts.seconds:.6f}"]
        for method, t in sorted(worker.totals.items()):
            stats, label = t.stats, f'{{method="{method}"}}'
            lines += [f"spec_requests_total{label} {t.requests}", f"spec_tokens_total{label} {t.tokens}",
                      f"spec_seconds_total{label} {t.seconds:.6f}",
                      f"spec_tokens_per_second{label} {t.tokens / t.seconds if t.seconds else 0:.3f}",
                      f"spec_tokens_per_oracle_forward{label} {stats.tokens_per_oracle_forward:.4f}"]
            if stats.proposed.get("oracle"):
                lines.append(f"spec_draft_acceptance{label} {stats.accepted['oracle'] / stats.proposed['oracle']:.4f}")
        for name, store in sorted(service.prefixes().items()):
            label = f'{{model="{name}"}}'
            lines += [f"spec_prefix_cache_hits_total{label} {store.hits}",
                      f"spec_prefix_cache_misses_total{label} {store.misses}",
                      f"spec_prefix_cache_bytes{label} {store.bytes}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": service.name, "object": "model", "created": service.created, "owned_by": "spec",
                "context_length": service.context}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authorize(request)
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    @guard
    async def completions(request: Request):
        authorize(request)
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: give one string (a list of several prompts is not supported)",
                               "invalid_request", "prompt")
            prompt = prompt[0]
        if body.echo:
            raise ApiError(400, "echo is not supported", "invalid_request", "echo")
        if isinstance(body.logprobs, bool) or not 0 <= (body.logprobs or 0) <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs: the number of likeliest tokens to give with each token, 0 to "
                                f"{MAX_LOGPROBS}", "invalid_request", "logprobs")
        if body.suffix:  # fill in the middle
            fim = need_fim("suffix")
            job = make_job(body, "POST /v1/completions", lambda: infill_ids(service.tokenizer, fim, prompt, body.suffix),
                           body.max_tokens, stop_ids=fim_ids(fim), logprobs=body.logprobs)
        else:
            job = make_job(body, "POST /v1/completions", lambda: service.encode(prompt), body.max_tokens,
                           logprobs=body.logprobs)
        return await respond(request, body, job, "text_completion", "cmpl")

    @app.post("/infill")
    @guard
    async def infill(request: Request):
        """The text between `input_prefix` and `input_suffix`, with `input_extra`'s files as context, answered
        as llama.cpp's server answers (`content`, `stop`; streamed as `data:` events)."""
        authorize(request)
        body = await parse(request, InfillRequest)
        fim = need_fim("input_suffix")
        extra = [(f.filename, f.text) for f in body.input_extra]
        job = make_job(body, "POST /infill", lambda: infill_ids(service.tokenizer, fim, body.input_prefix,
                                                               body.input_suffix, extra, body.prompt),
                       body.n_predict if body.n_predict and body.n_predict > 0 else body.max_tokens, stop_ids=fim_ids(fim))
        return await respond(request, body, job, "infill", "infill")

    def fim_ids(fim: Fim) -> frozenset[int]:
        return frozenset(service.tokenizer.convert_tokens_to_ids(fim.tokens()))

    def need_fim(param: str) -> Fim:
        if service.fim is None:
            raise ApiError(400, f"{service.name} has no fill-in-the-middle tokens: filling in the middle needs a "
                                f"code model that has them (Qwen2.5-Coder, StarCoder2, CodeLlama, DeepSeek-Coder)",
                           "invalid_request", param)
        return service.fim

    @app.post("/v1/chat/completions")
    @guard
    async def chat_completions(request: Request):
        authorize(request)
        body = await parse(request, ChatRequest)
        system, messages = None, []
        for i, m in enumerate(body.messages):
            if m.role in ("system", "developer"):
                if i:
                    raise ApiError(400, f"messages[{i}]: a system message may only come first", "invalid_request",
                                   f"messages.{i}.role")
                system = template_message(m)["content"]
            else:
                messages.append(template_message(m))
        if not messages:
            raise ApiError(400, "messages: there is no user message to answer", "invalid_request", "messages")
        template = service.template
        if body.tool_choice == "required" or isinstance(body.tool_choice, dict):
            raise ApiError(400, STEERED, "invalid_request", "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else []
        reply = chat_reply(tools, template, messages)
        reply.thinking = reply.thinking and body.reasoning_format != "none"

        encode = chat_encoder(reply, template, system, messages, tools, body.chat_template_kwargs)
        if not isinstance(body.logprobs, (bool, type(None))):
            raise ApiError(400, "logprobs: true or false (top_logprobs: how many likeliest tokens)", "invalid_request",
                           "logprobs")
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "invalid_request", "top_logprobs")
        stops = [template.stop] if template.stop else []
        job = make_job(body, "POST /v1/chat/completions", encode, body.max_completion_tokens or body.max_tokens,
                       stops, strip=template.plain, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        return await respond(request, body, job, "chat.completion", "chatcmpl", reply)

    def chat_reply(tools: list[dict], template: Template, messages: list[dict]) -> ChatReply:
        """How a chat reply to a request with these tools is answered; a template that cannot take them (or the
        conversation's tool calls and results) is a 400."""
        if (tools or any(m["role"] == "tool" or "tool_calls" in m for m in messages)) and not takes_tools(
                service.tokenizer, template):
            raise ApiError(400, f"{service.name}'s chat template ({template.label}) does not take tools; give the "
                                "server one that does (--template FILE)", "invalid_request", "tools")
        return ChatReply(frozenset(t["function"]["name"] for t in tools) if tools else None,
                         thinks(service.tokenizer, template))

    def chat_encoder(reply: ChatReply, template: Template, system: str | None, messages: list[dict],
                     tools: list[dict], variables: dict | None = None) -> Callable[[], list[int]]:
        """The conversation's token ids, made when the job starts (noting whether the prompt left the model
        thinking)."""
        def encode() -> list[int]:
            ids = prompt_ids(service.tokenizer, template, system, messages, tools, variables)
            reply.inside = reply.thinking and opened(service.tokenizer.decode(ids[-4:]))
            return ids

        return encode

    @app.post("/v1/messages")
    @guard
    async def messages(request: Request):
        """Anthropic's Messages API (Claude Code, Anthropic's SDKs): the same decoding as the chat route."""
        authorize(request)
        body = await parse(request, messages_api.MessagesRequest)
        template = service.template
        variables = {"enable_thinking": body.thinking.get("type") != "disabled"} if body.thinking else None
        reply, encode = foreign_chat(messages_api, body, variables)
        params = Params.model_validate({"model": body.model, "max_tokens": body.max_tokens,
                                        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k})
        stops = list(body.stop_sequences or []) + ([template.stop] if template.stop else [])
        job = make_job(params, "POST /v1/messages", encode, body.max_tokens, strip=template.plain, many_stops=stops)
        first = await start(request, job)
        if isinstance(first, Response):
            return first
        message = {"id": messages_api.ident(), "type": "message", "role": "assistant", "model": service.name}
        if body.stream:
            return event_stream(message_events(job, reply, message, first.prompt_tokens))
        whole = await whole_reply(request, job, reply)
        if isinstance(whole, Response):
            return whole
        reasoning, text, calls, result = whole
        return JSONResponse({**message, "content": messages_api.blocks(reasoning, text, calls),
                             "stop_reason": messages_api.stop_reason(result.finish, calls),
                             "stop_sequence": result.stop, "usage": message_usage(result), "spec": result.extra()})

    def foreign_chat(module, body, variables: dict | None = None) -> tuple[ChatReply, Callable[[], list[int]]]:
        """How another API's chat request (`module`: its conversation and tools) is answered, and its prompt."""
        try:
            system, chat = module.conversation(body)
            tools = module.tool_entries(body)
        except Unanswerable as e:
            raise ApiError(400, e.args[0], "invalid_request", e.args[1]) from None
        reply = chat_reply(tools, service.template, chat)
        return reply, chat_encoder(reply, service.template, system, chat, tools, variables)

    async def whole_reply(request: Request, job: Job, reply: ChatReply):
        """The rest of a job as a reply's (thinking, text, calls, result), or the response that ends it instead."""
        outcome = await until_disconnected(request, job, collect(job))
        if outcome is None:
            return Response(status_code=499)
        text, _, last = outcome
        if isinstance(last, Failed):
            return answer_error(request, last.status, last.message, last.code)
        return *reply.whole(text), last.result

    def event_stream(source: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(source, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def start(request: Request, job: Job) -> Started | Response:
        """The job submitted and its first message (the prompt encoded and read to fit), or the response that
        ends it there (refused, failed, or the client gone)."""
        try:
            service.worker.submit(job)
        except Refused as e:
            service.log(f"{job.endpoint} {e.status} · {e}")
            headers = {"Retry-After": str(service.worker.retry_after())} if e.status == 429 else None
            return answer_error(request, e.status, str(e), e.code, headers=headers)
        first = await until_disconnected(request, job, job.next())
        if first is None:
            return Response(status_code=499)
        if isinstance(first, Failed):
            return answer_error(request, first.status, first.message, first.code)
        return first

    @app.post("/v1/responses")
    @guard
    async def responses(request: Request):
        """OpenAI's Responses API (Codex CLI, the Agents SDK): the same decoding as the chat route."""
        authorize(request)
        body = await parse(request, responses_api.ResponsesRequest)
        template = service.template
        reply, encode = foreign_chat(responses_api, body)
        params = Params.model_validate({"model": body.model, "temperature": body.temperature, "top_p": body.top_p})
        stops = [template.stop] if template.stop else []
        job = make_job(params, "POST /v1/responses", encode, body.max_output_tokens, stops, strip=template.plain)
        first = await start(request, job)
        if isinstance(first, Response):
            return first
        ident = responses_api.ident("resp")
        if body.stream:
            return event_stream(response_events(job, reply, body, ident))
        whole = await whole_reply(request, job, reply)
        if isinstance(whole, Response):
            return whole
        reasoning, text, calls, result = whole
        return JSONResponse({**finished(ident, body, responses_api.output(reasoning, text, calls), result, calls),
                             "spec": result.extra()})

    def finished(ident: str, body, items: list[dict], result: Result, calls: list) -> dict:
        cut = result.finish_reason == "length" and not calls
        usage = {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
                 "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": result.prompt_tokens + result.completion_tokens}
        return responses_api.response(ident, service.name, body, items, "incomplete" if cut else "completed", usage,
                                      "max_output_tokens" if cut else None)

    async def response_events(job: Job, reply: ChatReply, body, ident: str) -> AsyncIterator[str]:
        """The reply as the Responses API's stream: response.created and .in_progress, its output items' events,
        response.completed (or .incomplete)."""
        pieces, events = reply.pieces(), responses_api.EventStream()
        begun = responses_api.response(ident, service.name, body, [], "in_progress", None)
        try:
            yield events.event("response.created", response=begun)
            yield events.event("response.in_progress", response=begun)
            while True:
                for item in await job.ready():
                    if isinstance(item, Text):
                        reasoning, text = pieces.add(item.delta)
                        for piece in events.piece("reasoning", reasoning) + events.piece("message", text):
                            yield piece
                    elif isinstance(item, Done):
                        reasoning, text, calls = pieces.end()
                        for piece in (events.piece("reasoning", reasoning) + events.piece("message", text)
                                      + events.calls(calls) + events.close()):
                            yield piece
                        if not events.items:  # (an empty reply is an empty message, as whole)
                            events.items.append(responses_api.message_item(responses_api.ident("msg"), ""))
                        done = finished(ident, body, events.items, item.result, calls)
                        yield events.event("response.completed" if done["status"] == "completed"
                                           else "response.incomplete", response=done)
                        return
                    elif isinstance(item, Failed):
                        yield events.event("error", code=item.code, message=item.message, param=None)
                        return
        finally:
            job.cancel()

    def message_usage(result: Result) -> dict:
        return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
                "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}

    async def message_events(job: Job, reply: ChatReply, message: dict, prompt_tokens: int) -> AsyncIterator[str]:
        """The reply as Anthropic's stream: message_start, its content blocks' events, message_delta (the stop
        reason, the usage), message_stop."""
        event = messages_api.event
        pieces, blocks = reply.pieces(), messages_api.BlockStream()

        try:
            yield event("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                      "stop_sequence": None, "usage": {
                                                          "input_tokens": prompt_tokens, "output_tokens": 0}}})
            while True:
                for item in await job.ready():
                    if isinstance(item, Text):
                        reasoning, text = pieces.add(item.delta)
                        for piece in blocks.piece("thinking", reasoning) + blocks.piece("text", text):
                            yield piece
                    elif isinstance(item, Done):
                        result = item.result
                        reasoning, text, called = pieces.end()
                        for piece in (blocks.piece("thinking", reasoning) + blocks.piece("text", text)
                                      + blocks.calls(called) + blocks.close()):
                            yield piece
                        yield event("message_delta", {"delta": {
                            "stop_reason": messages_api.stop_reason(result.finish, called),
                            "stop_sequence": result.stop}, "usage": message_usage(result)})
                        yield event("message_stop", {})
                        return
                    elif isinstance(item, Failed):
                        yield event("error", {"error": messages_api.error_body(item.status, item.message)["error"]})
                        return
        finally:
            job.cancel()

    @app.post("/v1/messages/count_tokens")
    @guard
    async def count_tokens(request: Request):
        authorize(request)
        body = await parse(request, messages_api.CountRequest)
        check_model(body.model)
        _, encode = foreign_chat(messages_api, body)
        try:
            return {"input_tokens": len(encode())}
        except SpecError as e:
            raise ApiError(400, str(e), "invalid_request") from None

    def make_job(body: Params, endpoint: str, encode, max_tokens: int | None, stops: list[str] = (),
                 strip: bool = False, stop_ids: frozenset[int] = frozenset(), logprobs: int | None = None,
                 many_stops: list[str] | None = None) -> Job:
        """The request's job; `many_stops`: stop strings as they are (Anthropic's, any number), else `body.stop`
        (at most 4) and `stops`."""
        check_model(body.model)
        if body.n != 1:
            raise ApiError(400, f"n = {body.n}: this server makes one choice per request (n = 1)",
                           "invalid_request", "n")
        if logprobs is None and body.logprobs not in (None, False):
            raise ApiError(400, "logprobs: this endpoint gives none", "invalid_request", "logprobs")
        given = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(given) > 4:
            raise ApiError(400, "stop: at most 4 stop strings", "invalid_request", "stop")
        try:
            settings = service.defaults(body.temperature).replace(
                max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                logprobs=logprobs)
        except SpecError as e:
            raise ApiError(400, str(e), "invalid_request") from None
        settings = settings.replace(seed=body.seed) if body.seed is not None else _without_seed(settings)
        stops = [s for s in given if s] + list(stops) if many_stops is None else [s for s in many_stops if s]
        return Job(endpoint, encode, settings, stops, strip, stop_ids)

    async def respond(request: Request, body: Params, job: Job, kind: str, prefix: str,
                      reply: ChatReply | None = None) -> Response:
        """The job's answer, whole or streamed; `reply`: how a chat reply's text is answered."""
        first = await start(request, job)
        if isinstance(first, Response):
            return first
        prompt_tokens = first.prompt_tokens
        ident, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        chat = kind == "chat.completion"
        if kind == "infill":
            return await infilled(request, body, job, prompt_tokens)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return event_stream(stream(job, ident, created, chat, include_usage, reply or ChatReply()))
        outcome = await until_disconnected(request, job, collect(job))
        if outcome is None:
            return Response(status_code=499)
        text, scored, last = outcome
        if isinstance(last, Failed):  # after the start
            return failure(last)
        result = last.result
        choice = {"index": 0, "finish_reason": result.finish_reason,
                  "logprobs": None if job.settings.logprobs is None else scores(scored, chat)}
        if chat:
            reasoning, content, calls = (reply or ChatReply()).whole(text)
            choice["message"] = {"role": "assistant", "content": content if content or not calls else None}
            if reasoning is not None:
                choice["message"]["reasoning_content"] = reasoning
            if calls:
                choice["message"]["tool_calls"] = [call.message() for call in calls]
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        return JSONResponse({"id": ident, "object": kind, "created": created, "model": service.name,
                             "choices": [choice], "usage": usage(result, prompt_tokens), "spec": result.extra()})

    token_bytes = TokenBytes(service.tokenizer)

    def scores(tokens: tuple[Token, ...] | list[Token], chat: bool, before: bytearray | None = None) -> dict:
        """Output tokens' log-probabilities in OpenAI's form: chat's `content` entries (each token's text and
        bytes), or the completions format's parallel lists, `text_offset` counting the characters of the text
        before each token (`before`: the bytes of the tokens scored before these, extended here)."""
        def entry(token: int, logprob: float) -> dict:
            raw = token_bytes(token)
            return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

        if chat:
            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(w, lp) for w, lp in t.top]}
                                for t in tokens], "refusal": None}
        before = bytearray() if before is None else before
        texts, starts = [], []
        for t in tokens:
            raw = token_bytes(t.token)
            starts.append(len(before.decode(errors="ignore")))
            texts.append(token_text(raw))
            before += raw
        return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{token_text(token_bytes(w)): lp for w, lp in t.top} for t in tokens],
                "text_offset": starts}

    def filled(text: str, result: Result, prompt_tokens: int) -> dict:
        """The end of an /infill answer, as llama.cpp's server gives it."""
        return {"content": text, "stop": True, "model": service.name, "tokens_predicted": result.completion_tokens,
                "tokens_evaluated": prompt_tokens, "tokens_cached": result.cached_tokens,
                "stop_type": {"eos": "eos", "stop": "word"}.get(result.finish, "limit"),
                "truncated": result.finish == "context", "spec": result.extra()}

    async def infilled(request: Request, body: Params, job: Job, prompt_tokens: int) -> Response:
        if body.stream:
            async def pieces() -> AsyncIterator[str]:
                try:
                    while True:
                        for message in await job.ready():
                            if isinstance(message, Text):
                                yield event({"content": message.delta, "stop": False})
                            elif isinstance(message, Done):
                                yield event(filled("", message.result, prompt_tokens))
                                return
                            elif isinstance(message, Failed):
                                yield event({"error": {"code": message.status, "message": message.message,
                                                       "type": message.code}})
                                return
                finally:
                    job.cancel()

            return event_stream(pieces())
        outcome = await until_disconnected(request, job, collect(job))
        if outcome is None:
            return Response(status_code=499)
        text, _, last = outcome
        if isinstance(last, Failed):
            return failure(last)
        return JSONResponse(filled(text, last.result, prompt_tokens))

    async def stream(job: Job, ident: str, created: int, chat: bool, include_usage: bool,
                     reply: ChatReply) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        pieces = reply.pieces()
        scored = bytearray()  # (the bytes of the tokens scored so far: the completions format's text offsets)

        def chunk(text: str | None, finish: str | None = None, tool_calls: list | None = None,
                  reasoning: str | None = None, logprobs: dict | None = None, **extra) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                if reasoning:
                    delta["reasoning_content"] = reasoning
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return event({"id": ident, "object": kind, "created": created, "model": service.name,
                          "choices": [choice], **extra})

        # a text's event is this one's with its text in place of the mark: one short string encoded, not the event
        head, tail = chunk(MARK).split(json.dumps(MARK))

        def settle(reasoning: str, text: str, called: list = ()) -> Iterator[str]:
            """The chunks of a settled piece of the reply (at the end: the calls too)."""
            if reasoning:
                yield chunk(None, reasoning=reasoning)
            if text:
                yield head + json.dumps(text, ensure_ascii=False) + tail
            for i, call in enumerate(called):
                yield chunk(None, tool_calls=[call.message(i)])

        try:
            if chat:
                yield event({"id": ident, "object": kind, "created": created, "model": service.name,
                             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None, "logprobs": None}]})
            ended = False
            while not ended:
                for message in await job.ready():
                    if isinstance(message, Text):
                        for piece in settle(*pieces.add(message.delta)):
                            yield piece
                        if message.tokens:  # (their scores in a chunk of their own, after their text)
                            yield chunk(None, logprobs=scores(message.tokens, chat, scored))
                    elif isinstance(message, Done):
                        result = message.result
                        reasoning, text, called = pieces.end()
                        for piece in settle(reasoning, text, called):
                            yield piece
                        yield chunk(None, "tool_calls" if called else result.finish_reason, spec=result.extra())
                        if include_usage:
                            yield event({"id": ident, "object": kind, "created": created, "model": service.name,
                                         "choices": [], "usage": usage(result, result.prompt_tokens)})
                        ended = True
                        break
                    elif isinstance(message, Failed):
                        yield event({"error": {"message": message.message, "type": "server_error", "param": None,
                                               "code": message.code}})
                        ended = True
                        break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away (or it is over: then this changes nothing)

    return app


def _without_seed(settings: Decoding) -> Decoding:
    import dataclasses

    return dataclasses.replace(settings, seed=None)  # no seed: each request samples anew


def failure(failed: Failed) -> JSONResponse:
    return error(failed.status, failed.message, failed.code)


MARK = "\x00text\x00"  # (stands in for a chunk's text: no other field of a chunk holds it)


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(result: Result, prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


async def collect(job: Job) -> tuple[str, list[Token], Done | Failed]:
    """The rest of a job's messages: their text, their scored tokens, and the last one (Done, or Failed)."""
    pieces, scored = [], []
    while True:
        message = await job.next()
        if not isinstance(message, Text):
            return "".join(pieces), scored, message
        pieces.append(message.delta)
        scored += message.tokens


async def until_disconnected(request: Request, job: Job, waiting: Awaitable):
    """What `waiting` gives, or None when the client disconnects first (then the job is cancelled)."""
    task = asyncio.ensure_future(waiting)
    gone = asyncio.ensure_future(_disconnect(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    job.cancel()
    return None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
