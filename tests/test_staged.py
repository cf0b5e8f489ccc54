"""Staged speculative decoding: tree batches, the draft2 stage and the run-time adaptation stay exact."""

import random
import time
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import load_pair
from helpers import (
    VOCAB,
    exact_distribution,
    noisy_copy,
    prompts,
    run,
    sampled,
    tiny_vocab_model,
)
from stats import chi_square_p_value

from spec_cli.core.events import ACCEPTED, REJECTED, Finished, Stats, Token, Verified
from spec_cli.core.settings import Decoding
from spec_cli.decoding import adapt
from spec_cli.decoding import staged as tree_module
from spec_cli.decoding.chain import READ_FIRST, Models, Output, sampler_of
from spec_cli.decoding.sampling import Draws, Sampler
from spec_cli.draft2.ngram import KatzTrigram, LookupOrTrigram, PromptLookup
from spec_cli.exec import Runner
from spec_cli.exec import runner as runner_module

SHAPES = [  # budget, depth, branching, width, mass
    (1, 1, 1, 1, 1.0), (4, 4, 1, 1, 1.0), (8, 3, 3, 2, 1.0), (16, 5, 2, 4, 0.8), (24, 6, 3, 4, 0.9),
    (40, 8, 4, 8, 0.5),
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def runners(request, tiny_dir):
    oracle, draft = load_pair(tiny_dir, request.param)
    return Runner(oracle), Runner(draft)


@pytest.fixture
def pair(runners):
    """The module's runners in fresh Models: each test's controllers measure from scratch (they otherwise
    outlive a completion, as they should)."""
    return Models(*runners)


class Noisy:
    """A deliberately poor draft2: right some of the time, wrong otherwise."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, context, n):
        return [self.rng.randrange(300) for _ in range(n)]


def tiny_trigram():
    rng = random.Random(3)
    streams = [[rng.randrange(1, 40) for _ in range(200)] for _ in range(20)] + prompts(20, seed=1)
    return KatzTrigram.fit(streams, vocab_size=300)


DRAFT2 = {None: lambda: None, "prompt-lookup": PromptLookup, "noisy": lambda: Noisy(0),
          "lookup+trigram": lambda: LookupOrTrigram(tiny_trigram())}


@pytest.mark.parametrize("draft2", [None, "prompt-lookup"] + [pytest.param(d, marks=pytest.mark.slow)
                                                              for d in ("noisy", "lookup+trigram")])
def test_greedy_staged_is_token_identical_to_baseline(pair, draft2):
    pair.draft2 = DRAFT2[draft2]()
    stats = Stats()
    try:
        for prompt in prompts(4, seed=1):
            expected, _ = run(pair, prompt, method="baseline", max_new_tokens=40)
            for adaptive in (False, True):
                for budget, depth, branching, width, mass in SHAPES if not adaptive else SHAPES[2:]:
                    got, events = run(pair, prompt, method="staged", max_new_tokens=40, tree_budget=budget,
                                      tree_depth=depth, tree_branching=branching, tree_width=width,
                                      tree_mass=mass, tree_adaptive=adaptive)
                    assert got == expected, (prompt, budget, depth, branching, width, mass, adaptive)
                    for e in events:
                        stats.add(e)
    finally:
        pair.draft2 = None
    assert stats.accepted["oracle"] > 300
    if draft2 is not None:
        assert stats.proposed["draft"] > 0


class DraftsOwnChain:
    """A perfect draft2: the draft model's own greedy continuation."""

    def __init__(self, model):
        self.model = model

    def propose(self, context, n):
        ids = list(context)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(context):]


