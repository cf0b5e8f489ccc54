"""Self-speculative decoding: the oracle with skipped sublayers drafts for itself, and the output is unchanged."""

import copy
import functools

import pytest
import torch
from conftest import load_pair
from helpers import exact_distribution, prompts, sampled, tiny_vocab_model
from stats import chi_square_p_value

from spec_cli.core.events import ACCEPTED, REJECTED, Token, Verified
from spec_cli.core.families import Skip
from spec_cli.core.settings import Decoding
from spec_cli.decoding.chain import Models
from spec_cli.decoding.methods import decode
from spec_cli.decoding.sampling import Sampler
from spec_cli.decoding.selfspec import ExitThreshold
from spec_cli.exec import Runner


def tokens_of(events):
    return [e.token for e in events if isinstance(e, Token) and e.output]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def oracle(request, tiny_dir):
    model, _ = load_pair(tiny_dir, request.param)
    return model


def zeroed(model, skip: Skip):
    """An independent reference: a copy whose skipped sublayers output zero (their output projections zeroed)."""
    model = copy.deepcopy(model)
    gpt2 = model.config.model_type == "gpt2"
    layers = model.transformer.h if gpt2 else model.model.layers
    with torch.no_grad():
        for i in skip.attention:
            proj = layers[i].attn.c_proj if gpt2 else layers[i].self_attn.o_proj
            for p in proj.parameters():
                p.zero_()
        for i in skip.mlp:
            proj = layers[i].mlp.c_proj if gpt2 else layers[i].mlp.down_proj
            for p in proj.parameters():
                p.zero_()
    return model


@pytest.mark.parametrize("skip", [Skip(), Skip.of([1], []), Skip.of([], [0, 2]), Skip.of([0, 2], [1]),
                                  Skip.of([0, 1, 2], [0, 1, 2])])
def test_skipped_sublayers_are_the_identity_on_the_residual(oracle, skip):
    prompt = prompts(1, seed=4)[0] + [7, 8, 9]
    reference = zeroed(oracle, skip)(torch.tensor([prompt])).logits[0].float()
    runner = Runner(oracle, skip=skip)
    torch.testing.assert_close(runner.forward(prompt, commit=len(prompt)).logits, reference, rtol=1e-4, atol=1e-4)
    # and one token at a time through the cache
    runner.reset()
    for i, token in enumerate(prompt):
        logits = runner.forward([token], commit=1).logits[-1]
        torch.testing.assert_close(logits, reference[i], rtol=1e-4, atol=1e-4)
    assert not zeroed(oracle, skip) is oracle and any(p.abs().sum() > 0 for p in oracle.parameters())


SKIP_SETS = {
    "none": Skip(),  # the draft is the oracle: everything is accepted
    "one attention": Skip.of([1], []),
    "mixed": Skip.of([2], [0]),
    "all but layer 0": Skip.of([1, 2], [1, 2]),
    "everything": Skip.of([0, 1, 2], [0, 1, 2]),
}


@pytest.mark.parametrize("name", list(SKIP_SETS))
def test_greedy_self_speculative_is_token_identical_to_baseline(oracle, name):
    models = Models(Runner(oracle), self_skip=SKIP_SETS[name])
    reference = Models(Runner(oracle))
    accepted = rejected = 0
    for prompt in prompts(4, seed=21):
        expected = tokens_of(decode(reference, prompt, Decoding(method="baseline", max_new_tokens=30)))
        for settings in (dict(draft_tokens=3, self_adaptive=False, self_threshold=0.0),
                         dict(draft_tokens=8, self_threshold=0.6),
                         dict(draft_tokens=12, self_threshold=0.95)):
            events = list(decode(models, prompt, Decoding(method="self", max_new_tokens=30, **settings)))
            assert tokens_of(events) == expected, (name, prompt, settings)
            accepted += sum(isinstance(e, Token) and e.kind == ACCEPTED for e in events)
            rejected += sum(isinstance(e, Token) and e.kind == REJECTED for e in events)
    assert accepted > 0  # both paths (acceptance, rollback) exercised
    if name == "none":
        assert rejected == 0 and accepted > 200
    else:
        assert rejected > 100


def test_the_cache_holds_only_full_model_entries_after_self_drafting(oracle):
    """Draft entries (skipped layers, stale slots) never survive: every committed entry is the full model's."""
    models = Models(Runner(oracle), self_skip=Skip.of([0, 2], [1]))
    prompt = prompts(1, seed=2)[0]
    out = tokens_of(decode(models, prompt, Decoding(method="self", max_new_tokens=40, self_threshold=0.0,
                                                    self_adaptive=False, draft_tokens=5)))
    runner = models.oracle
    n = runner.committed
    assert runner.tokens == (prompt + out)[:n] and n > len(prompt) + 30
    clean = Runner(oracle)
    clean.forward(runner.tokens, commit=n)
    torch.testing.assert_close(torch.stack(runner.keys)[..., :n, :], torch.stack(clean.keys)[..., :n, :],
                                       rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.stack(runner.values)[..., :n, :], torch.stack(clean.values)[..., :n, :],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["speculative", "staged"])
