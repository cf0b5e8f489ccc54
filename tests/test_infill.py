"""Fill-in-the-middle in `spec serve`: llama.cpp's `/infill` (what editor plugins call) and `/v1/completions`
with a `suffix`, through a real uvicorn server and real HTTP clients: the prompt in the model's FIM tokens, the
text what the engine gives for those tokens alone, streamed as unstreamed; a model without FIM tokens is a
JSON error. A slow test asks the real Qwen2.5-Coder-1.5B (its GGUF file) to fill a function's body."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import Running, no_tuning, profile_path, running  # noqa: E402,F401
from tiny import make_served_pair, make_tokenizer  # noqa: E402

from spec_cli.completion import complete  # noqa: E402
from spec_cli.core.settings import Decoding  # noqa: E402
from spec_cli.serve.infill import FORMATS, fim_of, infill_ids  # noqa: E402

QWEN = FORMATS[0]


def text_until_fim(tokenizer, tokens: list[int]) -> str:
    """What a server answers for these output tokens: the text up to the first FIM token (that ends it)."""
    stops = set(tokenizer.convert_tokens_to_ids(QWEN.tokens()))
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)


@pytest.fixture(scope="module")
def fim_profile(tmp_path_factory):
    """A tiny GPT-2 pair whose tokenizer has Qwen2.5-Coder's FIM tokens."""
    root = tmp_path_factory.mktemp("fim-models")
    tokenizer = make_tokenizer(root / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN.tokens()})
    tokenizer.save_pretrained(root / "tokenizer")
    return make_served_pair(root, "fim", context=1024, max_new_tokens=20, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def fim_server(fim_profile):
    server = Running(fim_profile)
    yield server
    server.stop()


def test_the_formats_tokens_are_found_and_the_prompt_keeps_users_text_as_text(fim_server):
    tokenizer = fim_server.engine.tokenizer
    fim = fim_of(tokenizer)
    assert fim == QWEN
    ids = infill_ids(tokenizer, fim, "def f(x):\n    ", "\n    return y\n", [("util.py", "A = 1")])
    token = tokenizer.convert_tokens_to_ids
    assert ids[0] == token(QWEN.repo) and ids.count(token(QWEN.file_sep)) == 2
    assert ids.index(token(QWEN.prefix)) < ids.index(token(QWEN.suffix)) < ids.index(token(QWEN.middle)) == len(ids) - 1
    assert tokenizer.decode(ids[ids.index(token(QWEN.prefix)) + 1: ids.index(token(QWEN.suffix))]) == "def f(x):\n    "
    spelled = infill_ids(tokenizer, fim, "a <|fim_middle|> b", "")  # (a user's text that spells a FIM token)
    assert spelled.count(token(QWEN.middle)) == 1


def test_infill_is_the_engines_completion_of_the_fim_prompt_streamed_or_not(fim_server):
    engine = fim_server.engine
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids = infill_ids(engine.tokenizer, QWEN, prefix, suffix, [("notes.py", "import os")])
    alone = complete(engine, ids, Decoding(method="baseline", max_new_tokens=20))
    expected = text_until_fim(engine.tokenizer, alone.tokens)
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [{"filename": "notes.py", "text": "import os"}],
            "n_predict": 20, "temperature": 0}
    answer = httpx.post(fim_server.url + "/infill", json=body, timeout=60).json()
    assert answer["stop"] is True and answer["content"] == expected and answer["tokens_evaluated"] == len(ids)
    pieces, last = [], None
    with httpx.stream("POST", fim_server.url + "/infill", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
                pieces.append(last["content"])
    assert "".join(pieces) == expected and last["stop"] is True


def test_a_completion_with_a_suffix_fills_the_middle(fim_server):
    prefix, suffix = "class Stack:\n    def push(self, x):\n        ", "\n"
    infill = httpx.post(fim_server.url + "/infill", json={"input_prefix": prefix, "input_suffix": suffix,
                                                          "n_predict": 16, "temperature": 0}, timeout=60).json()
    completion = fim_server.client.completions.create(model=fim_server.name, prompt=prefix, suffix=suffix,
                                                      max_tokens=16, temperature=0)
    assert completion.choices[0].text == infill["content"]


def test_a_model_without_fim_tokens_is_a_json_error_and_serving_goes_on(running):  # noqa: F811
    response = httpx.post(running.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=30)
    assert response.status_code == 400 and "fill-in-the-middle" in response.json()["error"]["message"]
    response = httpx.post(running.url + "/v1/completions", json={"prompt": "a", "suffix": "b"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
    bad = httpx.post(running.url + "/infill", json={"input_prefix": 3}, timeout=30)
    assert bad.status_code == 400
    assert running.client.completions.create(model=running.name, prompt="def", max_tokens=4).choices[0].text


@pytest.mark.slow
def test_the_real_qwen_coder_fills_a_function_body(tmp_path):
    """Qwen2.5-Coder-1.5B from its GGUF file (../shared/tools/fetch-models), its draft the 0.5B: the body it
    fills reads its arguments and returns, and equals the oracle alone's greedy text."""
    oracle, draft = os.environ.get("QWEN_1_5B"), os.environ.get("QWEN_0_5B")
    cache = Path.home() / ".cache" / "spec-models"
    oracle = oracle or str(cache / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    draft = draft or str(cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    if not (Path(oracle).is_file() and Path(draft).is_file()):
        pytest.skip("the Qwen pair is not fetched (../shared/tools/fetch-models)")
    profile = tmp_path / "qwen.toml"
    profile.write_text(f'oracle = "{oracle}"\ndraft = "{draft}"\n[decoding]\nmax_new_tokens = 48\n')
    server = Running(profile, dtype=None)
    try:
        assert server.engine.tokenizer.convert_tokens_to_ids(QWEN.prefix) == 151659
        prefix = "def mean(values: list[float]) -> float:\n    "
        suffix = "\n\nprint(mean([1.0, 2.0, 3.0]))\n"
        answer = httpx.post(server.url + "/infill", json={"input_prefix": prefix, "input_suffix": suffix,
                                                          "n_predict": 48, "temperature": 0}, timeout=600).json()
        assert "return" in answer["content"] and "values" in answer["content"]
        ids = infill_ids(server.engine.tokenizer, QWEN, prefix, suffix)
        alone = complete(server.engine, ids, Decoding(method="baseline", max_new_tokens=48))
        assert answer["content"] == text_until_fim(server.engine.tokenizer, alone.tokens)
    finally:
        server.stop()