def test_a_deep_branch_costs_one_draft_forward(pair):
    """Draft2 speculates for the draft: the draft checks a whole guessed chain in the forward it runs anyway."""
    models = Models(pair.oracle, pair.draft, DraftsOwnChain(pair.draft.model))
    stats, drafting = Stats(), []
    for prompt in prompts(3, seed=6):
        expected, _ = run(pair, prompt, method="baseline", max_new_tokens=30)
        got, events = run(models, prompt, method="staged", max_new_tokens=30, tree_budget=6, tree_depth=6,
                          tree_branching=1, tree_width=1, draft2_tokens=5, tree_adaptive=False)
        assert got == expected
        for e in events:
            stats.add(e)
        drafting += [e for e in events if isinstance(e, Verified) and e.verifier == "draft"]
    assert {e.forwards for e in drafting} == {1}  # one draft forward per step, whatever the depth
    assert stats.proposed["draft"] > 3 * len(drafting)
    assert stats.accepted["draft"] == stats.proposed["draft"]  # the draft keeps every guess of its own chain
    assert stats.by_stage["draft2"] > 0


@pytest.mark.parametrize("method", ["staged", "speculative"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_k=20, seed=5)], ids=["greedy", "coupled"])
def test_the_first_token_of_a_long_prompt_does_not_wait_for_the_draft_to_read_it(pair, method, sampling):
    """A step that reads a prompt the draft has not read (more than READ_FIRST tokens) is the oracle's alone: the
    first token comes before any draft forward, and the draft reads the prompt at the next step; a short prompt's
    first step speculates as every step does. The same tokens either way, greedy or sampled for a seed."""
    rng = random.Random(11)
    for length, drafts_first in ((READ_FIRST + 20, False), (READ_FIRST // 4, True)):
        prompt = [rng.randrange(1, 300) for _ in range(length)]
        expected, _ = run(pair, prompt, method="baseline", max_new_tokens=12, **sampling)
        got, events = run(pair, prompt, method=method, max_new_tokens=12, tree_adaptive=False, **sampling)
        assert got == expected
        first = next(i for i, e in enumerate(events) if isinstance(e, Token) and e.output)
        before = [e for e in events[:first] if isinstance(e, Verified) and e.verifier == "draft"]
        assert bool(before) == drafts_first, length
        assert any(isinstance(e, Verified) and e.verifier == "draft" for e in events[first:])


def test_staged_drops_to_plain_decoding_when_drafting_does_not_pay(pair, monkeypatch):
    """A draft that is slow and rarely right: after a few probes nearly every step is the oracle alone."""
    real = pair.draft.forward

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(pair.draft, "forward", slow)
    prompt = prompts(1, seed=8)[0]
    expected, _ = run(pair, prompt, method="baseline", max_new_tokens=120)
    got, events = run(pair, prompt, method="staged", max_new_tokens=120)
    assert got == expected
    stats = Stats()
    for e in events:
        stats.add(e)
    assert stats.draft_forwards < 0.25 * stats.oracle_forwards


def test_a_text_that_turns_repetitive_gets_deep_speculation_within_a_few_steps(pair, monkeypatch):
    """The oracle's text turns into a loop after 30 tokens or more (a token that sends it round a cycle of four);
    before that the draft has no idea (a uniform q), in the loop it is sure and right; an oracle forward
    costs 5 ms more than the draft's. While the draft knows nothing staged takes plain steps, with a cheap
    look at the draft now and then; within a few steps of the loop repeating it speculates deep."""
    prompt = prompts(1, seed=8)[0]
    free, _ = run(pair, prompt, method="baseline", max_new_tokens=60)
    at = next(i for i in range(30, 60) if free[i] not in prompt + free[:i])  # a token new to the text
    seen = set(prompt) | set(free)
    cycle = [free[at]] + [t for t in range(3, 300) if t not in seen][:3]
    successor = torch.full((pair.oracle.vocab_size,), -1)
    successor[cycle] = torch.tensor(cycle[1:] + cycle[:1])

    def looping(forward, clueless):
        def forward_(tokens, *args, **kwargs):
            result = forward(tokens, *args, **kwargs)
            logits = result.logits
            nexts = successor[torch.as_tensor(tokens)[-logits.shape[0]:]]
            bias = torch.zeros_like(logits)
            bias[nexts >= 0, nexts[nexts >= 0]] = 50.0
            return result._replace(logits=(torch.zeros_like(logits) if clueless else logits) + bias)
        return forward_

    oracle_forward = looping(pair.oracle.forward, clueless=False)

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return oracle_forward(*args, **kwargs)

    monkeypatch.setattr(pair.oracle, "forward", slow)
    monkeypatch.setattr(pair.draft, "forward", looping(pair.draft.forward, clueless=True))
    pair.draft2 = PromptLookup()
    try:
        expected, _ = run(pair, prompt, method="baseline", max_new_tokens=120)
        assert expected[:at] == free[:at] and expected[at : at + 8] == cycle * 2
        got, events = run(pair, prompt, method="staged", max_new_tokens=120)
    finally:
        pair.draft2 = None
    assert got == expected
    steps, produced = [], 0  # (output tokens before the step, tokens it produced)
    for e in events:
        if isinstance(e, Verified) and e.verifier == "oracle":
            steps.append([produced, 0])
        elif isinstance(e, Token) and e.output:
            produced += 1
            steps[-1][1] += 1
    before = [n for where, n in steps if where < at]
    looped = [n for where, n in steps if where >= at + len(cycle) + 3]  # the loop has repeated: a copy begins
    assert sum(before) / len(before) < 1.2  # nothing to gain from a draft that knows nothing
    # deep within a few steps (the ramp is timed: in a full suite once 3, 4, 5, 6, 8 - the fourth step)
    first = looped.index(next(n for n in looped if n >= 6))
    assert first <= 3
    # and deep from then on (the last step stops at the token limit; a fast ramp can finish the loop in 4 steps)
    deep = looped[first:-1] or looped[first:]
    assert sum(deep) / len(deep) >= 6


def test_trees_beat_chains_in_tokens_per_oracle_forward(pair):
    chain, tree = Stats(), Stats()
    for prompt in prompts(4, seed=2):
        for e in run(pair, prompt, method="staged", max_new_tokens=40, tree_budget=4, tree_depth=4,
                     tree_branching=1, tree_width=1, tree_adaptive=False)[1]:
            chain.add(e)
        for e in run(pair, prompt, method="staged", max_new_tokens=40, tree_budget=24, tree_depth=4,
                     tree_branching=3, tree_width=6, tree_adaptive=False)[1]:
            tree.add(e)
    assert tree.tokens_per_oracle_forward > chain.tokens_per_oracle_forward


def test_staged_events_and_stop_reasons(pair):
    prompt = prompts(1, seed=4)[0]
    _, events = run(pair, prompt, method="staged", max_new_tokens=25, tree_adaptive=False)
    outputs = [e for e in events if isinstance(e, Token) and e.output]
    assert len(outputs) == 25 and events[-1] == Finished("length")
    assert any(isinstance(e, Token) and e.kind == ACCEPTED for e in events)
    assert any(isinstance(e, Token) and e.kind == REJECTED for e in events)


def test_a_prompt_read_in_pieces_still_carries_the_drafts_guesses(pair, monkeypatch):
    """The draft reads a long prompt in pieces: the last one carries the rows' guesses, which a sampled tree's
    groups are drawn with (they were lost, and the strategy failed)."""
    monkeypatch.setattr(runner_module, "CHUNK", 16)
    prompt = prompts(1, seed=5)[0] * 8
    got, _ = run(pair, prompt[:40], method="staged", max_new_tokens=12, temperature=1.0, seed=1,
                 sampling="rejection", tree_rule="sequoia", tree_adaptive=False)
    assert len(got) == 12


# --- the policy decides the shape, the grower and the step obey ------------------------------------------------

class Told(adapt.Policy):
    """A policy with fixed answers, which keeps the steps it is told of."""

    def __init__(self, speculate=True, chain=99, expand=99, price=None):
        super().__init__()
        self.answers, self.cost, self.steps = (speculate, chain, expand), price, []

    def speculate(self, cue=None, catch_up=0, remaining=None):
        return self.answers[0]

    def price(self, before):
        return self.cost

    def chain(self, worth, length, before, drafter):
        return min(length, self.answers[1])

    def expand(self, values, levels, planned, oracle_tail):
        return min(len(values), self.answers[2])

    def report(self, step):
        super().report(step)
        self.steps.append(step)


def grown(pair, policy):
    """One step's tree below a prompt, grown as `policy` says, with a perfect draft2 (the draft's own chain):
    (its growth, the prompt's length)."""
    models = Models(pair.oracle, pair.draft, DraftsOwnChain(pair.draft.model))
    settings = Decoding(method="staged", tree_budget=24, tree_depth=6, tree_branching=2, tree_width=4,
                        draft2_tokens=3)
    sampler = sampler_of(settings)
    prompt = prompts(1, seed=3)[0]
    pair.draft.reset()
    out = Output(list(prompt), 20, frozenset())
    grower = tree_module.Grower(models, out, settings, sampler, Draws.seeded(0), policy, rule="greedy",
                                budget=settings.tree_budget, max_depth=settings.tree_depth, price=policy.price(1))
    return grower.grow(), len(prompt)


def test_the_grower_grows_the_tree_the_policy_says(pair):
    free, n = grown(pair, Told())
    assert free.forwards[0][0] == n + 3 and free.guesses[:3] == [True] * 3  # the root's chain: all of draft2's
    assert len(free.forwards) > 2 and max(tokens for tokens, _ in free.forwards[1:]) > 4  # nodes and chains
    no_chains, _ = grown(pair, Told(chain=0, expand=1))
    assert no_chains.forwards[0][0] == n and not no_chains.guesses
    assert len(no_chains.forwards) > 2 and all(tokens == 1 for tokens, _ in no_chains.forwards[1:])
    short, _ = grown(pair, Told(chain=1, expand=2))
    assert short.forwards[0][0] == n + 1 and all(tokens <= 2 * 2 for tokens, _ in short.forwards[1:])
    assert len(grown(pair, Told(expand=0))[0].forwards) == 1  # the root's forward, then nothing worth running
    dear = Told(price=lambda nodes: 10.0 * nodes)  # no node is worth its slot in the oracle's forward
    assert len(grown(pair, dear)[0].forwards) == 1


def test_each_step_asks_the_policy_whether_to_speculate_and_reports_to_it_once(pair):
    prompt = prompts(1, seed=3)[0]
    expected, _ = run(pair, prompt, method="baseline", max_new_tokens=20)
    for speculate in (False, True):
        told = Told(speculate=speculate)
        pair.controllers = defaultdict(lambda: told)
        got, events = run(pair, prompt, method="staged", max_new_tokens=20)
        stats = Stats()
        for e in events:
            stats.add(e)
        assert got == expected and len(told.steps) == stats.oracle_forwards
        assert any(step.speculated for step in told.steps) == speculate == (stats.draft_forwards > 0)
        assert sum(len(step.drafts) for step in told.steps) == stats.draft_forwards


# --- sampling: exactly the oracle's distribution, whoever proposed the candidates ---------------------------

@pytest.fixture(scope="module")
def overlap_runners():
    oracle = tiny_vocab_model(11, 2, std=0.15)
    return oracle, Runner(oracle), Runner(noisy_copy(oracle, 1.0, 5))


@pytest.fixture
def overlap(overlap_runners):
    """An oracle over 5 tokens that is far from peaked, and a draft that shares its structure (a noisy copy):
    after the draft's favourite is rejected several tokens are still in play, so the sibling rules differ.
    At the prompt p = [.09 .17 .54 .16 .04], q = [.15 .07 .03 .74 .01]."""
    oracle, *runners = overlap_runners
    return oracle, Models(*runners)


class Cycle:
    """A deterministic draft2 over the 5 tokens: guesses that the draft sometimes keeps and often does not."""

    def propose(self, context, n):
        out, token = [], context[-1]
        for _ in range(n):
            token = (token + 2) % VOCAB
            out.append(token)
        return out


PROMPT, LENGTH, TRIALS = [1, 3], 3, 2000
TREE = dict(method="staged", tree_budget=12, tree_depth=3, tree_branching=3, tree_width=3, draft2_tokens=2,
            tree_adaptive=False)


def sample_staged(overlap, draft2, trials=TRIALS, **settings):
    oracle, models = overlap
    sampler = Sampler(**{k: settings[k] for k in ("temperature", "top_k", "top_p") if k in settings})
    expected = exact_distribution(oracle, PROMPT, LENGTH, sampler)
    models.draft2 = Cycle() if draft2 else None
    try:
        counts = sampled(models, PROMPT, LENGTH, trials, **{**TREE, **settings})
    finally:
        models.draft2 = None
    return chi_square_p_value(counts, expected, trials)


@pytest.mark.parametrize("settings", [
    dict(tree_rule="sequoia", temperature=1.0),
    dict(tree_rule="sequoia", temperature=0.8, top_k=3, top_p=0.9, draft2=False),
    dict(tree_rule="specinfer", temperature=1.0),
    dict(tree_rule="one-hot", temperature=1.0),
    dict(tree_rule="sequoia", temperature=1.0, tree_adaptive=True, tree_mass=0.8),
], ids=["sequoia", "sequoia-top-k-top-p", "specinfer", "one-hot", "sequoia-adaptive"])
def test_staged_sampling_follows_the_oracle_distribution(overlap, settings):
    settings = dict(settings)
    assert sample_staged(overlap, settings.pop("draft2", True), **settings) > 1e-4


def _specinfer_rule_for_sequoia_groups(monkeypatch):
    monkeypatch.setitem(tree_module.CHECK, "sequoia", "iid")


def _q_of_the_first_child(monkeypatch):  # q from the wrong node: the draft's distribution one level down
    monkeypatch.setattr(tree_module, "_proposal",
                        lambda tree, node: tree.q.get(tree.children(node)[0], tree.q[node]))


def _draft2_guess_not_checked(monkeypatch):  # wrong stage: draft2's guess taken as if the draft had drawn it
    monkeypatch.setattr(tree_module, "_keeps", lambda q, guess, has, draws: has)


def _q_of_draft2(monkeypatch):  # wrong stage: a draft2-proposed group verified with draft2's own distribution
    def proposal(tree, node):
        first = tree.nodes[tree.children(node)[0]]
        if first.stage != "draft2":
            return tree.q[node]
        q = torch.full_like(tree.q[node], 0.4 / (VOCAB - 1))
        q[first.token] = 0.6
        return q

    monkeypatch.setattr(tree_module, "_proposal", proposal)


def _groups_cut_by_drawn_values(monkeypatch):  # the best-scoring drawn child instead of the whole group
    def choose(self, budget, cost=None, calibration=None):
        order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].value, self.nodes[i].depth, i))
        return sorted(order[:1]), 0.0

    monkeypatch.setattr(tree_module.Tree, "choose", choose)


