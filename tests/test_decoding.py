"""Exactness of the decoding methods: greedy token identity, and the oracle's distribution when sampling."""

import random

import pytest
import torch
from conftest import load_pair
from helpers import exact_distribution, prompts, run, sampled, tiny_vocab_model
from stats import chi_square_p_value

from spec_cli.core.events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    REJECTED,
    Finished,
    Stats,
    Token,
    Verified,
)
from spec_cli.core.families import Skip
from spec_cli.core.settings import Decoding
from spec_cli.decoding import accept, adapt, chain, methods
from spec_cli.decoding import sampling as sampling_module
from spec_cli.decoding.chain import Models
from spec_cli.decoding.methods import decode
from spec_cli.decoding.sampling import Sampler
from spec_cli.exec import Runner


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tiny_dir):
    oracle, draft = load_pair(tiny_dir, request.param)
    return Models(Runner(oracle), Runner(draft))


def test_greedy_speculative_is_token_identical_to_baseline(pair):
    accepted = rejected = 0
    for prompt in prompts(8):
        expected, _ = run(pair, prompt, method="baseline", max_new_tokens=40)
        for k in (1, 2, 3, 5, 8):
            got, events = run(pair, prompt, method="speculative", max_new_tokens=40, draft_tokens=k)
            assert got == expected, (prompt, k)
            accepted += sum(isinstance(e, Token) and e.kind == ACCEPTED for e in events)
            rejected += sum(isinstance(e, Token) and e.kind == REJECTED for e in events)
    assert accepted > 200 and rejected > 20  # both paths (full acceptance, rollback) were exercised


def test_events_tell_a_consistent_story(pair):
    prompt = prompts(1, seed=3)[0]
    _, events = run(pair, prompt, method="speculative", max_new_tokens=33, draft_tokens=4)
    stats = Stats()
    for e in events:
        stats.add(e)
    assert isinstance(events[-1], Finished) and events[-1].reason == "length"
    assert stats.new_tokens == 33
    oracle_steps = [e for e in events if isinstance(e, Verified) and e.verifier == "oracle"]
    assert stats.oracle_forwards == len(oracle_steps) < 33
    oracle_tokens = [e for e in events if isinstance(e, Token) and e.kind in (CORRECTED, BONUS)]
    assert len(oracle_tokens) == len(oracle_steps)  # exactly one oracle token per oracle forward
    assert all(e.stage == "oracle" for e in oracle_tokens)
    accepted = sum(isinstance(e, Token) and e.kind == ACCEPTED for e in events)
    assert stats.accepted["oracle"] == accepted
    assert stats.tokens_per_oracle_forward == pytest.approx(33 / len(oracle_steps))


def test_stops_at_eos_exactly_where_baseline_does(pair):
    prompt = prompts(1, seed=5)[0]
    free, _ = run(pair, prompt, method="baseline", max_new_tokens=30)
    eos = free[11]
    first = free.index(eos)
    pair.eos = frozenset([eos])
    try:
        for method in ("baseline", "speculative"):
            got, events = run(pair, prompt, method=method, max_new_tokens=30)
            assert got == free[: first + 1]
            assert events[-1] == Finished("eos")
    finally:
        pair.eos = frozenset()


def test_context_window_ends_generation_cleanly(tiny_dir):
    oracle, draft = load_pair(tiny_dir, "gpt2")
    models = Models(Runner(oracle, capacity=40), Runner(draft, capacity=40))
    prompt = prompts(1, seed=9)[0][:10]
    expected, events = run(models, prompt, method="baseline", max_new_tokens=100)
    assert len(expected) == 40 - len(prompt) + 1 and events[-1] == Finished("context")
    got, events = run(models, prompt, method="speculative", max_new_tokens=100, draft_tokens=6)
    assert got == expected and events[-1] == Finished("context")


# --- sampling: the output distribution is the oracle's, exactly -------------------------------------------

@pytest.fixture(scope="module")
def tiny_vocab_pair():
    oracle, draft = tiny_vocab_model(11, 2), tiny_vocab_model(12, 1)
    return oracle, Models(Runner(oracle), Runner(draft))


SAMPLING = [dict(temperature=1.0, sampling="rejection"), dict(temperature=0.8, top_k=3, top_p=0.9, sampling="rejection"),
            dict(temperature=0.8, top_k=3, top_p=0.9, sampling="coupled")]


