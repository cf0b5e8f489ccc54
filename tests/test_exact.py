"""Exactness to 1e-9: each method's output distribution, computed by enumerating every random choice it makes
(tests/exact.py), is the oracle's. A sampling test resolves a few tenths of a percent at best; these see any
bias at all.

The staged tests drive the real strategy code (trees grown, groups drawn, draft2's guesses checked, the
oracle's walk) on stand-in models over 4 tokens, and take the first step's tokens: a step is exact when what
it emits, continued by the oracle alone, is distributed as the oracle alone (every later step is another such
step, whatever the tree shape, so the whole completion is then exact). Each drafted row's group, which the
device draws for every row at once, is drawn there when the host reads it (exact.deferred_rows, exact by
independence); two tests hold that law to the device `_rows`, enumerated and sampled.

The enumeration assumes what the real primitives draw, and stand-ins replace the models and their cache: the
last tests sample the real ones, with enough draws to see a few percent (by default) or 1% (-m slow)."""

import copy
import itertools
from collections import Counter
from types import SimpleNamespace

import exact
import pytest
import torch
from exact import (
    StandIn,
    exhaust,
    extended,
    first_tokens,
    max_difference,
    oracle_distribution,
    table,
)
from helpers import long_context_pair, teacher_forced
from stats import biased, chi_square_p_value, deviation_p_value

from spec_cli.core.families import Skip
from spec_cli.decoding import adapt
from spec_cli.decoding import staged as tree_module
from spec_cli.decoding.chain import Models
from spec_cli.decoding.sampling import Draws, Sampler, verify_candidates
from spec_cli.exec import Runner

TOLERANCE = 1e-9

# --- the acceptance rules alone ------------------------------------------------------------------------------

_g = torch.Generator().manual_seed(0)
_logits = torch.randn(6, generator=_g, dtype=torch.float64)
PAIRS = {  # (p, q) over 6 tokens
    "spread": (torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03], dtype=torch.float64),
               torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10], dtype=torch.float64)),
    "peaked": (torch.softmax(3 * _logits, -1), torch.softmax(3 * _logits + 2 * torch.randn(6, generator=_g,
                                                                                           dtype=torch.float64), -1)),
    "top-k-top-p": (Sampler(0.8, top_k=4, top_p=0.85).probs(_logits),
                    Sampler(0.8, top_k=4, top_p=0.85).probs(_logits + torch.randn(6, generator=_g,
                                                                                  dtype=torch.float64))),
    "disjoint": (torch.tensor([0.40, 0.30, 0.30, 0.0, 0.0, 0.0], dtype=torch.float64),
                 torch.tensor([0.0, 0.10, 0.20, 0.30, 0.40, 0.0], dtype=torch.float64)),
}
RULES = {"iid": True, "without_replacement": False, "deterministic": None}  # rule -> drawn with replacement


def verified_token(p, q, rule, n, draws):
    """Candidates drawn from q as the rule assumes, verified, and the residual sampled if all are rejected."""
    if rule == "deterministic":
        candidates = torch.topk(q, n).indices.tolist()
    else:
        candidates = draws.sample_group(q, n, RULES[rule])
    index, residual = verify_candidates(p, candidates, rule, draws, q)
    return candidates[index] if index is not None else draws.sample(residual)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_rule_gives_exactly_p(pair, rule, n):
    p, q = PAIRS[pair]
    if RULES[rule] is False:
        n = min(n, int((q > 0).sum()))
    got = exhaust(lambda draws: verified_token(p, q, rule, n, draws))
    assert max_difference(got, {i: float(p[i]) for i in range(len(p)) if p[i] > 0}) < TOLERANCE


# --- a node's group: drawn exactly as its rule says, draft2's guess included ------------------------------------

def group_probability(q: list[float], draws: tuple[int, ...], replacement: bool) -> float:
    prob, left = 1.0, 1.0
    for x in draws:
        prob *= q[x] / left
        if not replacement:
            left -= q[x]
    return prob