@pytest.mark.parametrize("bug,settings", [
    (_specinfer_rule_for_sequoia_groups, dict(tree_rule="sequoia")),
    (_q_of_the_first_child, dict(tree_rule="sequoia", trials=3000)),
    (_draft2_guess_not_checked, dict(tree_rule="sequoia", trials=1000)),
    (_q_of_draft2, dict(tree_rule="specinfer")),
    (_groups_cut_by_drawn_values, dict(tree_rule="sequoia", tree_budget=3, tree_depth=1, draft2=False)),
], ids=["specinfer-rule-for-sequoia", "q-wrong-node", "draft2-unchecked", "q-wrong-stage", "partial-group"])
def test_distribution_test_catches_a_wrong_q_or_rule(overlap, monkeypatch, bug, settings):
    """The tests above have the power to see each of these bugs."""
    settings = dict(settings)
    bug(monkeypatch)
    assert sample_staged(overlap, settings.pop("draft2", True), temperature=1.0, **settings) < 1e-6


@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
def test_every_drawn_group_is_verified_whole(pair, monkeypatch, rule):
    """Which sampled groups the oracle verifies is settled before they are drawn: a group once drawn is never
    dropped for the budget or for what other draws made of the tree (that choice would have seen its draws)."""
    seen = []
    real = tree_module._walk_sampled

    def walk(tree, chosen, *args):
        seen.append((tree, chosen))
        return real(tree, chosen, *args)

    monkeypatch.setattr(tree_module, "_walk_sampled", walk)
    pair.draft2 = PromptLookup()
    try:
        for prompt in prompts(3, seed=9):
            for adaptive in (False, True):
                run(pair, prompt, method="staged", max_new_tokens=30, temperature=1.0, seed=1, tree_rule=rule,
                    sampling="rejection", tree_budget=5, tree_depth=4, tree_branching=3, tree_width=4, tree_adaptive=adaptive)
    finally:
        pair.draft2 = None
    for tree, chosen in seen:
        assert sum(len(draws) for draws in tree.draws.values()) <= tree.budget
        for node in tree.draws:
            assert set(tree.children(node)) <= set(chosen), "a drawn group was cut"
    assert sum(len(tree.draws) > 1 for tree, _ in seen) > 10  # groups below the root's: the budget was contested


