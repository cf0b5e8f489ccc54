"""`spec serve` driven as its users drive it: the real `openai` client (and httpx for what a client would
never send) against a real uvicorn server on a free 127.0.0.1 port. Greedy output equals `spec generate`'s
and `spec chat`'s, streamed text equals unstreamed text, concurrent clients get what they would alone, a
client that leaves frees the models, every mistake is a JSON error, and SIGTERM ends cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402
from helpers import ENV, os_threads, settled, spec  # noqa: E402
from tiny import make_permuted_copy, make_served_pair, make_tokenizer  # noqa: E402

from spec_cli import serve as server_module  # noqa: E402
from spec_cli.chat.templates import choose_template  # noqa: E402
from spec_cli.core.errors import OutOfMemory  # noqa: E402
from spec_cli.detok import TextStream  # noqa: E402
from spec_cli.engine import Engine  # noqa: E402
from spec_cli.models import profiles as profile_store  # noqa: E402
from spec_cli.serve import worker as worker_module  # noqa: E402

PROMPTS = ["def fib(n):", "import os\n", "for i in range(10):", "class Stack:", "The quick brown fox",
           "def add(a, b):", "print(", "Hello world"]


@pytest.fixture(autouse=True)
def no_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data-home"))  # no `spec tune` results of the user's


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A tiny GPT-2 pair with a long context (so a generation can outlast a client), staged decoding."""
    return make_served_pair(tmp_path_factory.mktemp("serve-models"), "tiny", context=2048, max_new_tokens=24)


class Running:
    """A real server in a thread of this process, on a free loopback port."""

    def __init__(self, profile_path, api_key=None, overrides=None, dtype="float32", prefix_cache=0, parallel=1,
                 name=None):
        profile = profile_store.load(str(profile_path))
        self.name = name or profile.name
        self.engine = Engine(profile, dtype=dtype, need_draft=True, prefix_cache=prefix_cache)
        self.lines: list[str] = []
        template = choose_template(profile, self.engine.tokenizer)
        app, self.worker = server_module.build(self.engine, {False: profile, True: profile}, overrides or {},
                                               draft2=None,
                                               template=template, api_key=api_key, max_queue=32,
                                               log=self.lines.append, parallel=parallel, name=name)
        sock = server_module.listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = server_module.make_server(app, self.worker)
        self.thread = threading.Thread(target=server_module.serve, args=(self.server, self.worker, sock), daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0,
                                    timeout=60)

    def stop(self):
        self.server.handle_exit(signal.SIGTERM, None)  # what a signal does
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def running(profile_path):
    """Staged's trees of a fixed shape: the tests compare texts across requests, and in float32 a row's bits follow
    the rows beside it, so trees shaped by measured timings can round a near tie otherwise from one request to the
    next (a fresh clone's CI saw it once). The servers below without overrides shape theirs as they run."""
    server = Running(profile_path, overrides={"tree_adaptive": False})
    yield server
    server.stop()


def complete_text(running, prompt, **options) -> str:
    response = running.client.completions.create(model=running.name, prompt=prompt, temperature=0, **options)
    return response.choices[0].text


def stream_text(running, prompt, **options) -> tuple[str, list]:
    chunks = list(running.client.completions.create(model=running.name, prompt=prompt, temperature=0, stream=True,
                                                    **options))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_completion_equals_spec_generate_of_the_oracle_alone(running, profile_path):
    response = running.client.completions.create(model=running.name, prompt="def fib(n):", max_tokens=24,
                                                 temperature=0)
    alone = spec("generate", "-p", str(profile_path), "def fib(n):", "-n", "24", "--method", "baseline", "--json")
    assert alone.returncode == 0, alone.stderr
    assert response.choices[0].text == json.loads(alone.stdout)["completion"] and response.choices[0].text.strip()
    assert response.object == "text_completion" and response.model == running.name
    extra = response.model_extra["spec"]
    assert extra["method"] == "staged" and extra["tokens_per_forward"] >= 1 and extra["oracle_forwards"] >= 1
    assert 0 <= extra["acceptance"] <= 1
    usage = response.usage
    assert usage.completion_tokens == 24 and usage.prompt_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert response.choices[0].finish_reason == "length"