@pytest.mark.parametrize("settings", SAMPLING)
def test_speculative_sampling_follows_the_oracle_distribution(tiny_vocab_pair, settings):
    oracle, models = tiny_vocab_pair
    prompt, length, trials = [1, 3], 3, 3000
    sampler = Sampler(settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0))
    expected = exact_distribution(oracle, prompt, length, sampler)
    counts = sampled(models, prompt, length, trials, method="speculative", draft_tokens=2, **settings)
    assert chi_square_p_value(counts, expected, trials) > 1e-4


def test_baseline_sampling_follows_the_oracle_distribution(tiny_vocab_pair):
    oracle, models = tiny_vocab_pair
    prompt, length, trials = [1, 3], 3, 3000
    expected = exact_distribution(oracle, prompt, length, Sampler(temperature=1.0))
    counts = sampled(models, prompt, length, trials, method="baseline", temperature=1.0, sampling="rejection")
    assert chi_square_p_value(counts, expected, trials) > 1e-4


@pytest.mark.parametrize("bug", ["residual", "bonus"])
def test_distribution_test_catches_a_wrong_residual_or_bonus(tiny_vocab_pair, monkeypatch, bug):
    oracle, models = tiny_vocab_pair
    real = accept.residuals

    def forget_q(ps, qs):  # on rejection, resample from p itself
        return torch.cat([ps[:-1], real(ps, qs)[-1:]])

    def wrong_bonus(ps, qs):  # bonus drawn from the last draft position
        return torch.cat([real(ps, qs)[:-1], ps[-2:-1]])

    monkeypatch.setattr(accept, "residuals", forget_q if bug == "residual" else wrong_bonus)
    prompt, length, trials = [1, 3], 3, 3000
    expected = exact_distribution(oracle, prompt, length, Sampler(temperature=1.0))
    counts = sampled(models, prompt, length, trials, method="speculative", draft_tokens=2, temperature=1.0,
                     sampling="rejection")
    assert chi_square_p_value(counts, expected, trials) < 1e-6


@pytest.mark.parametrize("method", ["baseline", "speculative", "staged"])
def test_reused_prefix_gives_what_a_fresh_cache_gives(pair, method):
    """A chat turn: the cache keeps the shared prefix, runs only the new tokens, and the reply is unchanged."""
    rng = random.Random(7)
    history = prompts(1, seed=11)[0]
    reference = Models(Runner(pair.oracle.model))
    for turn in range(4):
        history = history + [rng.randrange(1, 300) for _ in range(rng.randint(1, 6))]
        fresh, _ = run(reference, history, method="baseline", max_new_tokens=25)
        events = list(decode(pair, history, Decoding(method=method, max_new_tokens=25), reuse=True))
        if turn:
            assert pair.oracle.committed >= len(history) - 1  # the earlier turns were not re-run
        got = [e.token for e in events if isinstance(e, Token) and e.output]
        assert got == fresh, (method, turn)
        for runner in (pair.oracle, pair.draft) if method != "baseline" else (pair.oracle,):
            n = runner.committed  # every cached entry is what a fresh forward of its tokens gives
            assert runner.tokens == (history + got)[:n]
            clean = Runner(runner.model)
            clean.forward(runner.tokens, commit=n)
            torch.testing.assert_close(torch.stack(runner.keys)[..., :n, :], torch.stack(clean.keys)[..., :n, :],
                                       rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(torch.stack(runner.values)[..., :n, :], torch.stack(clean.values)[..., :n, :],
                                       rtol=1e-4, atol=1e-5)
        history = history + got[: rng.randint(1, len(got) - 1)]  # cut short (a stop string): drop the rest


@pytest.mark.parametrize("method", ["speculative", "staged"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_k=20, seed=4)])
def test_a_draft_reads_only_a_long_prompts_end_and_the_text_is_unchanged(pair, method, sampling, monkeypatch):
    """A chat whose turns outgrow the draft's reading (DRAFT_READS, 12 here): the draft starts again from the
    prompt's last 12 tokens, its cache what a fresh forward of them gives, its forwards at the text's positions
    (coupled noise is keyed by them), a short next turn keeps its window; the text is baseline's."""
    monkeypatch.setattr(chain, "DRAFT_READS", 12)
    rng = random.Random(9)
    history = prompts(1, seed=13)[0] + [rng.randrange(1, 300) for _ in range(30)]
    reference, draft, bases = Models(Runner(pair.oracle.model)), pair.draft, []
    for added in (0, 3, 40):
        history = history + [rng.randrange(1, 300) for _ in range(added)]
        settings = dict(method=method, max_new_tokens=20, tree_adaptive=False, **sampling)  # (the draft runs)
        fresh, _ = run(reference, history, **{**settings, "method": "baseline"})
        events = list(decode(pair, history, Decoding(**settings), reuse=True))
        got = [e.token for e in events if isinstance(e, Token) and e.output]
        assert got == fresh, (method, added)
        n, text = draft.committed, history + got
        assert draft.base > 0 and n > 0 and draft.tokens == text[draft.base : draft.base + n]
        clean = Runner(draft.model)
        clean.forward(draft.tokens, commit=n)
        torch.testing.assert_close(torch.stack(draft.keys)[..., :n, :], torch.stack(clean.keys)[..., :n, :],
                                   rtol=1e-4, atol=1e-5)
        tail = text[draft.base + n :] or [1]  # (what it has not read; caught up: one more token)
        assert draft.forward(tail, last=1).positions.tolist() == [draft.base + n + len(tail) - 1]
        bases.append(draft.base)
        history = text
    assert bases[0] == bases[1] < bases[2]  # (3 more tokens: read on from the window; 40: a new one)
    other = [rng.randrange(1, 300) for _ in range(bases[2] + 5)]  # (a new text, reaching past the old window's start)
    list(decode(pair, other, Decoding(method=method, max_new_tokens=4, tree_adaptive=False), reuse=True))
    assert draft.base == len(other) - 12  # (its own window, not the last text's)