# --- draft2 models ------------------------------------------------------------------------------------


def test_katz_trigram_matches_hand_computed_values():
    # counts chosen so that Good-Turing discounts are usable for the bigram level (k = 1)
    streams = [[0, 1, 2], [0, 1, 3], [0, 1, 2], [4, 1, 2], [3, 3]]
    m = KatzTrigram.fit(streams, vocab_size=5, k=1)
    # bigrams: 01 x3, 12 x3, 13 x1, 41 x1, 33 x1 -> n1 = 3, n2 = 0 -> Good-Turing unusable -> d = 1
    np.testing.assert_allclose(m.d2, [1, 1])
    # unigram: add-one over counts [3, 4, 3, 3, 1] (14 tokens, V = 5)
    np.testing.assert_allclose(m.unigram, np.array([4, 5, 4, 4, 2]) / 19)
    # P(w | 1): seen 2 (x3), 3 (x1) -> 3/4, 1/4, nothing left for unseen words
    np.testing.assert_allclose(m.bigram_probs(1), [0, 0, 0.75, 0.25, 0])
    # P(w | 0 1): trigrams 012 x2, 013 x1 -> 2/3, 1/3
    np.testing.assert_allclose(m.probs(0, 1), [0, 0, 2 / 3, 1 / 3, 0])
    # unseen trigram context (2, 2) backs off to P(w | 2), an unseen bigram context -> unigram
    np.testing.assert_allclose(m.probs(2, 2), m.unigram)