def test_models_and_health(running):
    assert [m.id for m in running.client.models.list().data] == [running.name]
    assert running.client.models.retrieve(running.name).id == running.name
    health = httpx.get(running.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == running.name


def test_stream_equals_unstreamed_with_and_without_stop_strings(running):
    for prompt in PROMPTS[:4]:
        whole = complete_text(running, prompt, max_tokens=32)
        streamed, chunks = stream_text(running, prompt, max_tokens=32)
        assert streamed == whole and len([c for c in chunks if c.choices and c.choices[0].text]) > 3
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["spec"]["method"]
        stop = whole[len(whole) // 2:][:3]  # a stop string from the middle of the text cuts it at its first place
        if not stop.strip():
            continue
        cut = whole[: whole.find(stop)]
        assert complete_text(running, prompt, max_tokens=32, stop=[stop, "never seen"]) == cut
        streamed, chunks = stream_text(running, prompt, max_tokens=32, stop=stop)
        assert streamed == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_split_characters_and_stop_prefixes(running):
    tokenizer = running.engine.tokenizer
    text = "héllo wörld 🙂 ok: ünïcode"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text.encode()) // 2  # the tiny tokenizer splits these characters over tokens
    for stops, strip, expected in (([], False, text), (["🙂 o"], False, "héllo wörld "), (["ö"], False, "héllo w"),
                                   ([], True, text), (["ok:"], True, "héllo wörld 🙂")):
        stream = TextStream(tokenizer, [0], stops, strip)
        out = ""
        for token in ids:
            out += stream.add(token)
            assert "\ufffd" not in out and expected.startswith(out)  # only final text ever goes out
            assert not any(s in out for s in stops)
        out += stream.finish()
        assert out == stream.text == expected, (stops, out)
    stream = TextStream(tokenizer, [0], ["zz"], strip=True)  # leading and trailing whitespace: never out
    out = "".join(stream.add(t) for t in tokenizer("  \n hi there \n ")["input_ids"]) + stream.finish()
    assert out == "hi there"


def test_a_jobs_ready_messages_join_adjacent_texts_in_order_and_wait_for_the_first():
    W = worker_module

    async def main():
        job = W.Job("/v1/completions", lambda: [1], None, [])
        waiting = asyncio.ensure_future(job.ready())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing posted yet
        for message in (W.Started(3), W.Text("a"), W.Text("b"), W.Text("é"), W.Failed(500, "x", "y"), W.Text("c")):
            threading.Thread(target=job.post, args=(message,)).start()
            await asyncio.sleep(0.01)
        first = await waiting  # (it took the Started alone: nothing else had come)
        rest = await job.ready()
        return first, rest

    first, rest = asyncio.run(main())
    assert first == [W.Started(3)]
    assert rest == [W.Text("abé"), W.Failed(500, "x", "y"), W.Text("c")]


def test_chat_streamed_and_not_equals_spec_chat(running, profile_path):
    piped = spec("chat", "-p", str(profile_path), "-n", "24", stdin="hello there\n")
    assert piped.returncode == 0, piped.stderr
    messages = [{"role": "user", "content": "hello there"}]
    response = running.client.chat.completions.create(model=running.name, messages=messages, max_tokens=24,
                                                      temperature=0)
    reply, shown = response.choices[0].message.content, piped.stdout.strip()
    # a reply cut inside a multi-byte character: spec chat shows whole characters only, the API gives what
    # decoding every token gives (U+FFFD for the unfinished bytes)
    assert reply == shown or reply.startswith(shown) and set(reply[len(shown):]) == {"\ufffd"}, (reply, shown)
    assert shown and response.choices[0].message.role == "assistant"
    assert response.object == "chat.completion" and response.model_extra["spec"]["method"] == "staged"
    chunks = list(running.client.chat.completions.create(model=running.name, messages=messages, max_tokens=24,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert chunks[-2].choices[0].finish_reason == response.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_the_llm_cli_gets_what_the_openai_client_gets(running, tmp_path, route, stream):
    """Simon Willison's `llm` CLI with spec serve as an extra OpenAI model (its documented setup), through
    the chat route and the completions route, streamed and not."""
    program = shutil.which("llm")
    if program is None:
        pytest.skip("the llm CLI is not installed (pip install llm)")
    home = tmp_path / "llm-home"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: spec-test\n  model_name: {running.name}\n  api_base: {running.url}/v1\n"
        + ("  completion: true\n" if route == "completion" else ""))
    prompt = "def fib(n):"
    done = subprocess.run([program, "-m", "spec-test", "-o", "temperature", "0", "-o", "max_tokens", "24", "--no-log",
                           *([] if stream else ["--no-stream"]), prompt],
                          env={**os.environ, "LLM_USER_PATH": str(home)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if route == "chat":
        messages = [{"role": "user", "content": prompt}]
        expected = running.client.chat.completions.create(model=running.name, messages=messages, max_tokens=24,
                                                          temperature=0).choices[0].message.content
    else:
        expected = complete_text(running, prompt, max_tokens=24)
    assert expected.strip() and done.stdout.rstrip("\n") == expected.rstrip("\n")


def test_next_chat_turn_reuses_the_cache_and_gives_the_same_reply(running):
    client = running.client
    first = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    reply = client.chat.completions.create(model=running.name, messages=first, temperature=0, max_tokens=16)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "import os"}]
    warm = client.chat.completions.create(model=running.name, messages=second, temperature=0, max_tokens=16)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached > 10 and cached < warm.usage.prompt_tokens
    client.completions.create(model=running.name, prompt="The quick brown fox", max_tokens=4)  # another prefix
    cold = client.chat.completions.create(model=running.name, messages=second, temperature=0, max_tokens=16)
    assert cold.usage.prompt_tokens_details.cached_tokens < 3
    assert cold.choices[0].message.content == warm.choices[0].message.content


def test_eight_concurrent_streaming_clients_get_what_they_get_alone(running):
    alone = {prompt: complete_text(running, prompt, max_tokens=20) for prompt in PROMPTS}
    results, failures = {}, []

    def client(prompt):
        try:
            results[prompt] = stream_text(running, prompt, max_tokens=20)[0]
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(repr(e))

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and results == alone


def test_slots_decode_concurrent_clients_together_each_as_alone(profile_path):
    """--parallel 4 in bfloat16: eight streamed clients (greedy and seeded sampling), four decoding at once with
    their forwards shared, each the text it gets alone; a client that hangs up frees its slot; /health and
    /metrics show the slots and the shared forwards."""
    server = Running(profile_path, dtype="bfloat16", parallel=4, overrides={"tree_adaptive": False})
    try:
        options = [dict(max_tokens=20 + 3 * k, **({"temperature": 0.8, "seed": k} if k % 2 else {}))
                   for k in range(len(PROMPTS))]

        def text(k):
            o = dict(options[k])
            body = {"model": server.name, "prompt": PROMPTS[k], "stream": True, "temperature": 0, **o}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            return "".join(c["choices"][0]["text"] for c in map(lambda line: json.loads(line[6:]), lines)
                           if c["choices"])

        alone = [text(k) for k in range(len(PROMPTS))]
        before = httpx.get(server.url + "/metrics").text
        results, failures = [None] * len(PROMPTS), []

        def client(k):
            try:
                results[k] = text(k)
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append(repr(e))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not failures and results == alone
        metrics = dict(line.split() for line in httpx.get(server.url + "/metrics").text.splitlines())
        earlier = dict(line.split() for line in before.splitlines())
        forwards = float(metrics["spec_shared_forwards_total"]) - float(earlier["spec_shared_forwards_total"])
        sequences = (float(metrics["spec_shared_forward_sequences_total"])
                     - float(earlier["spec_shared_forward_sequences_total"]))
        assert metrics["spec_slots"] == "4" and sequences > 1.5 * forwards  # forwards were shared
        assert httpx.get(server.url + "/health").json()["slots"] == 4
        body = {"model": server.name, "prompt": "def fib(n):", "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
            assert sum(1 for _, line in zip(range(4), response.iter_lines()) if line.startswith("data: "))
        deadline = time.time() + 10
        while server.worker.decoding and time.time() < deadline:
            time.sleep(0.02)
        assert server.worker.decoding == 0 and server.worker.finished[-1][1].finish == "disconnected"
    finally:
        server.stop()


def test_a_draft_of_another_vocabulary_serves_concurrent_clients_each_as_alone(profile_path, tmp_path):
    """The draft under shuffled ids (another vocabulary to spec), four slots: eight clients at once get what each
    gets alone, and the response names the method that ran (speculative: staged needs one vocabulary)."""
    make_permuted_copy(profile_path.parent / "draft", tmp_path / "shuffled", seed=3)
    foreign = tmp_path / "foreign.toml"
    foreign.write_text(profile_path.read_text().replace(str(profile_path.parent / "draft"), str(tmp_path / "shuffled")))
    server = Running(foreign, parallel=4)
    try:
        def text(k):
            response = server.client.completions.create(model=server.name, prompt=PROMPTS[k], max_tokens=16 + k,
                                                        temperature=0)
            return response.choices[0].text

        alone = [text(k) for k in range(len(PROMPTS))]
        results = [None] * len(PROMPTS)
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, text(k))) for k in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == alone
        body = {"model": server.name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["spec"]["method"] == "speculative"
    finally:
        server.stop()


def test_sampling_with_a_seed_is_reproducible(profile_path):
    """Where the speculation's shape does not follow measured timings (a fixed tree; staged's adaptive shapes
    do, so there a seed fixes the distribution, not the sample)."""
    fixed = Running(profile_path, overrides={"tree_adaptive": False})
    try:
        a, b, c = (complete_text(fixed, "def fib(n):", max_tokens=16, seed=s) for s in (None, None, None))
        seeded = [fixed.client.completions.create(model=fixed.name, prompt="def", max_tokens=16, temperature=1,
                                                  top_p=0.95, seed=7).choices[0].text for _ in range(2)]
        assert seeded[0] == seeded[1] and a == b == c
    finally:
        fixed.stop()


def test_a_client_that_disconnects_mid_stream_frees_the_models(running):
    body = {"model": running.name, "prompt": "def fib(n):", "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", running.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: "))  # a few chunks, then away
    start = time.perf_counter()
    assert complete_text(running, "import os\n", max_tokens=4)
    waited = time.perf_counter() - start
    job, result = running.worker.finished[-2]  # the one before the last
    assert result.finish == "disconnected" and result.completion_tokens < 2000, result
    assert waited < 5
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting and hangs up
        httpx.post(running.url + "/v1/completions", json={**body, "stream": False}, timeout=0.1)  # staged on a loop
        # is fast: 2000 tokens of it can take under half a second
    assert complete_text(running, "import os\n", max_tokens=4)
    job, result = running.worker.finished[-2]
    assert result.finish == "disconnected" and result.completion_tokens < 2000, result


def test_a_server_serves_its_model_under_the_name_it_is_given(profile_path):
    server = Running(profile_path, name="coder")
    try:
        assert [m.id for m in server.client.models.list().data] == ["coder"]
        assert server.client.completions.create(model="coder", prompt="def f(x):", max_tokens=3).choices[0].text
        with pytest.raises(openai.NotFoundError, match="serves 'coder'"):
            server.client.completions.create(model=profile_store.load(str(profile_path)).name, prompt="x")
        oracle = Path(profile_store.load(str(profile_path)).oracle.model).name  # (its own name: an editor's setting)
        answer = server.client.completions.create(model=oracle.upper(), prompt="def f(x):", max_tokens=3)
        assert answer.model == "coder" and answer.choices[0].text
    finally:
        server.stop()


def test_a_request_may_name_the_oracle_as_its_file_folder_or_hub_id_says():
    from spec_cli.serve.api import model_aliases

    gguf = model_aliases("/home/me/.cache/spec-models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf")
    assert gguf == {"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b-instruct-q4_k_m"}
    assert model_aliases("Qwen/Qwen2.5-Coder-1.5B") == {"qwen/qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b"}
    assert model_aliases("/models/pyfam/oracle") == {"oracle"}


def test_bad_input_is_a_json_error_and_the_server_keeps_serving(running):
    url = running.url
    cases = [
        ("/v1/completions", b'{"prompt": "x", ', 400, "malformed JSON"),
        ("/v1/completions", b"", 400, "malformed JSON"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": 42}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n = 2"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
        ("/v1/completions", {"max_tokens": 3}, 400, "missing required parameter 'prompt'"),
        ("/v1/completions", {"prompt": "hi " * 2100}, 400, "context window"),
        ("/v1/completions", {"prompt": "hi " * 2100, "stream": True}, 400, "context window"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs: the number"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400,
         "logprobs: true or false"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
         "top_logprobs needs logprobs"),
        ("/v1/nowhere", {}, 404, "Not Found"),
    ]
    for path, body, status, words in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"] and error["type"], (words, error)
    too_long = httpx.post(url + "/v1/completions", json={"prompt": "hi " * 2100}).json()["error"]
    assert too_long["code"] == "context_length_exceeded" and "the model's context window" in too_long["message"]
    with pytest.raises(openai.NotFoundError):
        running.client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError):
        running.client.completions.create(model=running.name, prompt="x", n=3)
    assert complete_text(running, "def fib(n):", max_tokens=4)


def test_a_crash_in_generation_is_500_and_out_of_memory_503(running, monkeypatch, capfd):
    for raised, status, words in ((RuntimeError("a bug"), 500, "RuntimeError: a bug"),
                                  (OutOfMemory("out of cuda memory running the gpt2 model"), 503, "out of cuda memory")):
        def failing(*args, **kwargs):
            raise raised

        monkeypatch.setattr(worker_module, "complete", failing)
        response = httpx.post(running.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert response.status_code == status and words in response.json()["error"]["message"]
        chunks = httpx.post(running.url + "/v1/completions", json={"prompt": "x", "stream": True}).text
        assert words in chunks and chunks.rstrip().endswith("data: [DONE]")  # the stream had started: an error event
    assert "Traceback" not in capfd.readouterr().err
    monkeypatch.setattr(running.worker, "debug", True)  # spec --debug serve: the traceback on stderr
    assert httpx.post(running.url + "/v1/completions", json={"prompt": "x"}).status_code == 503
    assert "Traceback" not in capfd.readouterr().err  # out of memory is its one line, even then
    monkeypatch.setattr(worker_module, "complete", lambda *args, **kwargs: 1 / 0)
    assert httpx.post(running.url + "/v1/completions", json={"prompt": "x"}).status_code == 500
    assert "Traceback" in capfd.readouterr().err
    monkeypatch.undo()
    assert complete_text(running, "def fib(n):", max_tokens=4)
    assert any(" 500 · RuntimeError: a bug" in line for line in running.lines)


def test_a_full_queue_is_429_with_retry_after(running, monkeypatch):
    release, entered = threading.Event(), threading.Event()
    real = worker_module.complete

    def blocked(*args, **kwargs):
        entered.set()
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "complete", blocked)
    monkeypatch.setattr(running.worker.jobs, "maxsize", 1)
    outcome = []
    body = {"model": running.name, "prompt": "def", "max_tokens": 4}
    threads = [threading.Thread(target=lambda: outcome.append(httpx.post(running.url + "/v1/completions", json=body,
                                                                         timeout=30).status_code))]
    threads[0].start()
    assert entered.wait(10)  # the first is decoding
    threads.append(threading.Thread(target=lambda: outcome.append(
        httpx.post(running.url + "/v1/completions", json=body, timeout=30).status_code)))
    threads[1].start()
    deadline = time.time() + 10
    while running.worker.jobs.qsize() < 1 and time.time() < deadline:  # the second waits
        time.sleep(0.01)
    refused = httpx.post(running.url + "/v1/completions", json=body)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert outcome == [200, 200]


def test_request_log_lines(running):
    complete_text(running, "def fib(n):", max_tokens=8)
    line = running.lines[-1]
    assert re.match(r"POST /v1/completions 200 · \d+ prompt tokens \(\d+ cached\) · 8 tokens in [\d.]+ s · "
                    r"[\d.]+ tok/s · [\d.]+ tokens/forward · length$", line), line


def test_api_key(profile_path):
    server = Running(profile_path, api_key="sekrit")
    try:
        assert server.client.completions.create(model=server.name, prompt="def", max_tokens=2).choices
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0)
            if not key:
                response = httpx.post(server.url + "/v1/completions", json={"prompt": "def"})
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
                continue
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=server.name, prompt="def", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.get(server.url + "/health").status_code == 200  # for load balancers: no key
    finally:
        server.stop()


def test_loopback_and_usage_errors(profile_path):
    assert server_module.is_loopback("127.0.0.1") and server_module.is_loopback("::1")
    assert server_module.is_loopback("localhost") and not server_module.is_loopback("0.0.0.0")
    for args, words in ((["--port", "70000"], "--port must be between 0 and 65535"),
                        (["--queue", "0"], "--queue must be at least 1"),
                        (["--temperature", "-1"], "temperature must be >= 0"),
                        (["--template", "nope.jinja"], "--template must be 'plain'")):
        result = spec("serve", "-p", str(profile_path), *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    busy = server_module.listen("127.0.0.1", 0)
    try:
        result = spec("serve", "-p", str(profile_path), "--port", str(busy.getsockname()[1]))
        assert result.returncode == 2 and result.stderr.startswith("error: cannot listen on 127.0.0.1:")
    finally:
        busy.close()


def test_while_the_models_load_every_request_is_answered_503_with_retry_after_and_the_socket_then_serves():
    sock = server_module.listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with server_module.answering_loading(sock):
            for answer in (httpx.get(f"{url}/health", timeout=5),
                           httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x" * 200_000},
                                      timeout=5),
                           httpx.head(f"{url}/v1/models", timeout=5)):
                assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
                if answer.request.method != "HEAD":
                    assert answer.json()["error"]["code"] == "loading"
        client = socket.create_connection(sock.getsockname()[:2], timeout=5)  # (now the server's to accept)
        with client:
            import select

            assert select.select([sock], [], [], 5)[0]
            accepted, _ = sock.accept()
            with accepted:
                client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert accepted.recv(100).startswith(b"GET /health")
    finally:
        sock.close()


def test_spec_serve_answers_503_while_it_loads_then_200(profile_path):
    probe = server_module.listen("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    process = subprocess.Popen([sys.executable, "-m", "spec_cli", "serve", "-p", str(profile_path), "--port",
                                str(port)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               env={**os.environ, **ENV})
    try:
        statuses, deadline = [], time.monotonic() + 300
        while time.monotonic() < deadline and statuses[-1:] != [200]:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
            except httpx.ConnectError:  # (not listening yet: Python and torch still importing)
                time.sleep(0.05)
                continue
            statuses.append(answer.status_code)
            if answer.status_code == 503:
                assert answer.json()["error"]["code"] == "loading"
                time.sleep(0.05)
        assert statuses[-1] == 200 and 503 in statuses and set(statuses) == {503, 200}, statuses
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_sigterm_ends_in_flight_requests_cleanly_and_exits_0(profile_path):
    """One slot (--parallel 1), so the second request waits in the queue: it is answered 503."""
    process = subprocess.Popen([sys.executable, "-m", "spec_cli", "serve", "-p", str(profile_path), "--port", "0",
                                "--parallel", "1"],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env={**os.environ, **ENV})
    try:
        url = None
        for line in process.stderr:
            if found := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", line):
                url = found.group(1)
                break
        assert url, "the server did not start"
        body = {"prompt": "def fib(n):", "max_tokens": 2000, "temperature": 0, "stream": True}
        events, waiting = [], []
        queued = threading.Thread(target=lambda: waiting.append(httpx.post(url + "/v1/completions", timeout=30,
                                                                           json={"prompt": "import os"})))
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        queued.start()
                        deadline = time.time() + 10
                        while httpx.get(url + "/health").json()["queued"] < 1 and time.time() < deadline:
                            time.sleep(0.02)
                        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        queued.join(timeout=10)
        assert waiting[0].status_code == 503 and waiting[0].json()["error"]["code"] == "shutting_down"
        rest = process.stderr.read()
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length" and last["spec"]["finish"] == "shutdown"
        assert "Traceback" not in rest and "shutdown" in rest
    finally:
        if process.poll() is None:
            process.kill()


def test_a_servers_slots_warm_up_as_it_starts_and_it_says_when_they_are_done(profile_path):
    process = subprocess.Popen([sys.executable, "-m", "spec_cli", "serve", "-p", str(profile_path), "--port", "0",
                                "--parallel", "3"],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env={**os.environ, **ENV})
    watchdog = threading.Timer(120, process.kill)  # (no line saying so: the server ends, and so does the read)
    watchdog.start()
    try:
        url, lines = None, []
        for line in process.stderr:
            lines.append(line.strip())
            if found := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", line):
                url = found.group(1)
            if "warmed up" in line:
                break
        assert url and re.fullmatch(r"3 slots warmed up in \d+\.\d s", lines[-1]), lines
        assert httpx.get(url + "/health").json()["warming"] is False
        response = httpx.post(url + "/v1/completions", timeout=30,
                              json={"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()


def test_without_the_serve_extra_a_one_line_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if it were not installed
    result = spec("serve")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: spec serve needs fastapi: pip install 'spec-cli[serve]'")


def test_health_and_metrics_show_the_work_by_method(running):
    for prompt in PROMPTS[:2]:
        complete_text(running, prompt, max_tokens=8)
    health = httpx.get(running.url + "/health", timeout=30).json()
    assert health["tokens_per_second"] > 0 and health["queued"] == 0 and health["generating"] == 0
    text = httpx.get(running.url + "/metrics", timeout=30).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()}
    assert values["spec_requests_decoding"] == 0 and values["spec_requests_queued"] == 0
    assert values['spec_requests_total{method="staged"}'] >= 2 and values['spec_tokens_total{method="staged"}'] >= 16
    assert values['spec_tokens_per_second{method="staged"}'] > 0
    assert values['spec_tokens_per_oracle_forward{method="staged"}'] >= 1


def test_the_thread_that_builds_a_worker_leaves_the_compute_to_its_slots():
    """The models' loading made this thread an OpenMP team; a slot's thread computes now, and where libgomp manages
    more threads than CPUs every team's threads sleep between parallel regions (pyfam behind `--parallel 1`: 507-564
    against 732-878 tok/s). So building a worker gives this thread's team back."""
    from spec_cli.exec import openmp

    if openmp._libgomp() is None:
        pytest.skip("needs torch on libgomp")
    kept = torch.get_num_threads()
    torch.set_num_threads(2)  # (the suite runs in one thread)
    try:
        torch.ones(1 << 22).sum()  # (a parallel region: this thread's team exists)
        before = os_threads()
        worker_module.Worker(object(), plan_for=lambda settings: None, log=lambda line: None)
        assert settled(os_threads, before - 1) == before - 1
    finally:
        torch.set_num_threads(kept)


def test_logprobs_whole_and_streamed_are_the_oracles(running):
    """`logprobs` (completions: how many likeliest tokens) and chat's `logprobs` with `top_logprobs`: each token's
    log-probability and the likeliest tokens', the same streamed as whole, and the oracle's as spec decodes
    alone (float32 here: to its rounding)."""
    from spec_cli.completion import complete
    from spec_cli.core.events import Token
    from spec_cli.core.settings import Decoding

    engine = running.engine
    whole = running.client.completions.create(model=running.name, prompt="def fib(n):", max_tokens=16,
                                              temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 16
    assert all(len(top) == 2 and max(top.values()) >= value for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    alone = complete(engine, engine.tokenizer("def fib(n):")["input_ids"],
                     Decoding(method="baseline", max_new_tokens=16, logprobs=2), trace=True)
    expected = [e.logprob for e in alone.events if isinstance(e, Token) and e.output]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    streamed = list(running.client.completions.create(model=running.name, prompt="def fib(n):", max_tokens=16,
                                                      temperature=0, logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": "hello there"}]
    chat = running.client.chat.completions.create(model=running.name, messages=messages, max_tokens=12,
                                                  temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == chat.choices[0].message.content
    chunks = list(running.client.chat.completions.create(model=running.name, messages=messages, max_tokens=12,
                                                         temperature=0, logprobs=True, top_logprobs=3, stream=True))
    assert [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == [c.logprob for c in content]
    plain = running.client.chat.completions.create(model=running.name, messages=messages, max_tokens=12,
                                                   temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_a_tokens_bytes_are_its_own_part_of_the_text(tmp_path):
    """`bytes` of a log-probability: byte-level BPE's tokens (a character split over several) and SentencePiece's
    (byte pieces, "▁") give back the text's UTF-8 when joined; a part of a character is written as OpenAI does."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from spec_cli.detok import TokenBytes, token_text

    text = "héllo → wörld\n\t日本語 😀"
    byte_level = make_tokenizer(tmp_path / "byte-level")
    sentencepiece = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sentencepiece.normalizer = normalizers.Replace(" ", "\u2581")
    sentencepiece.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    sentencepiece.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse()])
    sentencepiece.train_from_iterator(["hello world " * 20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)], show_progress=False))
    for tokenizer in (byte_level, PreTrainedTokenizerFast(tokenizer_object=sentencepiece, unk_token="<unk>")):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [TokenBytes(tokenizer)(i) for i in ids]
        assert b"".join(pieces).decode() == text and len(pieces) > len(text.split())
        assert any(token_text(p).startswith("bytes:\\x") for p in pieces)