def test_a_self_draft_can_be_the_draft_of_speculative_and_staged_runs(oracle, method):
    skip = Skip.of([1], [2])
    models = Models(Runner(oracle), Runner(oracle, skip=skip))
    reference = Models(Runner(oracle))
    assert models.draft.model is oracle  # no weights copied
    for prompt in prompts(5, seed=8):
        expected = tokens_of(decode(reference, prompt, Decoding(method="baseline", max_new_tokens=30)))
        assert tokens_of(decode(models, prompt, Decoding(method=method, max_new_tokens=30))) == expected


def test_adaptive_exit_threshold_follows_the_acceptance_rate():
    threshold = ExitThreshold(0.8)
    for _ in range(30):
        threshold.update(proposed=4, accepted=1, hit_limit=False)  # poor acceptance: draft less
    assert threshold.value > 0.8 and threshold.acceptance < 0.5
    high = threshold.value
    for _ in range(60):
        threshold.update(proposed=4, accepted=4, hit_limit=False)  # all accepted: draft more
    assert threshold.value < high and threshold.acceptance > 0.9
    steady = threshold.value
    threshold.update(proposed=4, accepted=4, hit_limit=True)  # the length cap stopped it: hold still
    assert threshold.value == pytest.approx(steady)
    fixed = ExitThreshold(0.5, adaptive=False)
    fixed.update(4, 0, False)
    assert fixed.value == 0.5


def test_draft_exits_early_when_unsure(oracle):
    """A threshold of 1 stops after one token; 0 drafts up to the cap; the stats say so."""
    prompt = prompts(1, seed=6)[0]
    for threshold, most in ((1.0, 1), (0.0, 6)):
        models = Models(Runner(oracle), self_skip=Skip.of([1], [1]))
        events = list(decode(models, prompt, Decoding(method="self", max_new_tokens=30, draft_tokens=6,
                                                      self_threshold=threshold, self_adaptive=False)))
        proposed = [e.proposed for e in events if isinstance(e, Verified) and e.verifier == "oracle" and e.proposed]
        assert max(proposed) == most
        if most > 1:
            assert proposed.count(most) > len(proposed) // 2


def test_method_self_without_a_skip_set_is_a_clear_error(oracle):
    from spec_cli.core.errors import SpecError

    with pytest.raises(SpecError, match="skip set"):
        list(decode(Models(Runner(oracle)), [1, 2], Decoding(method="self")))


# --- sampling: the output is exactly the oracle's distribution ------------------------------------------

@pytest.fixture(scope="module")
def tiny_vocab_oracle():
    return tiny_vocab_model(31, 3)


@pytest.mark.parametrize("settings, greedy_draft", [(dict(temperature=0.8, top_k=3, top_p=0.9), False),
                                                    (dict(temperature=1.0), True)])
def test_self_speculative_sampling_follows_the_oracle_distribution(tiny_vocab_oracle, monkeypatch, settings,
                                                                   greedy_draft):
    from spec_cli.decoding import methods, selfspec

    if greedy_draft:  # the draft takes its argmax: q is one-hot
        monkeypatch.setitem(methods.STRATEGIES, "self", functools.partial(selfspec.self_speculative, greedy_draft=True))
    models = Models(Runner(tiny_vocab_oracle), self_skip=Skip.of([0, 2], [1]))
    prompt, length, trials = [1, 3], 3, 2000
    expected = exact_distribution(tiny_vocab_oracle, prompt, length, Sampler(**settings))
    counts = sampled(models, prompt, length, trials, method="self", draft_tokens=3, self_threshold=0.2, **settings)
    assert chi_square_p_value(counts, expected, trials) > 1e-4


def test_distribution_test_catches_a_draft_q_that_is_not_the_one_drafted_from(tiny_vocab_oracle, monkeypatch):
    """Power check: drafting greedily but verifying as if sampled from q (a classic bug) must fail."""
    from spec_cli.decoding import methods, selfspec

    real_one_hot = selfspec._one_hot
    monkeypatch.setattr(selfspec, "_one_hot", lambda token, logits: torch.softmax(logits, -1))
    monkeypatch.setitem(methods.STRATEGIES, "self", functools.partial(selfspec.self_speculative, greedy_draft=True))
    models = Models(Runner(tiny_vocab_oracle), self_skip=Skip.of([0, 2], [1]))
    prompt, length, trials = [1, 3], 3, 1000
    expected = exact_distribution(tiny_vocab_oracle, prompt, length, Sampler(temperature=1.0))
    counts = sampled(models, prompt, length, trials, method="self", draft_tokens=3, self_threshold=0.2,
                     temperature=1.0)
    assert chi_square_p_value(counts, expected, trials) < 1e-6
    assert real_one_hot(2, torch.zeros(4)).tolist() == [0, 0, 1, 0]