def test_katz_discounts_and_backoff_weights():
    V = 20
    rng = np.random.default_rng(0)
    zipf = 1 / np.arange(1, V + 1)
    stream = rng.choice(V, size=5000, p=zipf / zipf.sum()).tolist()
    m = KatzTrigram.fit([stream], vocab_size=V, k=5)
    # Good-Turing by hand from the count-of-counts of the trigram counts (all usable for this corpus)
    n = np.bincount(m.tri_counts, minlength=8).astype(float)
    common = 6 * n[6] / n[1]
    for r in range(1, 6):
        assert m.d3[r] == pytest.approx(((r + 1) * n[r + 1] / (r * n[r]) - common) / (1 - common))
        assert m.d3[r] < 1
    for u in range(V):
        for v in range(V):
            p = m.probs(u, v)
            assert p.sum() == pytest.approx(1.0) and (p >= 0).all()
            # a seen trigram's probability is its discounted relative frequency
            keys = (u * V + v) * V + np.arange(V)
            idx = np.searchsorted(m.tri_keys, keys)
            seen = (idx < len(m.tri_keys)) & (m.tri_keys[np.minimum(idx, len(m.tri_keys) - 1)] == keys)
            if seen.any():
                counts = m.tri_counts[idx[seen]]
                d = np.where(counts <= 5, m.d3[np.minimum(counts, 5)], 1.0)
                if seen.all():  # nothing to back off to: the discounted estimates are renormalised
                    np.testing.assert_allclose(p, d * counts / (d * counts).sum())
                    continue
                np.testing.assert_allclose(p[seen], d * counts / counts.sum())
                # the left-over mass goes to unseen words in proportion to the bigram model
                lower = m.bigram_probs(v)
                alpha = (1 - p[seen].sum()) / (1 - lower[seen].sum())
                np.testing.assert_allclose(p[~seen], alpha * lower[~seen])


