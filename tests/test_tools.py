"""What `spec serve` makes of a chat reply's text: tool calls (a request's tools written into the prompt by the
model's chat template, the calls a reply holds read back from its text (Hermes's tags, a fenced JSON block, a bare
JSON reply) and answered as OpenAI's `tool_calls`) and a reasoning model's thinking (`reasoning_content`), whole
and streamed, with the real `openai` client; the text itself stays the model's."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from spec_cli.serve.reasoning import ReasoningStream, split_reasoning
from spec_cli.serve.tools import CallStream, read_calls

NAMES = frozenset({"get_weather", "add"})
QWEN3_CODER = ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=units>\n[\"C\"]\n</parameter>\n</function>\n</tool_call>")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
FENCE = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


def names_and_arguments(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
     '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "Let me look.",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    (f"<tool_call>\n{WEATHER}", "", [("get_weather", {"city": "Paris"})]),  # the model's end before the close
    ('<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>', "", [("unknown_tool", {})]),
    (FENCE, "", [("get_weather", {"city": "Paris"})]),  # Qwen2.5-Coder's way
    (f"I will call it:\n{FENCE}\nand wait.", "I will call it:\n\nand wait.", [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('[{"name": "add", "arguments": "{\\"a\\": 1}"}]', "", [("add", {"a": 1})]),  # arguments as JSON text
    (QWEN3_CODER, "I will look.", [("get_weather", {"city": "Paris", "days": 3, "units": ["C"]})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),  # GLM-4.5's
])
def test_calls_are_read_from_each_form_models_write(text, content, calls):
    got_content, got = read_calls(text, NAMES)
    assert got_content == content and names_and_arguments(got) == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
    '<tool_call>\n{"name": "get_weather"}}\n</tool_call>',  # bad JSON
    "<tool_call>\n[1, 2]\n</tool_call>",
    '{"name": "not_a_tool", "arguments": {}}',  # untagged: only the request's tools
    '{"city": "Paris"}',
    '```json\n{"name": "not_a_tool", "arguments": {}}\n```',
    "```python\nprint({'name': 'get_weather'})\n```",
    '{"name": "get_weather", "arguments": [1]}',
    '{"type": "function", "name": "get_weather", "arguments": {}}',  # its first key not the name
    "Paris is sunny today.",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # unclosed
    "<tool_call>\nget the <b>weather</b>\n</tool_call>",
])
def test_a_reply_without_a_readable_call_stays_text_whole(text):
    assert read_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("text", [
    f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>",
    f"I will call it:\n{FENCE}\nand wait.",
    FENCE,
    WEATHER,
    "Some code:\n```python\nx = [1]\n```\nand ```\n{\"a\": 1}\n``` then <b>bold</b> `x` <tool",
    "a \n b\n\n",
    QWEN3_CODER,
    '{"config": {"name": "get_weather"}, "port": 80}',  # JSON, but no call: it streams
    'Here:\n```json\n{"port": 80, "name": "x"}\n```\nDone.',
    '{"type": "function", "name": "get_weather", "arguments": {}}',  # (a call's name not first: text)
    "<tool_call>\n{\"name\": \"get_weather\"}}\n</tool_call> broken",
])
def test_a_streamed_reply_adds_up_to_the_whole_one_however_it_is_cut(text):
    rng = random.Random(0)
    whole_content, whole_calls = read_calls(text, NAMES)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        stream = CallStream(NAMES)
        sent = "".join(stream.add(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)]))
        rest, calls = stream.end()
        assert sent + rest == whole_content
        assert names_and_arguments(calls) == names_and_arguments(whole_calls)
    if whole_calls:  # nothing of a call goes out as text, at any cut
        assert "<tool_call>" not in sent and '"name"' not in sent


def test_text_goes_out_as_it_comes_until_it_may_begin_a_call():
    stream = CallStream(NAMES)
    assert stream.add("Here is a list: ") == "Here is a list:"  # (the space waits for what follows it)
    assert stream.add("`x` and <b>") == " `x` and <b>"
    assert stream.add("\n```js") == ""  # a fence may hold a call until its language shows
    assert stream.add("x\nx = 1\n") == "\n```jsx\nx = 1"
    assert stream.add("```py") == "\n```py"  # (not json: it holds no call)
    assert stream.add("```\n<tool") == "```"
    assert stream.add("_call>\n" + WEATHER) == ""
    assert stream.end()[0] == "" and stream.add("") == ""
    json_reply = CallStream(NAMES)  # JSON that is no call goes out as soon as its first key says so
    assert json_reply.add('{"') == "" and json_reply.add('config": {') == '{"config": {'
    fenced = CallStream(NAMES)
    assert fenced.add("Here:\n```json\n{\n  ") == "Here:" and fenced.add('"port": 80') == '\n```json\n{\n  "port": 80'


# -- through the server --

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# what the model below says after <|assistant|>, a token at a time (its last: the end of text)
SCRIPT = ["Let me check.", "<tool_call>", "\n" + WEATHER + "\n", "</tool_call>"]
TEMPLATE = ("{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
            "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_scripted(root: Path, script: list[str], template: str) -> Path:
    """A one-layer Llama whose next token depends on its last alone (attention's and the MLP's outputs zeroed),
    made to say `script` (each entry a token of its own) after <|assistant|>, then end; `template` its chat
    template; its profile (staged, the model its own draft)."""
    import torch
    from tiny import make_model, make_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer(root / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|{r}|>" for r in
                                                                ("system", "user", "assistant", "tool", "end")]})
    tokenizer.add_tokens(script)
    tokenizer.chat_template = template
    make_model(root / "model", "llama", len(tokenizer), layers=1, width=64, seed=3, tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    chain = tokenizer.convert_tokens_to_ids(["<|assistant|>", *script]) + [tokenizer.eos_token_id]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (token, after) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = 8 * torch.eye(64)[i]
            model.lm_head.weight[after] = 20 * torch.eye(64)[i]
    model.save_pretrained(root / "model")
    path = root / "scripted.toml"
    path.write_text(f'oracle = "{root / "model"}"\ndraft = "{root / "model"}"\ndtype = "float32"\n'
                    '[decoding]\nmethod = "staged"\nmax_new_tokens = 32\n')
    return path


def serving(folder: Path, script: list[str], template: str):
    """A server of the model `make_scripted` makes (in a fixture: yields it, then stops it)."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serve import Running

    server = Running(make_scripted(folder, script, template))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("tool-caller"), SCRIPT, TEMPLATE)


