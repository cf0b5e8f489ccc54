"""Guesses copied from the text, verified by the oracle with no draft model (spec_cli/lookup.py, tree.py's
lookup steps): the index against brute force, greedy identity with baseline on real models, and the exact
output distribution when sampling (tests/exact.py), with the power to see a guess accepted with the wrong
probability."""

import copy
import inspect
import random
from collections import defaultdict
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from conftest import load_pair
from exact import (
    StandIn,
    exhaust,
    extended,
    first_tokens,
    max_difference,
    oracle_distribution,
    table,
)
from helpers import long_context_pair, prompts, run, teacher_forced
from stats import biased, deviation_p_value

from spec_cli.core.events import ACCEPTED, REJECTED, Stats, Token
from spec_cli.decoding import accept, adapt
from spec_cli.decoding import staged as tree_module
from spec_cli.decoding.chain import Models
from spec_cli.decoding.sampling import Sampler
from spec_cli.draft2.lookup import LONGEST, MATCHED, ROOT, SOURCES, Index
from spec_cli.draft2.ngram import KatzTrigram, LookupOrTrigram, PromptLookup
from spec_cli.exec import Runner

TOLERANCE = 1e-9


# --- the index ------------------------------------------------------------------------------------------------

def brute_match(text):
    """The longest n-gram ending the text that occurred before (with a token after it), and the positions
    after its latest occurrences, latest first."""
    for n in range(min(LONGEST, len(text) - 1), 0, -1):
        after = [p for p in range(n, len(text)) if text[p - n : p] == text[-n:]]
        if after:
            return n, after[-SOURCES:][::-1]
    return 0, []


def brute_paths(text, depth):
    """Every occurrence's continuation, `depth` tokens (a copy reaching the end copies on what it copied), and
    how far back the text before it matches the text's end (at most MATCHED)."""
    n, after = brute_match(text)
    out, lengths = [], []
    for p in after:
        copied = list(text[p : p + depth])
        while len(copied) < depth:
            copied.append(copied[len(copied) - (len(text) - p)])
        out.append(copied)
        lengths.append(max(m for m in range(n, min(MATCHED, p) + 1) if text[p - m : p] == text[len(text) - m :]))
    return n, out, lengths


def test_the_index_kept_up_to_date_finds_what_brute_force_finds():
    rng = random.Random(0)
    for _ in range(30):
        index, text = Index(), [rng.randrange(5) for _ in range(rng.randint(1, 4))]
        for _ in range(40):
            text += [rng.randrange(5) for _ in range(rng.choice([1, 1, 3]))]
            index.extend(text)
            assert index.match(text) == brute_match(text), text
            assert index.repeating(text) == bool(PromptLookup(3, 3).propose(text, 1)), text


def test_the_trie_holds_each_occurrences_continuation_with_its_share():
    rng = random.Random(1)
    for _ in range(200):
        text = [rng.randrange(4) for _ in range(rng.randint(2, 40))]
        index = Index()
        index.extend(text)
        depth = rng.randint(1, 6)
        n, paths, lengths = brute_paths(text, depth)
        guesses = index.guess(text, depth, branches=99, most=10_000)
        assert bool(guesses) == bool(n)
        full = {}  # each guess's path of tokens from the root
        for i, g in enumerate(guesses):
            assert g.parent < i  # parents first
            full[i] = (full[g.parent] if g.parent != ROOT else ()) + (g.token,)
            longest = max(m for p, m in zip(paths, lengths) if p[: len(full[i])] == list(full[i]))
            assert g.match == longest + len(full[i]) - 1
            through = sum(p[: len(full[i])] == list(full[i]) for p in paths)
            reached = sum(p[: len(full[i]) - 1] == list(full[i][:-1]) for p in paths)
            assert g.share == through / reached
        assert set(full.values()) == {tuple(p[:k]) for p in paths for k in range(1, depth + 1)}
        for i, g in enumerate(guesses):  # siblings by rank: the most shared first, then the latest
            siblings = [h for h in guesses if h.parent == g.parent]
            assert [h.rank for h in siblings] == list(range(len(siblings)))
            assert [h.share for h in siblings] == sorted((h.share for h in siblings), reverse=True)