def test_an_interrupted_forward_leaves_no_stale_cache(pair, monkeypatch):
    prompt = prompts(1, seed=5)[0] + [3, 4, 5]
    expected, _ = run(pair, prompt, method="baseline", max_new_tokens=20)
    real = Runner._run
    calls = {"n": 0}

    def flaky(self, *args):
        calls["n"] += self is pair.oracle
        if calls["n"] == 3:
            for keys in self.keys:
                keys.normal_()  # half-written garbage, then the user presses Ctrl-C
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(Runner, "_run", flaky)
    with pytest.raises(KeyboardInterrupt):
        list(decode(pair, prompt, Decoding(method="speculative", max_new_tokens=20), reuse=True))
    monkeypatch.setattr(Runner, "_run", real)
    got = [e.token for e in decode(pair, prompt, Decoding(method="speculative", max_new_tokens=20), reuse=True)
           if isinstance(e, Token) and e.output]
    assert got == expected


@pytest.mark.parametrize("method", ["baseline", "speculative", "staged", "self"])
@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_random_draws_use_a_generator_on_the_oracles_device(pair, method, sampling, monkeypatch):
    """Every draw of a sampled completion comes from one seeded generator made on the logits' device."""
    made = []
    original = sampling_module.make_generator

    def recording(seed, device):
        made.append(torch.device(device))
        return original(seed, device)

    monkeypatch.setattr(sampling_module, "make_generator", recording)
    monkeypatch.setattr(methods, "make_generator", recording)
    models = Models(pair.oracle, pair.draft, self_skip=Skip.of([1], [1]))
    run(models, prompts(1)[0], method=method, max_new_tokens=6, temperature=1.0, seed=3, sampling=sampling)
    assert made and set(made) == {pair.oracle.device}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["baseline", "speculative", "staged", "self"])
def test_sampling_on_cuda_is_reproducible(tiny_dir, method):
    oracle, draft = load_pair(tiny_dir, "llama")
    models = Models(Runner(oracle.cuda()), Runner(draft.cuda()), self_skip=Skip.of([1], [1]))
    settings = dict(method=method, max_new_tokens=12, temperature=1.0, top_k=20, seed=7)
    first, _ = run(models, prompts(1)[0], **settings)
    second, _ = run(models, prompts(1)[0], **settings)
    assert first == second and len(first) == 12


@pytest.mark.parametrize("method, mode", [("baseline", "greedy"), ("baseline", "drawn"), ("baseline", "coupled"),
                                          ("staged", "greedy"), ("staged", "coupled")])  # (staged's drawn text