def expected_prompt_tokens(server, messages, tools=None) -> int:
    from spec_cli.chat.templates import Template, prompt_ids

    return len(prompt_ids(server.engine.tokenizer, Template("tokenizer"), None, messages, tools))


def test_a_reply_that_calls_a_tool_is_answered_as_tool_calls(caller):
    response = caller.client.chat.completions.create(model=caller.name, messages=ASK, tools=TOOLS, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    # the tools were in the prompt, as the template writes them
    assert response.usage.prompt_tokens == expected_prompt_tokens(caller, ASK, TOOLS) > expected_prompt_tokens(
        caller, ASK)


def test_a_streamed_tool_call_comes_as_the_openai_client_assembles_it(caller):
    chunks = list(caller.client.chat.completions.create(model=caller.name, messages=ASK, tools=TOOLS,
                                                        temperature=0, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check." and "<tool_call>" not in content
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_same_text_is_plain_content(caller):
    for tools in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        response = caller.client.chat.completions.create(model=caller.name, messages=ASK, temperature=0, **tools)
        assert response.choices[0].finish_reason == "stop" and not response.choices[0].message.tool_calls
        assert response.choices[0].message.content == "".join(SCRIPT)
        assert response.usage.prompt_tokens == expected_prompt_tokens(caller, ASK)  # "none": no tools written


def test_a_conversation_with_calls_and_tool_results_is_rendered_by_the_template(caller):
    first = caller.client.chat.completions.create(model=caller.name, messages=ASK, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    again = caller.client.chat.completions.create(model=caller.name, messages=messages, tools=TOOLS, temperature=0)
    template_messages = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": call.id}]
    assert again.usage.prompt_tokens == expected_prompt_tokens(caller, template_messages, TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"


def test_what_cannot_be_done_with_tools_is_a_json_error(caller, running_plain):
    import openai

    with pytest.raises(openai.BadRequestError, match="tool_choice: only 'auto' and 'none'"):
        caller.client.chat.completions.create(model=caller.name, messages=ASK, tools=TOOLS, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="does not take tools"):
        running_plain.client.chat.completions.create(model=running_plain.name, messages=ASK, tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="tools.0.type"):
        caller.client.chat.completions.create(model=caller.name, messages=ASK, tools=[{"type": "web", "x": 1}])
    assert caller.client.chat.completions.create(model=caller.name, messages=ASK, tools=TOOLS).choices


@pytest.fixture(scope="module")
def running_plain(tmp_path_factory):
    """A server whose model's template writes no tools (the plain transcript)."""
    from test_serve import Running
    from tiny import make_served_pair

    server = Running(make_served_pair(tmp_path_factory.mktemp("plain"), "plain", context=256, max_new_tokens=8))
    yield server
    server.stop()


@pytest.mark.slow
def test_the_real_coder_calls_a_tool_through_the_openai_client(tmp_path):
    """Qwen2.5-Coder-1.5B-Instruct's file with its 0.5B as the draft (../shared/tools/fetch-models), asked the
    weather with a weather tool: its call (it writes it in a fenced JSON block) answered as tool_calls, whole and
    streamed alike."""
    cache = Path.home() / ".cache" / "spec-models"
    oracle = os.environ.get("QWEN_1_5B") or str(cache / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    draft = os.environ.get("QWEN_0_5B") or str(cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    if not (Path(oracle).is_file() and Path(draft).is_file()):
        pytest.skip("the Qwen pair is not fetched (../shared/tools/fetch-models)")
    from test_serve import Running

    profile = tmp_path / "coder.toml"
    profile.write_text(f'oracle = "{oracle}"\ndraft = "{draft}"\n[decoding]\nmax_new_tokens = 64\n')
    server = Running(profile, dtype=None)
    try:
        messages = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
        whole = server.client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS,
                                                      temperature=0)
        [call] = whole.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        chunks = list(server.client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS,
                                                            temperature=0, stream=True))
        streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("get_weather", call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    finally:
        server.stop()


# -- a reasoning model's thinking --

THINKING = ["<think>", "Let me think.", "</think>", "The answer is 4."]
THINKING_TEMPLATE = (  # (as Qwen3's and DeepSeek-R1's: a template that knows </think> drops earlier thinking)
    "{% for m in messages %}<|{{ m.role }}|>{{ (m.content or '').split('</think>')[-1] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if open_think %}<think>{% endif %}{% endif %}")


@pytest.mark.parametrize("text, inside, reasoning, content", [
    ("<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", False, "Hmm, 2+2.", "It is 4."),
    ("Hmm, 2+2.\n</think>\n\nIt is 4.", True, "Hmm, 2+2.", "It is 4."),  # the prompt opened the block
    ("<think>cut short while thinking", False, "cut short while thinking", ""),
    ("It is 4. <think> is a tag", False, None, "It is 4. <think> is a tag"),
    ("Hmm.</think>", False, None, "Hmm.</think>"),
])
def test_thinking_is_split_from_the_reply(text, inside, reasoning, content):
    assert split_reasoning(text, inside) == (reasoning, content)
    for seed in range(100):  # streamed however it is cut: the same
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), 5))
        stream, got = ReasoningStream(inside), ["", ""]
        for a, b in [*zip([0, *cuts], [*cuts, len(text)]), (len(text), len(text))]:
            pieces = stream.add(text[a:b], final=a == b)
            got = [got[0] + pieces[0], got[1] + pieces[1]]
        assert got == [reasoning or "", content]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("thinker"), THINKING, THINKING_TEMPLATE)


@pytest.mark.parametrize("variables", [None, {"open_think": True}], ids=["tagged", "opened-by-the-prompt"])
def test_a_reasoning_models_thinking_is_answered_apart(thinker, variables):
    extra = {"extra_body": {"chat_template_kwargs": variables}} if variables else {}
    response = thinker.client.chat.completions.create(model=thinker.name, messages=ASK, temperature=0, **extra)
    message = response.choices[0].message
    assert message.content == "The answer is 4." and message.model_extra["reasoning_content"] == "Let me think."
    assert response.choices[0].finish_reason == "stop"
    chunks = list(thinker.client.chat.completions.create(model=thinker.name, messages=ASK, temperature=0,
                                                         stream=True, **extra))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Let me think."
    # the template's variables reach it: the prompt ends inside the block
    opened = response.usage.prompt_tokens - thinker.client.chat.completions.create(
        model=thinker.name, messages=ASK, temperature=0).usage.prompt_tokens
    assert opened == (1 if variables else 0)


def test_reasoning_format_none_leaves_the_thinking_in_the_text(thinker):
    response = thinker.client.chat.completions.create(model=thinker.name, messages=ASK, temperature=0,
                                                      extra_body={"reasoning_format": "none"})
    assert response.choices[0].message.content == "".join(THINKING)
    assert "reasoning_content" not in (response.choices[0].message.model_extra or {})


def test_a_model_that_does_not_think_keeps_its_text_whole(caller):
    response = caller.client.chat.completions.create(model=caller.name, messages=ASK, temperature=0)
    assert "reasoning_content" not in (response.choices[0].message.model_extra or {})


def test_template_variables_that_break_the_template_are_a_json_error(thinker):
    import openai

    with pytest.raises(openai.BadRequestError, match="chat template"):
        thinker.client.chat.completions.create(model=thinker.name, messages=ASK,
                                               extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert thinker.client.chat.completions.create(model=thinker.name, messages=ASK).choices


# -- Anthropic's Messages API --

def anthropic_client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city now",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def test_messages_api_answers_a_tool_call_whole_and_streamed(caller):
    client = anthropic_client(caller)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.messages.create(model=caller.name, max_tokens=32, messages=ask, tools=ANTHROPIC_TOOLS,)
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["text", "tool_use"]
    text, use = reply.content
    assert text.text == "Let me check." and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == expected_prompt_tokens(caller, ASK, TOOLS)
    with client.messages.stream(model=caller.name, max_tokens=32, messages=ask, tools=ANTHROPIC_TOOLS,) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in reply.content]
    assert streamed.stop_reason == "tool_use"
    # the tool's result, back: rendered as the chat route renders a tool message
    again = client.messages.create(model=caller.name, max_tokens=32, tools=ANTHROPIC_TOOLS, messages=[
        *ask, {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                {"type": "tool_use", "id": use.id, "name": use.name,
                                                 "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"sky": "sunny"}'}]}])
    chat = [ASK[0], {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": use.id, "content": '{"sky": "sunny"}'}]
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == expected_prompt_tokens(caller, chat,
                                                                                                    TOOLS)
    count = client.messages.count_tokens(model=caller.name, messages=ask, tools=ANTHROPIC_TOOLS)
    assert count.input_tokens == expected_prompt_tokens(caller, ASK, TOOLS)


def test_messages_api_answers_thinking_as_a_thinking_block(thinker):
    client = anthropic_client(thinker)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.messages.create(model=thinker.name, max_tokens=32, messages=ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", "Let me think."), ("text", "The answer is 4.")]
    assert reply.stop_reason == "end_turn"
    with client.messages.stream(model=thinker.name, max_tokens=32, messages=ask) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == "Let me think." and streamed.content[1].text == "The answer is 4."
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    cut = client.messages.create(model=thinker.name, max_tokens=2, messages=ask)
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["thinking"]


def test_messages_api_gives_the_chat_routes_text_and_its_errors_in_anthropics_form(running_plain):
    import anthropic

    client = anthropic_client(running_plain)
    ask = [{"role": "user", "content": "hello there"}]
    reply = client.messages.create(model=running_plain.name, max_tokens=8, messages=ask, system="Be brief.")
    chat = running_plain.client.chat.completions.create(
        model=running_plain.name, max_tokens=8,
        messages=[{"role": "system", "content": "Be brief."}, *ask])
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=ask)
    with pytest.raises(anthropic.BadRequestError, match="does not take tools"):
        client.messages.create(model=running_plain.name, max_tokens=8, messages=ask, tools=ANTHROPIC_TOOLS)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(model=running_plain.name, max_tokens=8, messages=ask, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "any"})
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": "AAAA"}}]}]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=running_plain.name, max_tokens=8, messages=image)
    import httpx

    turns = [*ask, {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Again."}]  # (a system turn among the others, as Claude Code sends)
    assert client.messages.create(model=running_plain.name, max_tokens=4, messages=turns).content
    assert httpx.head(running_plain.url + "/").status_code == 200  # (a client's check that a server is there)
    missing = httpx.post(running_plain.url + "/v1/messages", json={"model": running_plain.name, "messages": ask})
    assert missing.status_code == 400 and missing.json()["type"] == "error"
    assert missing.json()["error"] == {"type": "invalid_request_error",
                                       "message": "missing required parameter 'max_tokens'"}


# -- OpenAI's Responses API --

RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def test_responses_api_answers_a_function_call_whole_and_streamed(caller):
    client = caller.client
    whole = client.responses.create(model=caller.name, input="What is the weather in Paris?", tools=RESPONSES_TOOLS)
    assert whole.status == "completed" and [o.type for o in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Let me check."
    call = whole.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert whole.usage.input_tokens == expected_prompt_tokens(caller, ASK, TOOLS)
    with client.responses.stream(model=caller.name, input="What is the weather in Paris?",
                                 tools=RESPONSES_TOOLS) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in streamed.output] == [
        (o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in whole.output]
    assert streamed.output_text == whole.output_text and kinds[-1] == "response.completed"
    numbers = []  # every event numbered in order
    for event in client.responses.create(model=caller.name, input="What is the weather in Paris?",
                                         tools=RESPONSES_TOOLS, stream=True):
        numbers.append(event.sequence_number)
    assert numbers == list(range(len(numbers)))
    again = client.responses.create(model=caller.name, tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    chat = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}]
    assert again.usage.input_tokens == expected_prompt_tokens(caller, chat, TOOLS)


def test_responses_api_answers_thinking_as_a_reasoning_item(thinker):
    whole = thinker.client.responses.create(model=thinker.name, input="What is the weather in Paris?")
    assert [o.type for o in whole.output] == ["reasoning", "message"] and whole.output_text == "The answer is 4."
    assert whole.output[0].content[0].text == "Let me think."
    with thinker.client.responses.stream(model=thinker.name, input="What is the weather in Paris?") as stream:
        streamed = stream.get_final_response()
    assert streamed.output[0].content[0].text == "Let me think." and streamed.output_text == "The answer is 4."
    cut = thinker.client.responses.create(model=thinker.name, input="Hi", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_api_gives_the_chat_routes_text_and_refuses_what_it_cannot_do(running_plain):
    import openai

    client = running_plain.client
    whole = client.responses.create(model=running_plain.name, instructions="Be brief.", input="hello there",
                                    max_output_tokens=8)
    chat = client.chat.completions.create(model=running_plain.name, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])
    assert whole.output_text == chat.choices[0].message.content
    for options, words in (({"previous_response_id": "resp_1"}, "keeps no responses"),
                           ({"tools": RESPONSES_TOOLS}, "does not take tools"),
                           ({"tools": RESPONSES_TOOLS, "tool_choice": "required"}, "tool_choice"),
                           ({"tools": [{"type": "web_search"}]}, "tools.0")):
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(model=running_plain.name, input="hi", **options)