def test_branches_and_most_cut_the_trie_to_its_best():
    text = [7, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]  # "1 2" went on 3 9, 3 9, 4 5: two branches
    index = Index()
    index.extend(text)
    guesses = index.guess(text, 3, branches=1, most=99)
    assert [g.token for g in guesses] == [3, 9, 1]  # the most shared continuation alone
    assert guesses[0].share == pytest.approx(2 / 3) and guesses[1].share == 1.0
    both = index.guess(text, 3, branches=2, most=99)
    assert [(g.token, g.parent, g.rank) for g in both[:2]] == [(3, ROOT, 0), (4, ROOT, 1)]
    assert len(index.guess(text, 3, branches=2, most=3)) == 3


def test_a_copy_reaching_the_end_of_the_text_loops():
    text = [5, 1, 2, 1, 2]
    index = Index()
    index.extend(text)
    assert [g.token for g in index.guess(text, 5, branches=1, most=99)] == [1, 2, 1, 2, 1]


# --- staged with no draft: the lookup's guesses, verified ------------------------------------------------------

@pytest.fixture(scope="module", params=["gpt2", "llama"])
def oracle_runner(request, tiny_dir):
    oracle, _ = load_pair(tiny_dir, request.param)
    return Runner(oracle)


def repetitive(seed):
    """Prompts whose text repeats (a block and its near copy), so the lookup has matches to offer."""
    out = []
    for block in prompts(3, seed=seed):
        copy_ = list(block)
        if len(copy_) > 2:
            copy_[len(copy_) // 2] = 5
        out.append(block + [9] + copy_ + [9] + block[:3])
    return out


def steps(events):
    stats = Stats()
    for e in events:
        stats.add(e)
    return stats


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_lookup_alone_is_token_identical_to_baseline(oracle_runner, adaptive):
    models = Models(oracle_runner)
    proposed = 0
    for prompt in repetitive(seed=3):
        expected, _ = run(models, prompt, method="baseline", max_new_tokens=40)
        for budget, depth, branching in ((16, 8, 4), (4, 2, 1), (1, 1, 1)):
            got, events = run(models, prompt, method="staged", max_new_tokens=40, tree_budget=budget,
                              tree_depth=depth, tree_branching=branching, tree_adaptive=adaptive)
            assert got == expected, (prompt, budget, depth, branching)
            stats = steps(events)
            assert stats.draft_forwards == 0
            proposed += stats.proposed.get("oracle", 0)
    assert proposed > 0


def test_chains_and_plain_steps_go_to_the_oracle_as_chains_and_trees_as_trees(oracle_runner, monkeypatch):
    """A verify whose nodes make one chain (branching 1: every lookup tree is one) and a plain step after it
    reach the runner's forward with no tree layout (its cheaper path: no ancestry uploaded), the output still
    baseline's; with branching, a forward carries a layout exactly when its nodes branch."""
    models = Models(oracle_runner)
    seen = []  # per oracle forward: whether its parents branched, and whether it ran with a layout
    forward, run_ = oracle_runner.forward, oracle_runner._run

    def spied_forward(tokens, commit=0, parents=None, **kwargs):
        first = oracle_runner.length + commit
        seen.append([parents is not None and any(p != (first + k - 1 if k else -1) for k, p in enumerate(parents))])
        return forward(tokens, commit=commit, parents=parents, **kwargs)

    def spied_run(ids, host, start, layout, *args):
        seen[-1].append(layout is not None)
        return run_(ids, host, start, layout, *args)

    monkeypatch.setattr(oracle_runner, "forward", spied_forward)
    monkeypatch.setattr(oracle_runner, "_run", spied_run)
    for prompt in repetitive(seed=3):
        expected, _ = run(models, prompt, method="baseline", max_new_tokens=40)
        seen.clear()
        got, events = run(models, prompt, method="staged", max_new_tokens=40, tree_branching=1,
                          tree_adaptive=False)
        assert got == expected and steps(events).proposed.get("oracle", 0) > 0
        assert seen and all(laid_out is False for _, laid_out in seen), seen
        seen.clear()
        got, _ = run(models, prompt, method="staged", max_new_tokens=40, tree_branching=4, tree_adaptive=False)
        assert got == expected
        assert all(branched == laid_out for branched, laid_out in seen), seen  # (a layout only for real trees)


def test_coupled_sampling_with_lookup_alone_gives_baseline_text(oracle_runner):
    models = Models(oracle_runner)
    for prompt in repetitive(seed=4):
        for seed in (0, 1):
            settings = dict(max_new_tokens=30, temperature=0.9, top_k=20, seed=seed)
            expected, _ = run(models, prompt, method="baseline", **settings)
            got, _ = run(models, prompt, method="staged", **settings)
            assert got == expected


@contextmanager
def looping(runner, cycle=(11, 12, 13, 14, 15)):
    """The runner's model fallen into a loop: after a token of `cycle` comes the next one (after any other, the
    first), by a bias of 100 on its logits."""
    real = runner.forward

    def forward(tokens, *args, **kwargs):
        result = real(tokens, *args, **kwargs)
        ids = torch.as_tensor(tokens)[-result.logits.shape[0]:]
        nexts = torch.tensor([cycle[(cycle.index(int(t)) + 1) % len(cycle)] if int(t) in cycle else cycle[0]
                              for t in ids])
        bias = torch.zeros_like(result.logits)
        bias[torch.arange(len(ids)), nexts] = 100.0
        return result._replace(logits=result.logits + bias)

    runner.forward = forward
    try:
        yield
    finally:
        del runner.forward


def test_a_loop_is_copied_many_tokens_a_forward(oracle_runner):
    """An oracle that has fallen into a loop: the lookup copies it, one forward verifying many tokens."""
    models = Models(oracle_runner)
    with looping(oracle_runner):
        expected, _ = run(models, [3, 4], method="baseline", max_new_tokens=60)
        got, events = run(models, [3, 4], method="staged", max_new_tokens=60)
    assert got == expected
    assert steps(events).oracle_forwards <= 15
    assert steps(events).by_stage["lookup"] >= 40


def test_the_lookup_is_grafted_onto_the_drafts_tree_where_the_draft_foresees_otherwise():
    tree = tree_module.Tree("greedy")
    seven = tree.add(7, ROOT, 0.7, 0, 0.6)
    tree.add(8, ROOT, 0.2, 1, 0.2)
    nine = tree.add(9, seven, 0.9, 0, 0.5)
    text = [1, 2, 3, 7, 9, 4, 6, 1, 2, 3, 5, 0, 1, 2, 3]  # "1 2 3" went on with 5 (latest), then 7 9 4
    index = Index()
    index.extend(text)
    growth = tree_module.Growth(tree)
    calibration = adapt.Calibration()
    tree_module._graft(growth, index, text, 4, 4, calibration)
    pairs = [(node.parent, node.token) for node in tree.nodes]
    assert len(pairs) == len(set(pairs))  # what the draft proposed is not proposed again
    added = tree.nodes[3:]
    assert added and all(node.stage == "lookup" and node.match > 0 for node in added)
    assert (nine, 4) in pairs and (ROOT, 5) in pairs  # below the draft's path, and beside its children
    five = pairs.index((ROOT, 5))
    assert tree.nodes[five].value <= 1.0 - 0.6 - 0.2 + 1e-9  # no more than the draft's children leave
    four = pairs.index((nine, 4))
    assert 0 < tree.nodes[four].value <= tree.nodes[nine].value
    for node in added:
        assert node.depth == tree.depth(node.parent) + 1 and node.value <= tree.value(node.parent) + 1e-9
    chain = tree_module.Tree("greedy")  # one child a node (trees verified as chains): the chain goes on, no more
    nine = chain.add(9, chain.add(7, ROOT, 0.7, 0, 0.6), 0.9, 0, 0.5)
    tree_module._graft(tree_module.Growth(chain), index, text, 4, 1, calibration)
    assert len(chain.nodes) == 2  # (the lookup's 5 would branch at the root: left out, and all below it)
    again = [1, 2, 3, 7, 9, 4, 6, 1, 2, 3]
    index = Index()
    index.extend(again)
    tree_module._graft(tree_module.Growth(chain), index, again, 4, 1, calibration)
    assert len(chain.nodes) > 2 and chain.nodes[2].parent == nine
    assert all(len(chain.children(node)) <= 1 for node in [ROOT, *range(len(chain.nodes))])


def test_a_draft_that_leaves_a_loop_still_has_the_oracle_copy_it(oracle_runner, tiny_dir):
    """The oracle has fallen into a loop its draft does not foresee: the lookup's guesses, grafted onto the
    draft's trees, are copied many tokens a forward while the draft speculates, and the text is baseline's."""
    _, draft = load_pair(tiny_dir, "gpt2" if oracle_runner.model.config.model_type == "gpt2" else "llama")
    models = Models(oracle_runner, Runner(draft), draft2=PromptLookup())
    with looping(oracle_runner):
        expected, _ = run(models, [3, 4], method="baseline", max_new_tokens=60)
        got, events = run(models, [3, 4], method="staged", max_new_tokens=60, tree_adaptive=False)
    assert got == expected
    stats = steps(events)
    assert stats.draft_forwards > 0 and stats.by_stage["lookup"] >= 30 and stats.oracle_forwards <= 20


def test_the_policy_prices_lookup_guesses_and_learns_from_them(oracle_runner):
    """Each step reports the lookup's guesses the oracle judged; a policy that prices every node out gets
    plain steps, whose looks at the guesses it offered still teach the calibration."""
    models = Models(oracle_runner)
    told = []

    class Dear(adapt.Policy):
        def price(self, before):
            return lambda n: 10.0 * n

        def report(self, step):
            super().report(step)
            told.append(step)

    models.controllers = defaultdict(Dear)
    prompt = repetitive(seed=3)[0]
    expected, _ = run(models, prompt, method="baseline", max_new_tokens=30)
    got, events = run(models, prompt, method="staged", max_new_tokens=30)
    assert got == expected and steps(events).proposed.get("oracle", 0) == 0
    assert len(told) == steps(events).oracle_forwards and not any(step.speculated for step in told)
    assert sum(len(step.lookups) for step in told) > 0 and all(step.verified == 0 for step in told)


def test_staged_without_a_draft_or_lookup_says_so(oracle_runner):
    from spec_cli.core.errors import SpecError

    with pytest.raises(SpecError, match="no-lookup"):
        run(Models(oracle_runner), [1, 2, 3], method="staged", lookup=False, max_new_tokens=4)


# --- a trigram's guesses beside the lookup's, on steps without a draft ------------------------------------------------

def oracles_own(models, prompts_, n):
    """The oracle's greedy text after each prompt, with every third token changed: a trigram fitted on it
    guesses right often and wrong sometimes."""
    out = []
    for prompt in prompts_:
        text, _ = run(models, prompt, method="baseline", max_new_tokens=n)
        out.append(prompt + [t if k % 3 else (t + 7) % 300 for k, t in enumerate(text)])
    return out


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_trigrams_guesses_go_to_the_oracle_without_a_draft_and_the_text_stays_baselines(oracle_runner, adaptive):
    models = Models(oracle_runner)
    texts = prompts(4, seed=11)
    models.draft2 = LookupOrTrigram(KatzTrigram.fit(oracles_own(models, texts, 40), vocab_size=300))
    judged = {ACCEPTED: 0, REJECTED: 0}
    for prompt in texts:
        expected, _ = run(models, prompt, method="baseline", max_new_tokens=40)
        got, events = run(models, prompt, method="staged", max_new_tokens=40, tree_adaptive=adaptive)
        assert got == expected, prompt
        assert steps(events).draft_forwards == 0
        for e in events:
            if isinstance(e, Token) and e.stage == "trigram":
                judged[e.kind] += 1
    if not adaptive:  # (the controller may price them all out on so short a text)
        assert judged[ACCEPTED] > 10 and judged[REJECTED] > 0, judged


def test_a_trigram_guess_is_worth_its_calibrated_chance_times_its_parents_and_what_the_lookup_left():
    tree = tree_module.Tree("greedy")
    growth = tree_module.Growth(tree)
    first = tree.add(7, tree_module.ROOT, 0.5, 0, 0.6)  # the lookup's guess
    tree.nodes[first].stage, tree.nodes[first].match = "lookup", 3
    trigram = KatzTrigram.fit([[1, 2, 8, 9, 4]] * 3 + [[1, 2, 4, 9]], vocab_size=10)
    calibration = adapt.Calibration()
    tree_module._trigram(growth, trigram, [1, 2], 3, calibration)
    chain = trigram.chain([1, 2], 3)
    assert [t for t, _ in chain] == [8, 9, 4]
    second, third, fourth = range(1, 4)
    assert [tree.nodes[i].token for i in (second, third, fourth)] == [8, 9, 4]
    assert [tree.nodes[i].parent for i in (second, third, fourth)] == [tree_module.ROOT, second, third]
    assert all(tree.nodes[i].stage == "trigram" for i in (second, third, fourth))
    expected = 0.4 * calibration.trigram(chain[0][1], 1)  # what the lookup's guess left, then its own chance
    assert tree.nodes[second].value == pytest.approx(expected)
    expected *= calibration.trigram(chain[1][1], 0)
    assert tree.nodes[third].value == pytest.approx(expected)
    (runner_up, p), = trigram.tops(1, 2)[1:]  # the next likeliest first token, beside the chain's first
    assert runner_up == 4 and 0 < p < chain[0][1] and len(tree.nodes) == 5
    assert (tree.nodes[4].token, tree.nodes[4].parent, tree.nodes[4].rank) == (4, tree_module.ROOT, 2)
    assert tree.nodes[4].value == pytest.approx((1 - 0.6 - tree.nodes[second].value) * calibration.trigram(p, 2))
    chosen, _ = tree.choose(4)
    assert all(tree.nodes[i].parent in chosen or tree.nodes[i].parent == tree_module.ROOT for i in chosen)
    growth = tree_module.Growth(tree_module.Tree("greedy"))  # where the trigram agrees with the lookup, it follows
    agreed = growth.tree.add(8, tree_module.ROOT, 0.5, 0, 0.6)
    tree_module._trigram(growth, trigram, [1, 2], 2, calibration)
    assert [(n.token, n.parent) for n in growth.tree.nodes] == [(8, tree_module.ROOT), (9, agreed),
                                                                 (4, tree_module.ROOT)]
    never = KatzTrigram.fit([[1, 2, 8]] * 6, vocab_size=10)  # after "1 2" nothing but 8: no runner-up worth a row
    assert never.tops(1, 2)[1][1] == 0.0
    growth = tree_module.Growth(tree_module.Tree("greedy"))
    tree_module._trigram(growth, never, [1, 2], 1, calibration)
    assert [n.token for n in growth.tree.nodes] == [8]


def test_the_oracles_judgements_of_trigram_guesses_teach_their_calibration(oracle_runner):
    models = Models(oracle_runner)
    told = []

    class Told(adapt.Policy):
        def report(self, step):
            super().report(step)
            told.append(step)

    texts = prompts(3, seed=12)
    models.draft2 = LookupOrTrigram(KatzTrigram.fit(oracles_own(models, texts, 30), vocab_size=300))
    models.controllers = defaultdict(Told)
    for prompt in texts:
        run(models, prompt, method="staged", max_new_tokens=30)
    judged = [j for step in told for j in step.trigrams]
    assert any(accepted for _, _, accepted in judged) and not all(accepted for _, _, accepted in judged)
    calibration = next(iter(models.controllers.values())).calibration
    fresh = adapt.Calibration()
    learned = [(p, rank) for p, rank, _ in judged]
    assert any(calibration.trigram(p, rank) != fresh.trigram(p, rank) for p, rank in learned)
    assert sum(r.tries for row in calibration.trigrams for r in row) == pytest.approx(
        sum(r.tries for row in fresh.trigrams for r in row) + len(judged))


# --- sampling: exactly the oracle's distribution -----------------------------------------------------------------

V = 4
PROMPT = [1, 2, 3, 1, 2, 0, 1, 2]  # "1 2" went on with 3 and 0: the lookup offers two branches


def lookup_distribution(kind, length=3, one_step=True, controllers=None, draft2=None, **settings):
    scale = {"spread": 0.8, "peaked": 2.5}[kind]
    oracle = table(V, scale, seed=1)
    models = Models(StandIn(oracle), draft2=draft2)
    if controllers is not None:
        models.controllers = controllers
    settings = dict(dict(method="staged", temperature=1.0, max_new_tokens=4, seed=0, tree_adaptive=False),
                    **settings)
    sampler = Sampler(settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0))
    got = exhaust(lambda draws: first_tokens(models, PROMPT, length, one_step, draws, **settings))
    return extended(got, oracle, PROMPT, length, sampler), oracle_distribution(oracle, PROMPT, length, sampler)