@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
@pytest.mark.parametrize("guess", [None, 0, 2, 4])
def test_a_group_is_drawn_as_its_rule_says_whoever_guessed_first(rule, guess):
    """The first child is draft2's guess kept with probability q(guess), else the draft's token drawn from q
    without it: in all, a draw from q. The rest follow (without replacement for Sequoia)."""
    p, q = PAIRS["spread"]
    kept = {}

    def group(draws):
        tree = tree_module.Tree(rule, budget=3)
        guesses = torch.tensor([-1 if guess is None else guess])
        row = tree_module._rows(q[None], 3, rule, guesses, draws)[0]  # drawn on the device, then read
        child = tree_module._open(tree, tree_module.ROOT, q, row, 3, 1.0, adapt.Calibration(), guess)
        kept[tuple(tree.draws[tree_module.ROOT])] = child is not None
        return tuple(tree.draws[tree_module.ROOT])

    got = exhaust(group)
    replacement = rule == "specinfer"
    expected = {d: group_probability(q.tolist(), d, replacement)
                for d in itertools.product(range(6), repeat=3) if replacement or len(set(d)) == 3}
    assert max_difference(got, {d: w for d, w in expected.items() if w > 0}) < TOLERANCE
    if guess is not None:
        assert any(kept.values()) and not all(kept.values())


def read_rows(rows, q: torch.Tensor, rule: str) -> tuple:
    """Everything the host can read of each row: its tops, whether it kept draft2's guess, and its group (the
    draws that exist: sequoia has at most as many as q has tokens)."""
    out = []
    for row, q_row in zip(rows, q):
        n = min(len(row.top), int((q_row > 0).sum())) if rule == "sequoia" else len(row.top)
        out.append((tuple(row.top), tuple(row.tokens), row.kept, tuple(row.draws[:n]), tuple(row.probs[:n])))
    return tuple(out)


ROW_QS = {"spread": PAIRS["spread"][1], "top-k-top-p": PAIRS["top-k-top-p"][1], "disjoint": PAIRS["disjoint"][1]}


@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
@pytest.mark.parametrize("qs,guesses,branching", [(("spread",), (2,), 3), (("top-k-top-p",), (1,), 3),
                                                  (("disjoint",), (0,), 3), (("disjoint",), (4,), 3),
                                                  (("spread", "top-k-top-p"), (-1, 3), 2),
                                                  (("disjoint", "spread"), (3, 5), 2)])
def test_deferred_rows_are_drawn_as_the_device_rows_are(rule, qs, guesses, branching):
    """The staged enumerations draw each row's group when it is read (exact.deferred_rows): its law, rows
    together, is that of every row drawn at once on the device by tree._rows, both enumerated exactly."""
    q = torch.stack([ROW_QS[name] for name in qs])
    g = torch.tensor(guesses)
    device = exhaust(lambda draws: read_rows(tree_module._rows(q, branching, rule, g, draws), q, rule))
    deferred = exhaust(lambda draws: read_rows(exact.deferred_rows(q, branching, rule, g, draws), q, rule))
    assert max_difference(device, deferred) < TOLERANCE


@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
def test_real_device_rows_follow_the_deferred_law(rule):
    """tree._rows with torch's own draws (uniforms, multinomial, the exponential race), 12,000 rows of each
    kind in one call, against the exact law of exact.deferred_rows."""
    names, guesses, trials = ["spread", "top-k-top-p", "spread"], [-1, 1, 2], 12_000
    q = torch.stack([ROW_QS[name] for name in names]).repeat(trials, 1)
    g = torch.tensor(guesses).repeat(trials)
    rows = read_rows(tree_module._rows(q, 3, rule, g, Draws.seeded(0)), q, rule)
    for kind in range(len(names)):
        one = q[kind : kind + 1]
        law = exhaust(lambda draws: read_rows(exact.deferred_rows(one, 3, rule, g[kind : kind + 1], draws), one,
                                        rule)[0][2:4])
        counts = Counter(row[2:4] for row in rows[kind :: len(names)])
        assert chi_square_p_value(counts, law, trials) > 1e-4


# --- whole methods on stand-in models ----------------------------------------------------------------------

V, PROMPT = 4, [1, 2]


def stand_ins(kind):
    """(oracle logits, draft logits) over V tokens, by (second last, last) token: spread or peaked."""
    scale, noise = {"spread": (0.8, 1.0), "peaked": (2.5, 1.5)}[kind]
    oracle = table(V, scale, seed=1)
    return oracle, table(V, scale, seed=2, like=oracle, noise=noise)


