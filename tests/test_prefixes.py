"""The prefix cache (`exec.prefixes`): a request that shares a prefix with any earlier one, not only the last,
runs only what follows it, and decodes what a fresh engine decodes."""

from __future__ import annotations

import random

import torch
from conftest import load_pair

from spec_cli.core.settings import Decoding
from spec_cli.exec import Runner
from spec_cli.exec.prefixes import Prefixes


def prompts(seed=3, n=120):
    rng = random.Random(seed)
    system = [rng.randrange(300) for _ in range(n)]  # a shared start (a system prompt)
    return system, [rng.randrange(300) for _ in range(20)], [rng.randrange(300) for _ in range(20)]


def test_a_runner_keeps_what_it_drops_and_takes_the_longest_kept_prefix(tiny_dir):
    oracle, _ = load_pair(tiny_dir, "llama")
    store = Prefixes(budget=1 << 30)
    runner = Runner(oracle, capacity=512, prefixes=store)
    system, a, b = prompts()
    first = system + a
    runner.reuse(first)
    runner.forward(first, commit=len(first))
    assert runner.reuse(b + system) == 0  # (nothing shared: the first sequence is kept, all of it)
    assert list(store.kept) == [tuple(first)]
    runner.forward(b + system, commit=len(b) + len(system))
    again = first + [5, 6, 7]
    assert runner.reuse(again) == len(first)  # from the store, not recomputed
    assert store.hits == 1 and runner.tokens == first and runner.committed == len(first)
    logits = runner.forward(again[len(first):], commit=3).logits
    fresh = Runner(oracle, capacity=512)
    expected = fresh.forward(again, commit=len(again)).logits[-3:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert tuple(b + system) in store.kept  # (what the runner held went to the store in its turn)


def test_the_budget_keeps_the_most_recent_and_a_prefix_of_a_kept_sequence_adds_nothing(tiny_dir):
    oracle, _ = load_pair(tiny_dir, "llama")
    runner = Runner(oracle, capacity=512)
    system, a, b = prompts()
    runner.forward(system + a, commit=len(system) + len(a))
    keys, values = (c[:, :, :, :140] for c in runner._stacked)
    one = 2 * keys.numel() * keys.element_size()
    store = Prefixes(budget=2 * one)
    store.put(system + a, keys, values)
    store.put(system, keys[:, :, :, :120], values[:, :, :, :120])  # (what a kept one starts with)
    assert len(store.kept) == 1
    store.put(b + system, keys, values)
    store.put(a + system, keys, values)
    assert list(store.kept) == [tuple(b + system), tuple(a + system)] and store.bytes <= 2 * one
    assert store.best(system + b, limit=1000)[0] == 0 and store.best(a + system[:7], limit=1000)[0] == 27


def test_an_engine_with_a_prefix_cache_decodes_as_a_fresh_one(tiny_dir, tmp_path):
    from spec_cli.completion import complete
    from spec_cli.engine import Engine
    from spec_cli.models import profiles

    profile = tmp_path / "p.toml"
    profile.write_text(f'oracle = "{tiny_dir / "llama-oracle"}"\ndraft = "{tiny_dir / "llama-draft"}"\n'
                       'dtype = "float32"\n[decoding]\nmax_new_tokens = 16\n')
    loaded = profiles.load(str(profile))
    cached = Engine(loaded, dtype="float32", need_draft=True, prefix_cache=1 << 28)
    system, a, b = prompts(seed=5)
    requests = [system + a, b + system, system + a + [9], system + b]
    for method in ("baseline", "staged"):
        settings = Decoding(method=method, max_new_tokens=16)
        for ids in requests:
            fresh = Engine(loaded, dtype="float32", need_draft=True)
            assert complete(cached, ids, settings, reuse=True).tokens == complete(fresh, ids, settings).tokens
    assert cached._prefixes["oracle"].hits >= 2


def test_a_server_serves_a_prefix_kept_for_a_client_that_comes_back(tiny_dir, tmp_path, monkeypatch):
    """Two clients taking turns, one of them back with its long prompt: its prefix comes from the cache (the
    metrics count the hit), and its text is what the server gives that request alone."""
    import httpx
    from test_serve import Running

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data-home"))
    profile = tmp_path / "p.toml"
    profile.write_text(f'oracle = "{tiny_dir / "llama-oracle"}"\ndraft = "{tiny_dir / "llama-draft"}"\n'
                       'dtype = "float32"\n[decoding]\nmax_new_tokens = 12\n')
    server = Running(profile, prefix_cache=1 << 28)
    try:
        long = "def handler(request):\n" * 8
        texts = [server.client.completions.create(model=server.name, prompt=p, max_tokens=12, temperature=0)
                 .choices[0].text for p in (long + "a", "import os\n" * 12, long + "b")]
        values = {line.split(" ")[0]: float(line.split(" ")[1])
                  for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines()}
        assert values['spec_prefix_cache_hits_total{model="oracle"}'] >= 1
    finally:
        server.stop()
    alone = Running(profile)
    try:
        assert alone.client.completions.create(model=alone.name, prompt=long + "b", max_tokens=12,
                                               temperature=0).choices[0].text == texts[2]
    finally:
        alone.stop()