SHAPES = {"chain": dict(tree_branching=1, tree_budget=3), "tree": dict(tree_branching=2, tree_budget=6),
          "one": dict(tree_branching=2, tree_budget=1)}
WARPS = {"t1": dict(temperature=1.0), "top-k-top-p": dict(temperature=0.8, top_k=3, top_p=0.8)}


@pytest.mark.parametrize("kind", ["spread", "peaked"])
@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_lookup_trees_give_the_oracle_distribution_exactly(kind, warp, shape):
    got, expected = lookup_distribution(kind, **SHAPES[shape], **WARPS[warp])
    assert max_difference(got, expected) < TOLERANCE


# a trigram that goes on "1 2" with 1 (the lookup: 3 or 0), and after that with 3, then 2: siblings and chains
TRIGRAM = KatzTrigram.fit([[1, 2, 1, 3, 2, 0]] * 4 + [[2, 1, 3, 2, 1, 3]] * 2, vocab_size=V)


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_trees_with_a_trigrams_guesses_give_the_oracle_distribution_exactly(warp, shape, monkeypatch):
    verified = []
    real = tree_module._verify

    def verify(oracle, tree, chosen, *args, **kwargs):
        verified.extend(tree.nodes[i].stage for i in chosen)
        return real(oracle, tree, chosen, *args, **kwargs)

    monkeypatch.setattr(tree_module, "_verify", verify)
    got, expected = lookup_distribution("spread", draft2=LookupOrTrigram(TRIGRAM), **SHAPES[shape], **WARPS[warp])
    assert max_difference(got, expected) < TOLERANCE
    assert "trigram" in verified and "lookup" in verified