def test_trigram_file_round_trip_and_proposals(tmp_path):
    m = KatzTrigram.fit([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]], vocab_size=6)
    m.save(tmp_path / "tri.npz")
    loaded = KatzTrigram.load(tmp_path / "tri.npz")
    np.testing.assert_allclose(loaded.probs(1, 2), m.probs(1, 2))
    assert loaded.propose([1, 2], 4) == [3, 4, 1, 2]


def test_the_trigrams_top_is_its_distributions_argmax_and_its_chain_follows_it():
    V = 30
    rng = np.random.default_rng(1)
    zipf = 1 / np.arange(1, V + 1)
    m = KatzTrigram.fit([rng.choice(V, size=3000, p=zipf / zipf.sum()).tolist()], vocab_size=V)
    for u, v in rng.integers(0, V, size=(200, 2)).tolist():
        p = m.probs(u, v)
        assert m.top(u, v) == (int(np.argmax(p)), float(p.max()))
        assert m.top(u, v) == (int(np.argmax(p)), float(p.max()))  # remembered, the same
        order = sorted(range(V), key=lambda t: (-p[t], t))  # ties: the lower id
        assert [t for t, _ in m.tops(u, v)] == order[:2] and m.tops(u, v)[1][1] == float(p[order[1]])
    context = rng.integers(0, V, size=5).tolist()
    chain = m.chain(context, 6)
    assert [t for t, _ in chain] == m.propose(context, 6)
    u, v = context[-2:]
    for t, q in chain:
        assert (t, q) == m.top(u, v)
        u, v = v, t