class Cycle:
    """A deterministic draft2: guesses that the draft keeps now and then."""

    def propose(self, context, n):
        out, token = [], context[-1]
        for _ in range(n):
            token = (token + 1) % V
            out.append(token)
        return out


def step_distribution(kind, length=3, one_step=True, draft2=True, controllers=None, **settings):
    """(exact distribution of the first `length` tokens, the oracle's): from the first step's tokens
    continued by the oracle alone, or (`one_step` False) from the whole completion."""
    oracle, draft = stand_ins(kind)
    models = Models(StandIn(oracle, skipped=draft), StandIn(draft), Cycle() if draft2 else None,
                    self_skip=Skip.of([0], [0]))
    if controllers is not None:
        models.controllers = controllers
    settings = dict(dict(temperature=1.0, max_new_tokens=4, seed=0), **settings)
    sampler = Sampler(settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0))
    got = exhaust(lambda draws: first_tokens(models, PROMPT, length, one_step, draws, **settings), deferred=True)
    return extended(got, oracle, PROMPT, length, sampler), oracle_distribution(oracle, PROMPT, length, sampler)


WARPS = {"t1": dict(temperature=1.0), "top-k-top-p": dict(temperature=0.8, top_k=3, top_p=0.8),
         "top-p": dict(temperature=1.0, top_p=0.9)}  # top-p alone leaves wider groups to draw


@pytest.mark.parametrize("kind", ["spread", "peaked"])
@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("method,k", [("speculative", 1), ("speculative", 3), ("self", 2)])
def test_chains_give_the_oracle_distribution_exactly(kind, warp, method, k):
    got, expected = step_distribution(kind, method=method, draft_tokens=k, **WARPS[warp])
    assert max_difference(got, expected) < TOLERANCE


def test_a_whole_speculative_completion_is_exact():
    """Steps compose: the first three tokens over as many steps as they take."""
    got, expected = step_distribution("spread", one_step=False, method="speculative", draft_tokens=2, max_new_tokens=3)
    assert max_difference(got, expected) < TOLERANCE


TREE = dict(method="staged", tree_adaptive=False, tree_width=2, draft2_tokens=1)
TREES = {  # multi-level: which node the draft expands next, and what it draws there, follows earlier draws
    "sequoia": dict(tree_rule="sequoia", tree_budget=4, tree_depth=2, tree_branching=2),
    "sequoia-wide": dict(tree_rule="sequoia", tree_budget=5, tree_depth=3, tree_branching=3, tree_mass=0.9),
    "specinfer": dict(tree_rule="specinfer", tree_budget=4, tree_depth=2, tree_branching=2),
    "one-hot": dict(tree_rule="one-hot", tree_budget=10, tree_depth=3, tree_branching=3, tree_width=3,
                    draft2_tokens=2),
    # a budget below what the draft ran: the walk stops at nodes it expanded, whose children are not verified
    "one-hot-tight": dict(tree_rule="one-hot", tree_budget=2, tree_depth=3, tree_branching=2, tree_width=1),
}


@pytest.mark.parametrize("kind", ["spread", "peaked"])
@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("shape", TREES)
def test_staged_trees_give_the_oracle_distribution_exactly(kind, warp, shape):
    got, expected = step_distribution(kind, **{**TREE, **TREES[shape], **WARPS[warp]})
    assert max_difference(got, expected) < TOLERANCE


def test_a_whole_staged_completion_is_exact():
    got, expected = step_distribution("peaked", length=2, one_step=False, **TREE, tree_rule="sequoia",
                                      tree_budget=2, tree_depth=2, tree_branching=2)
    assert max_difference(got, expected) < TOLERANCE


def warmed_controller() -> adapt.Controller:
    """A controller that has measured this machine: speculation pays (100 tokens/s against 83), an oracle slot
    costs 0.3 ms, a draft token 0.5 ms: some groups are worth drawing, some are not, some find no budget left."""
    c = adapt.Controller()
    for n in adapt.EDGES[:8]:
        for _ in range(9):  # a full bucket: the step's own measurements do not move its median
            c.oracle.add(n, 0.010 + 0.0003 * n)
            c.draft.add(n, 0.002 + 0.0005 * n)
    c.spec_tokens, c.spec_seconds = 2.0, 0.020
    c.plain.extend([0.012] * adapt.PLAIN_KEEP)
    return c