def test_a_whole_lookup_completion_is_exact():
    """Steps compose: each step's guesses come from the text the steps before it chose."""
    got, expected = lookup_distribution("peaked", one_step=False, tree_branching=2, tree_budget=4, max_new_tokens=3)
    assert max_difference(got, expected) < TOLERANCE


def test_the_adaptive_lookup_steps_are_exact(monkeypatch):
    """The measuring controller prices the guesses (some verified, some not) and learns from every step."""
    warmed, clock = adapt.Controller(), [0.0]
    for n in adapt.EDGES[:8]:
        for _ in range(9):
            warmed.oracle.add(n, 0.010 + 0.002 * n)
    warmed.plain.extend([0.012] * adapt.PLAIN_KEEP)

    def tick():
        clock[0] += 0.001
        return clock[0]

    class Warmed(dict):
        def __missing__(self, mode):  # each replay: the same measurements
            return copy.deepcopy(warmed)

    monkeypatch.setattr(tree_module, "time", SimpleNamespace(perf_counter=tick))
    verified = []
    real = tree_module._verify

    def verify(oracle, tree, chosen, *args, **kwargs):
        verified.append((len(tree.nodes), len(chosen)))
        return real(oracle, tree, chosen, *args, **kwargs)

    monkeypatch.setattr(tree_module, "_verify", verify)
    got, expected = lookup_distribution("spread", one_step=False, tree_adaptive=True, tree_branching=2,
                                        tree_budget=4, max_new_tokens=3, controllers=Warmed())
    assert max_difference(got, expected) < TOLERANCE
    assert any(0 < chosen < nodes for nodes, chosen in verified)  # some guesses priced out