def test_a_plain_steps_next_forward_queued_before_its_read_changes_nothing(pair, method, mode, monkeypatch):
    # depends on its steps' shapes: its distribution is what is exact, tests/test_exact.py)
    """Where the device queues forwards (`Runner.queues`: a GPU; here the CPU runner is told so), a plain
    step's next forward is queued before its token is read. The tokens are the same, at a stop at EOS too, and
    the cache stays a prefix of the text: the next turn reuses it and gives what a fresh cache gives. Staged
    here speculates one step in four (its fixed policy told so, no lookup), so plain runs begin and end."""
    sampling = {"greedy": {}, "drawn": dict(temperature=1.0, top_k=20, sampling="rejection", seed=3),
                "coupled": dict(temperature=1.0, top_k=20, seed=3)}[mode]
    settings = dict(method=method, max_new_tokens=30, tree_adaptive=False, lookup=False, **sampling)
    steps = [0]

    def speculate(self, cue=None, catch_up=0, remaining=None):
        steps[0] += 1
        return steps[0] % 4 == 1

    monkeypatch.setattr(adapt.Policy, "speculate", speculate)
    prompt = prompts(1, seed=13)[0]

    def completion(prompt, reuse=False):
        tokens, ahead, steps[0] = [], [], 0
        for e in decode(pair, prompt, Decoding(**settings), reuse=reuse):
            if isinstance(e, Token) and e.output:
                tokens.append(e.token)
                ahead.append(pair.oracle.committed - len(prompt) - len(tokens))  # 0: read, then queued
            last = e
        return tokens, ahead, last

    monkeypatch.setattr(pair.oracle, "queues", False)
    expected, read_first, _ = completion(prompt)
    monkeypatch.setattr(pair.oracle, "queues", True)
    got, ahead, _ = completion(prompt)
    assert got == expected
    queued = ahead.count(0) - read_first.count(0)  # tokens whose next forward was queued before their read
    assert queued == len(got) - 1 if method == "baseline" else queued >= 8
    eos = expected[17]
    monkeypatch.setattr(pair, "eos", frozenset([eos]))
    got, _, finished = completion(prompt)
    assert got == expected[: expected.index(eos) + 1] and finished == Finished("eos")
    history = prompt + got + [5, 6]
    monkeypatch.setattr(pair, "eos", frozenset())
    again, _, _ = completion(history, reuse=True)
    fresh, _ = run(Models(Runner(pair.oracle.model)), history, **{**settings, "method": "baseline"})
    assert again == fresh


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_logprobs_are_the_oracles_own_and_every_method_gives_baselines(tiny_dir, arch):
    """In bfloat16 (a row's bits whatever rows share its forward): each output token's log-probability and the
    likeliest three, from every method, greedy and coupled top-k sampling, are baseline's bit for bit (a row taken
    from the wrong node or position, or a coupled score in place of the logits, breaks it); and they are the
    log-softmax of the model's own forward over the whole text, to bfloat16's rounding."""
    oracle, draft = load_pair(tiny_dir, arch, dtype=torch.bfloat16)
    models = Models(Runner(oracle), Runner(draft), self_skip=Skip.of(attention=[1], mlp=[1]))
    for prompt in prompts(3, seed=5):
        for sampling in ({}, {"temperature": 0.8, "top_k": 20, "seed": 4}):
            reference = None
            for method in ("baseline", "speculative", "staged", "self"):
                _, events = run(models, prompt, method=method, max_new_tokens=30, logprobs=3, **sampling)
                got = [(e.token, e.logprob, e.top) for e in events if isinstance(e, Token) and e.output]
                assert len(got) == 30 and all(len(top) == 3 and top[0][1] >= lp for _, lp, top in got)
                reference = reference or got
                assert got == reference, (method, sampling)
            tokens = [t for t, _, _ in reference]
            with torch.no_grad():
                logits = oracle(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            assert torch.allclose(torch.tensor([lp for _, lp, _ in reference]), expected, atol=0.1)
    _, events = run(models, prompts(1)[0], method="staged", max_new_tokens=8)
    assert all(e.logprob is None and e.top == () for e in events if isinstance(e, Token))  # (unless asked)