def test_prompt_lookup_continues_the_latest_match():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([5, 1, 2, 9, 7, 1, 2, 8, 6, 1, 2], 2) == [8, 6]
    assert lookup.propose([1, 2, 3], 2) == []
    assert lookup.propose([4, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]  # a loop goes on looping
    assert lookup.propose([7, 1, 2, 5, 1, 2], 3) == [5, 1, 2]


def test_lookup_or_trigram_copies_where_the_text_repeats():
    trigram = KatzTrigram.fit([[1, 2, 3, 4, 5] * 4], vocab_size=10)
    both = LookupOrTrigram(trigram)
    # "7 8" occurred before, followed by "9 6": copied, then the trigram continues after the copy
    assert both.propose([7, 8, 9, 6, 1, 7, 8], 3) == [9, 6, 1]
    assert both.propose([7, 8, 9, 6, 1, 7, 8], 4)[:3] == [9, 6, 1]
    # no two-token match anywhere: the trigram's guess
    assert both.propose([0, 1, 2], 3) == trigram.propose([1, 2], 3) == [3, 4, 5]
    # a repeat copies on past the end of the text: a loop goes on looping
    assert both.propose([1, 2, 1, 2], 3) == [1, 2, 1]


def test_a_run_of_queued_plain_steps_reports_each_at_the_runs_mean_time(tiny_dir, monkeypatch):
    """Where forwards are queued (a GPU), a plain step's read-to-read time swings: its token may be done when
    read, or wait for two forwards. Reported so, the lower quartile that is plain decoding's speed read ten
    times the truth on an H200; the run's mean time a token is what a plain step costs."""
    from types import SimpleNamespace

    oracle, draft = load_pair(tiny_dir, "gpt2")
    models = Models(Runner(oracle), Runner(draft))
    models.oracle.queues = True
    monkeypatch.setattr(adapt.Controller, "speculate", lambda self, cue=None, catch_up=0, remaining=None: False)
    clock, gaps = [0.0], iter([0.0001, 0.0018] * 10**5)

    def tick():
        clock[0] += next(gaps)
        return clock[0]

    monkeypatch.setattr(tree_module, "time", SimpleNamespace(perf_counter=tick))
    run(models, list(range(1, 12)), method="staged", max_new_tokens=60, lookup=False)
    controller = next(iter(models.controllers.values()))
    recent = list(controller.plain)
    assert len(recent) == adapt.PLAIN_KEEP and max(recent) < 1.3 * min(recent)