def _mutant(old: str, new: str):
    """accept.tree_walk with one line changed."""
    source = inspect.getsource(accept.tree_walk)
    assert old in source
    namespace = dict(vars(accept))
    exec(source.replace(old, new), namespace)
    return namespace["tree_walk"]


BUGS = {  # a guess accepted a little too often; a refused guess left in what the oracle's token is drawn from
    "accepted-too-often": ("ratio = p[x]", "ratio = (1.05 * p[x]).clamp(max=1.0)"),
    "refused-guess-kept": ("left = _normalised(p.scatter(0, x[None], 0.0), p)", "left = p"),
}


@pytest.mark.parametrize("bug", BUGS)
def test_the_exact_test_sees_a_guess_accepted_with_the_wrong_probability(monkeypatch, bug):
    monkeypatch.setattr(accept, "tree_walk", _mutant(*BUGS[bug]))
    got, expected = lookup_distribution("spread", **SHAPES["tree"])
    assert max_difference(got, expected) > 1e-4


# --- the real pipeline, sampled ----------------------------------------------------------------------------------

def test_lookup_alone_samples_the_oracle_over_many_tokens():
    """Real runner and random stream, rejection sampling: a 5-token oracle's text repeats all the time, so
    nearly every step verifies guesses; each token is tested against the oracle given the text before it."""
    oracle, _ = long_context_pair()
    models = Models(Runner(oracle))
    sampler = Sampler(1.0)
    drawn, ps, completions = teacher_forced(models, oracle, sampler, 6_000, method="staged", temperature=1.0,
                                            sampling="rejection", tree_budget=8, tree_branching=2,
                                            tree_adaptive=False)
    proposed = sum(steps(events).proposed.get("oracle", 0) for events in completions)
    assert proposed > 2_000
    assert deviation_p_value(drawn, ps) > 1e-4
    g = torch.Generator().manual_seed(1)
    assert deviation_p_value(torch.multinomial(biased(ps, 0.05), 1, generator=g)[:, 0], ps) < 1e-6