@pytest.mark.parametrize("kind", ["spread", "peaked"])
@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
def test_the_adaptive_trees_settled_groups_give_the_oracle_distribution_exactly(kind, rule, monkeypatch):
    """Which groups are drawn is settled by worth and budget before drawing; some are left undrawn."""
    warmed, clock, trees = warmed_controller(), [0.0], []

    def tick():
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(tree_module, "time", SimpleNamespace(perf_counter=tick))  # timings: the same each replay
    real_grow = tree_module.Grower.grow

    def grow(self):
        growth = real_grow(self)
        trees.append(growth.tree)
        return growth

    class Warmed(dict):
        def __missing__(self, mode):  # each replay: the same measurements
            return copy.deepcopy(warmed)

    monkeypatch.setattr(tree_module.Grower, "grow", grow)
    got, expected = step_distribution(kind, method="staged", tree_adaptive=True, tree_rule=rule, tree_budget=4,
                                      tree_depth=3, tree_branching=2, tree_width=2, draft2_tokens=2,
                                      controllers=Warmed())
    assert max_difference(got, expected) < TOLERANCE
    undrawn = [t for t in trees if any(node not in t.draws for node in t.q)]
    assert undrawn and any(len(t.draws) > 1 for t in trees)  # groups left undrawn, and groups below the root


# --- what the enumeration assumes of the real primitives, and the real pipeline sampled ---------------------

@pytest.mark.parametrize("replacement", [False, True])
def test_real_group_draws_follow_the_enumerations_model(replacement):
    """torch.multinomial without replacement draws in sequence from what is left (the enumeration's model):
    50,000 real groups of 3, as tree.py draws them, against the exact probabilities of all ordered groups."""
    q = PAIRS["spread"][1].float()
    draws = Draws.seeded(0)
    trials = 50_000
    counts = Counter(tuple(draws.sample_group(q, 3, replacement)) for _ in range(trials))
    expected = {d: group_probability(q.tolist(), d, replacement)
                for d in itertools.product(range(6), repeat=3) if replacement or len(set(d)) == 3}
    assert chi_square_p_value(counts, expected, trials) > 1e-4


class Skip2:
    """draft2 over the 5 tokens of the long-context models: a guess two tokens on."""

    def propose(self, context, n):
        out, token = [], context[-1]
        for _ in range(n):
            token = (token + 2) % 5
            out.append(token)
        return out


LONG = dict(method="staged", temperature=1.0, tree_rule="sequoia", tree_budget=12, tree_depth=3, tree_branching=3,
            tree_width=3, draft2_tokens=2, tree_adaptive=False)


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
@pytest.mark.parametrize("tokens,bias", [(8_000, 0.05), pytest.param(100_000, 0.01, marks=pytest.mark.slow)],
                         ids=["8k", "100k"])
def test_the_real_pipeline_samples_the_oracle_over_many_tokens(tokens, bias, sampling):
    """Real models, runner, trees, draft2 and random stream: long completions, each token tested against the
    oracle's distribution given the text before it (one teacher-forced forward). The same statistic on
    vectorised draws from the same distributions with `bias` moved flags them: 5% in 8,000 tokens, 1% in
    100,000 (-m slow; a 0.5% bias is not seen there)."""
    oracle, draft = long_context_pair()
    models = Models(Runner(oracle), Runner(draft), Skip2())
    sampler = Sampler(LONG["temperature"])
    drawn, ps, _ = teacher_forced(models, oracle, sampler, tokens, sampling=sampling, **LONG)
    assert deviation_p_value(drawn, ps) > 1e-4
    g = torch.Generator().manual_seed(1)
    assert deviation_p_value(torch.multinomial(ps, 1, generator=g)[:, 0], ps) > 1e-4  # the statistic is calibrated
    assert deviation_p_value(torch.multinomial(biased(ps, bias), 1, generator=g)[:, 0], ps) < 1e-6
