"""Staged speculative decoding (Spector & Re 2023): a tree of draft candidates verified in one oracle pass,
with a second stage (draft2) that speculates for the draft.

Each oracle step:
1. The draft grows a tree under the last committed token. Every draft forward also carries draft2's guessed
   chain below the node it extends, and the draft verifies that chain in the same forward, as speculative
   decoding one stage down: greedily (draft2's guess is kept while it is the draft's own top token) or,
   when sampling, with Leviathan's rule (draft2 guesses deterministically, so its guess x is kept with
   probability q(x), else the draft's token is drawn from q with x removed), so every kept token is exactly
   the draft's own choice and a deep branch costs one draft forward instead of one per level.
2. Every node the draft runs gets a group of children from the draft's distribution q there: the branch
   draft2 found first, then its siblings, as many as it takes to cover `tree_mass` of q (at most
   `tree_branching`): the draft's top tokens when greedy or with the one-hot rule, draws without replacement
   (Sequoia) or i.i.d. draws (SpecInfer) when sampling with those rules.
   In a greedy tree (greedy, or coupled sampling), the lookup's guesses (below) are then grafted on where the
   draft did not propose them (`_graft`): what the text repeats reaches the oracle even where the draft
   foresees otherwise.
3. Nodes are worth the probability that the oracle accepts the path to them, from the draft's probabilities
   calibrated by what the oracle accepted so far (EAGLE-2's ranking, made accurate). The best nodes go to the
   oracle in one forward. Drawn (sampled) groups are different: whether one is verified is decided when the
   draft runs its parent, before it is drawn (budget and worth known then), and every drawn group is
   verified whole; a choice made later would have seen its draws, directly or through the nodes they led
   the draft to expand, and would bias the output.
4. Walking down from the root, the oracle accepts a child or supplies its own token: greedy follows its
   argmax; sampling tests the children in draw order against the draft's distribution at their parent
   (whoever proposed them) with the rule that matches how they were drawn, so the output is exactly a
   sample of the oracle's distribution.
5. Both caches keep the accepted path's entries (gathered) and drop the rest.

A step the draft does not run in (the policy's choice, or there is no draft model) is a lookup step: the tree is
what followed the text's latest matches (`spec_cli.draft2.lookup`: prompt lookup over the prompt and everything
generated, merged into a trie), draft2's trigram's greedy chain where draft2 has one, and where heads were fitted
on the oracle (`spec_cli.draft2.heads`, a model alone) their guesses from its own last state, with no forward of a
model, each guess worth the calibrated chance that the oracle accepts the path to it; the oracle verifies those
worth their price (none: a plain step). A guess is deterministic, so sampling verifies it by the one-hot rule
(accept x with probability p(x), else draw from p with x removed), and greedy while it is the oracle's argmax.

This module is the mechanism: the tree, the draft's growing it (`Grower`), the lookup's (`_guesses`) and the
oracle's walk down it. Every choice of shape is a question to an `adapt.Policy`, told of each step once, at its
end. With `tree_adaptive` (the default) it is the measuring `adapt.Controller`: the draft stops expanding when
another forward would add fewer tokens per second than the recent rate, the oracle gets only the nodes worth
their cost on this machine, draft2's chains are as long as they pay, and when speculating is slower than the
oracle alone the steps are lookup steps, with a probe now and then; otherwise the settings' caps stand as they
are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from spec_cli.core.events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    REJECTED,
    Event,
    Token,
    Verified,
)
from spec_cli.core.settings import Decoding
from spec_cli.decoding import accept, adapt
from spec_cli.decoding.chain import (
    Models,
    Output,
    ahead,
    oracle_first,
    pending,
    pick,
    sampler_of,
)
from spec_cli.decoding.sampling import Draws, Sampler, argmax
from spec_cli.draft2.lookup import Index
from spec_cli.draft2.ngram import KatzTrigram, trigram_of
from spec_cli.exec import Forward, native

ROOT = -1
GROUPED = ("sequoia", "specinfer")  # sampled sibling groups: verified whole, in draw order
CHECK = {"sequoia": "without_replacement", "specinfer": "iid", "one-hot": "deterministic"}
LOOKUP_MOST = 64  # lookup guesses a step considers (the oracle takes the best `tree_budget` of them at most)
TRIGRAM_MOST = 4  # a trigram's chain on a step without the draft (the oracle takes those worth their price)
TRIGRAM_ROOT = 2  # ... and its likeliest first tokens offered beside the chain's (at most ngram.TOPS)


@dataclass
class Node:
    token: int
    parent: int  # index of the parent node, ROOT for the last committed token
    depth: int
    q: float  # the draft's probability of this token at its parent
    rank: int  # place among its siblings
    value: float  # expected: the probability that the oracle accepts the path to this node
    stage: str = "draft"  # who proposed it: the draft, draft2 (and the draft kept it), the lookup, the trigram or
    # the fitted heads
    slot: int | None = None  # the draft cache slot, once the draft has run this node
    match: int = 0  # a lookup guess: the length of the match it extends (its q: the match's share of it)


@dataclass
class Tree:
    rule: str = "greedy"  # greedy, or the sampling rule: one-hot, sequoia, specinfer
    budget: int = 0  # sampled groups: oracle slots they may take, one per draw
    slot_price: float = 0.0  # sampled groups: what a slot must be worth (expected tokens) to be drawn
    used: int = 0
    worth: float = 0.0  # sampled groups: the expected accepted tokens of the groups drawn so far
    nodes: list[Node] = field(default_factory=list)
    kids: dict[int, list[int]] = field(default_factory=dict)  # node (or ROOT) -> children, in draw order
    draws: dict[int, list[int]] = field(default_factory=dict)  # node -> tokens drawn there (repeats: specinfer)
    q: dict[int, torch.Tensor | None] = field(default_factory=dict)  # node -> the draft distribution its children
    # came from (None in a greedy tree: only its top was read, `_summaries`)
    top: dict[int, float] = field(default_factory=dict)  # node -> the draft's top probability there
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    @property
    def grouped(self) -> bool:
        return self.rule in GROUPED

    def add(self, token: int, parent: int, q: float, rank: int, value: float) -> int:
        depth = 1 if parent == ROOT else self.nodes[parent].depth + 1
        self.nodes.append(Node(token, parent, depth, q, rank, value))
        i = len(self.nodes) - 1
        self.kids.setdefault(parent, []).append(i)
        self.index[(parent, token)] = i
        return i

    def children(self, node: int) -> list[int]:
        return self.kids.get(node, [])

    def value(self, node: int) -> float:
        return 1.0 if node == ROOT else self.nodes[node].value

    def depth(self, node: int) -> int:
        return 0 if node == ROOT else self.nodes[node].depth

    def drafted(self, path: list[int]) -> list[int]:
        """The draft cache slots of `path`'s nodes, as far down it as the draft ran them."""
        slots = []
        for i in path:
            if self.nodes[i].slot is None:
                break
            slots.append(self.nodes[i].slot)
        return slots

    def path(self, node: int) -> list[int]:
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def choose(self, budget: int, price=None) -> tuple[list[int], float]:
        """The nodes for the oracle, ancestor-closed in creation order, and how many of them it should accept.

        At most `budget`; with `price(n)` (what verifying n nodes costs, in tokens), the number that maximises
        expected accepted tokens minus that price. Sampled groups are all verified, whole: whether a group is
        verified must not depend on what was drawn in it, nor on anything its draws steered (which nodes the
        draft ran next, which other groups took the budget), so `_open` decides it before drawing and the
        decision stands."""
        if self.grouped:  # every drawn group, whole: `_open` settled which before drawing them
            return list(range(len(self.nodes))), self.worth
        order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].value, self.nodes[i].depth, i))
        order = order[:budget]
        gains = [0.0]
        for i in order:
            gains.append(gains[-1] + self.nodes[i].value)
        n = len(order) if price is None else max(range(len(gains)), key=lambda n: gains[n] - price(n))
        return sorted(order[:n]), gains[n]


def _group_size(top: list[float], branching: int, mass: float) -> int:
    """How many children to offer at a node: enough of the draft's top tokens to cover `mass` of q."""
    if branching == 1:
        return 1
    covered, total = 0, 0.0
    for value in top[:branching]:
        total += value
        covered += total < mass
    return min(branching, covered + 1, sum(1 for value in top[:branching] if value > 0))


@dataclass
class Row:
    """What the host needs of the draft's distribution q at one row, read back with every other row of the
    forward in one read: its top tokens and, for sampled groups, the children already drawn on the device
    (draft2's guess kept with probability q(guess), then the rest) and their probabilities."""

    top: list[float]
    tokens: list[int]
    draws: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    kept: bool = False


def _summaries(logits: torch.Tensor, sampler: Sampler, branching: int, rule: str, guesses: torch.Tensor | None,
               draws: Draws) -> tuple[torch.Tensor | None, list[Row]]:
    """The draft's distributions q at a forward's rows, and their summaries for the host (`_rows`). A greedy
    tree reads only q's top, so where spec's kernel is loaded it reads that alone from the logits in one pass
    a row, and keeps no q (None)."""
    native_ok = rule == "greedy" and logits.device.type == "cpu" and logits.dtype == torch.float32
    kernels = native.loaded() if native_ok else None
    if kernels is None:
        q = _distributions(logits, sampler)
        return q, draws.tree_rows(q, branching, rule, guesses, _rows)
    b = min(branching, logits.shape[-1])
    return None, [Row(row[:b], [int(t) for t in row[b:]]) for row in kernels.top_probs(logits, b).tolist()]


def _rows(q: torch.Tensor, branching: int, rule: str, guesses: torch.Tensor | None,
          draws: Draws) -> list[Row]:
    """Summaries of q [rows, V] for the host, in one read. Sampled groups are drawn here for every row, before
    anything decides which rows to open: the decision reads only q's top (`_open`), never the draws."""
    b = min(branching, q.shape[-1])
    top, tokens = torch.topk(q, b)
    parts = [top, tokens.to(top.dtype)]
    if rule in GROUPED:
        rows = torch.arange(q.shape[0], device=q.device)
        has = guesses >= 0
        guess = guesses.clamp(min=0)
        kept = _keeps(q, guess, has, draws)
        others = q.clone()
        others[rows[has], guess[has]] = 0  # the draft's own token, drawn with draft2's guess removed
        total = others.sum(-1, keepdim=True)
        others = torch.where(total > 0, others / total.clamp(min=torch.finfo(q.dtype).tiny), q)
        first = torch.where(kept, guess, draws.sample_rows(others))
        if b > 1 and rule == "sequoia":  # without replacement, after `first`
            rest = q.clone()
            rest[rows, first] = 0
            more = draws.sample_groups(rest, b - 1, False)
        elif b > 1:
            more = draws.sample_groups(q, b - 1, True)
        draws = torch.cat([first[:, None], more], 1) if b > 1 else first[:, None]
        parts += [draws.to(top.dtype), q.gather(1, draws), kept[:, None].to(top.dtype)]
    values = torch.cat(parts, 1).tolist()  # the forward's one host read
    out = []
    for row in values:
        summary = Row(row[:b], [int(t) for t in row[b : 2 * b]])
        if rule in GROUPED:
            summary.draws = [int(t) for t in row[2 * b : 3 * b]]
            summary.probs = row[3 * b : 4 * b]
            summary.kept = row[4 * b] > 0
        out.append(summary)
    return out


def _keeps(q: torch.Tensor, guess: torch.Tensor, has: torch.Tensor, draws: Draws) -> torch.Tensor:
    """Which rows keep draft2's guess x: with probability q(x) (one-hot draft2, Leviathan's rule), so a kept
    guess is exactly a draw from the draft."""
    rows = torch.arange(q.shape[0], device=q.device)
    return has & (draws.uniforms(q.shape[0], q.device) < torch.where(has, q[rows, guess], 0.0))


def _open(tree: Tree, node: int, q: torch.Tensor | None, row: Row, branching: int, mass: float,
          calibration: adapt.Calibration, guess: int | None = None) -> int | None:
    """Give `node` its children from the draft's distribution q there (summarised by `row`); return the child
    that is draft2's `guess` if the draft kept it (greedily, or with Leviathan's rule when drawn)."""
    tree.q[node] = q
    k = _group_size(row.top, branching, mass)
    kept = False
    if tree.grouped:
        k = min(k, tree.budget - tree.used)
        worth = tree.value(node) * calibration.group(row.top[0])
        if k < 1 or worth / k < tree.slot_price:
            return None  # left a leaf: its children are never drawn, so no choice of which to verify arises
        tree.used += k
        tree.worth += worth
        draws, probs = row.draws[:k], row.probs[:k]
        kept = guess is not None and row.kept
    else:
        draws = [t for v, t in zip(row.top[:k], row.tokens[:k]) if v > 0]
        probs = row.top[: len(draws)]
        kept = guess is not None and draws[0] == guess
    tree.draws[node] = draws
    tree.top[node] = row.top[0]
    seen = {}
    for token, p in zip(draws, probs):
        seen.setdefault(token, p)
    worth, missed = tree.value(node), 1.0
    for rank, (token, p) in enumerate(seen.items()):
        accept = calibration.node(p, rank)
        tree.add(token, node, p, rank, worth * missed * accept)
        missed *= 1 - accept
    return tree.index[(node, guess)] if kept else None


def _distributions(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    return torch.softmax(logits, -1) if sampler.greedy else sampler.probs(logits)


@dataclass
class Growth:
    """What one step's drafting did: the tree, the draft's forwards (tokens, seconds with the host's work around
    them), draft2's guesses as the draft checked them (kept or not), and all the seconds it took."""

    tree: Tree
    forwards: list[tuple[int, float]] = field(default_factory=list)
    guesses: list[bool] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Branch:
    """A node the draft runs in a forward, and draft2's chain of guesses below it: `rows`, its rows among those
    the forward returns (the node's, then the chain's)."""

    node: int
    chain: list[int]
    rows: list[int]


class Grower:
    """The draft's tree for one step, grown a forward at a time: the draft's pending tail with draft2's chain
    after it, then the best nodes it has not run (each with draft2's chain below it), while the policy finds
    another forward worth it. `price(n)`: what verifying n nodes costs, in tokens (None: nothing)."""

    def __init__(self, models: Models, out: Output, settings: Decoding, sampler: Sampler, draws: Draws,
                 policy: adapt.Policy, *, rule: str, budget: int, max_depth: int, price=None, oracle_tail: int = 1):
        self.draft, self.draft2, self.out, self.settings = models.draft, models.draft2, out, settings
        self.sampler, self.draws, self.policy = sampler, draws, policy
        self.budget, self.max_depth, self.price, self.oracle_tail = budget, max_depth, price, oracle_tail
        self.tree = Tree(rule, budget=budget, slot_price=price(budget) / budget if price is not None else 0.0)
        self.growth = Growth(self.tree)

    def grow(self) -> Growth:
        self.root()
        while len(self.growth.forwards) < self.max_depth and self.expand():
            pass
        return self.growth

    def root(self) -> None:
        """The draft's pending tail, then draft2's chain after it, in one forward."""
        tail = pending(self.draft, self.out.sequence)
        chain = self.chain(ROOT, self.out.sequence, self.draft.room() - len(tail), len(tail))
        first = self.draft.length + len(tail) - 1  # the slot of the tail's last token: the first row returned
        started = time.perf_counter()
        branch = Branch(ROOT, chain, list(range(len(chain) + 1)))
        q, rows = self.run(tail + chain, len(tail), None, [branch])
        self.descend(branch, q, rows, first)
        self.timed(len(tail) + len(chain), started)

    def expand(self) -> bool:
        """The best nodes the draft has not run, in one forward, draft2's chains after them. False: none is
        worth running."""
        started = time.perf_counter()
        todo = self.todo()
        if not todo:
            self.growth.seconds += time.perf_counter() - started
            return False
        first = self.draft.length
        tokens, parents, branches = [], [], []
        for k, i in enumerate(todo):
            node = self.tree.nodes[i]
            tokens.append(node.token)
            parents.append(ROOT if node.parent == ROOT else self.tree.nodes[node.parent].slot)
            node.slot = first + k
            branches.append(Branch(i, [], [k]))
        if self.draft2 is not None:
            for branch in branches:
                context = self.out.sequence + [self.tree.nodes[j].token for j in self.tree.path(branch.node)]
                branch.chain = self.chain(branch.node, context, self.draft.room() - len(tokens), len(tokens))
                for token in branch.chain:
                    parents.append(first + branch.rows[-1])
                    branch.rows.append(len(tokens))
                    tokens.append(token)
        q, rows = self.run(tokens, 0, parents, branches)
        for branch in branches:
            self.descend(branch, q, rows, first)
        self.timed(len(tokens), started)
        return True

    def todo(self) -> list[int]:
        """The best of the nodes the oracle would get that the draft has not run, as many as the policy says."""
        tree = self.tree
        chosen, _ = tree.choose(self.budget, self.price)
        todo = sorted((i for i in chosen if i not in tree.q and tree.nodes[i].depth < self.max_depth),
                      key=lambda i: -tree.nodes[i].value)[: self.settings.tree_width]
        if todo:  # how many more forwards a line below the best one could take, as depth and budget allow
            below = self.max_depth - tree.nodes[todo[0]].depth - 1
            levels = max(0, min(below, self.budget - len(chosen) - len(todo)))
            values = [tree.nodes[i].value for i in todo]
            todo = todo[: self.policy.expand(values, levels, len(chosen), self.oracle_tail)]
        if self.draft.room() < len(todo) or (tree.grouped and tree.used >= tree.budget):
            return []
        return todo

    def chain(self, node: int, context: list[int], room: int, before: int) -> list[int]:
        """draft2's guesses below `node`, as many as the policy finds worth their place in the draft's forward
        (`before`: its tokens so far)."""
        length = min(self.settings.draft2_tokens, self.max_depth - self.tree.depth(node) - 1, room)
        if self.draft2 is None or length <= 0:
            return []
        length = self.policy.chain(self.tree.value(node), length, before, type(self.draft2).__name__)
        return self.draft2.propose(context, length) if length > 0 else []

    def run(self, tokens: list[int], commit: int, parents: list[int] | None,
            branches: list[Branch]) -> tuple[torch.Tensor | None, list[Row]]:
        """The draft's forward, returning the branches' rows, and their distributions summarised for the host
        in one read. draft2's guesses ride along in the forward's upload: each row's is the token after it."""
        guesses = [-1] * sum(len(branch.rows) for branch in branches)
        for branch in branches:
            for row, token in zip(branch.rows, branch.chain):
                guesses[row] = token
        result = self.draft.forward(tokens, commit=commit, parents=parents, last=len(guesses),
                                    carry=guesses if self.tree.grouped else None)
        return _summaries(result.logits, self.sampler, self.settings.tree_branching, self.tree.rule, result.carried,
                          self.draws)

    def descend(self, branch: Branch, q: torch.Tensor, rows: list[Row], first: int) -> None:
        """Open the branch's node with its first row; while the draft keeps draft2's next guess, open that child
        too, with the next row (`first`: the draft slot of the first row returned)."""
        tree, node = self.tree, branch.node
        for k, row in enumerate(branch.rows):
            if tree.depth(node) >= self.max_depth:
                return
            guess = branch.chain[k] if k < len(branch.chain) else None
            child = _open(tree, node, None if q is None else q[row], rows[row], self.settings.tree_branching,
                          self.settings.tree_mass,
                          self.policy.calibration, guess)
            if guess is None or node not in tree.draws:  # no guess, or a sampled group not worth drawing
                return
            self.growth.guesses.append(child is not None)
            if child is None:
                return
            tree.nodes[child].stage = "draft2"
            tree.nodes[child].slot = first + branch.rows[k + 1]
            node = child

    def timed(self, tokens: int, started: float) -> None:
        seconds = time.perf_counter() - started
        self.growth.forwards.append((tokens, seconds))
        self.growth.seconds += seconds


def staged(models: Models, out: Output, settings: Decoding, draws: Draws) -> Iterator[Event]:
    """A step a loop: the policy says whether the draft speculates; if it does, it grows a tree (`Grower`; the
    lookup's guesses grafted on when greedy: `_graft`), else (or with no draft at all) the tree is the lookup's
    guesses copied from the text (`_guesses`), possibly none; the nodes worth their price go to the oracle in
    one forward, which walks down them (`_verify`); the policy is told what the step did (one `adapt.Step`);
    the caches keep the accepted path; its tokens go out."""
    oracle, draft = models.oracle, models.draft
    if not getattr(oracle, "exact_trees", True):  # one child a node: every tree a chain, verified bitwise
        settings = settings.replace(tree_branching=1)
    sampler = sampler_of(settings)
    rule = "greedy" if sampler.greedy else settings.tree_rule
    policy = models.controllers[(rule, sampler)] if settings.tree_adaptive else adapt.Policy()
    policy.begin()
    last = None  # the oracle's last token on the device, after a plain step
    index = Index()  # the text's n-grams: the lookup's guesses, and the cue that the text repeats itself
    trigram = trigram_of(models.draft2)  # draft2's trigram, if it has one: guesses on steps without the draft too
    heads = models.heads if draft is None else None  # heads fitted on the oracle: guesses from its own state
    state = None  # (what the oracle's head read at the row that chose the pending token, that token)
    oracle.keeps_hidden = heads is not None
    done, done_started = None, 0.0  # the last step's report and start: sent when the next one starts, with all
    # it took (`Step.wall`)

    def limits(tail: int, remaining: int) -> tuple[int, int]:
        """(nodes, depth) a step may verify whose oracle has `tail` tokens pending and `remaining` to produce."""
        return min(settings.tree_budget, oracle.room() - tail), min(settings.tree_depth, remaining - 1)

    def ways(tail: int, remaining: int, draft_tail: int) -> tuple[bool, bool]:
        """(speculate, guess) for a step whose oracle has `tail` tokens pending, `remaining` to produce, and
        whose draft `draft_tail` pending: what the policy says, where there is room for it."""
        cue = lambda: index.repeating(out.sequence)  # noqa: E731
        budget, max_depth = limits(tail, remaining)
        speculate = (draft is not None and min(budget, draft.room() - draft_tail) > 0
                     and max_depth > 0 and not oracle_first(tail, draft_tail)
                     and policy.speculate(cue, draft_tail, remaining))
        return speculate, (not speculate and settings.lookup and budget > 0 and remaining > 1
                           and policy.guess(cue, priced=state is not None))
    try:
        while not out.reason:
            step_started = time.perf_counter()
            if done is not None:
                done.wall = step_started - done_started
                policy.report(done)
                done = None
            tail = pending(oracle, out.sequence)
            if len(tail) > oracle.room():
                return
            if hasattr(oracle, "company"):  # (in company: what the others' waiting and each shared row cost)
                policy.seat(oracle.company(), oracle.row_seconds())
            index.extend(out.sequence)
            budget, max_depth = limits(len(tail), out.remaining)
            draft_tail = prompt_left = 0
            if draft is not None:
                draft_tail = len(pending(draft, out.sequence))
                # (the prompt the draft has not read)
                prompt_left = max(0, len(out.sequence) - out.produced - draft.base - draft.committed)
            speculate, guessing = ways(len(tail), out.remaining, draft_tail)
            if not speculate and not guessing and len(tail) == 1 and getattr(oracle, "queues", False):

                def plain_next() -> bool:
                    """Whether the next step is plain too, asked before the host reads this step's token (the
                    text and the caches lack it, counted in: a shape is chosen, never the output)."""
                    index.extend(out.sequence)
                    return not any(ways(2, out.remaining - 1, len(pending(draft, out.sequence)) + 1 if draft else 0))

                last = yield from _plain(oracle, out, sampler, draws, policy, tail if last is None else last,
                                         plain_next)
                done = state = None  # (the heads see no state of queued plain steps)
                continue
            price = policy.price(len(tail)) if speculate or guessing else None
            if speculate:
                growth = Grower(models, out, settings, sampler, draws, policy, rule=rule,
                                budget=min(budget, draft.room() - draft_tail), max_depth=max_depth, price=price,
                                oracle_tail=len(tail)).grow()
            elif guessing:
                growth = _guesses(index, out.sequence, "greedy" if sampler.greedy else "one-hot",
                                  min(budget, out.remaining - 1), settings.tree_branching, policy.calibration,
                                  trigram)
                if state is not None:
                    _heads(growth, heads, state, min(budget, out.remaining - 1), policy.calibration)
            else:
                growth = Growth(Tree(rule))
            tree = growth.tree
            if speculate and settings.lookup and rule == "greedy":
                _graft(growth, index, out.sequence, min(budget, out.remaining - 1), settings.tree_branching,
                       policy.calibration)
            chosen, _ = tree.choose(budget, price)
            started = time.perf_counter()
            slots = {node: oracle.length + len(tail) + k for k, node in enumerate(chosen)}  # in the oracle's cache
            verdict, last = _verify(oracle, tree, chosen, slots, tail, last, sampler, draws,
                                    looked=bool(tree.nodes))
            seconds = time.perf_counter() - started
            done = adapt.Step(speculated=speculate, tokens=len(verdict.path) + 1, verified=len(chosen),
                              oracle_tail=len(tail), oracle_seconds=seconds, draft_tail=draft_tail,
                              prompt_left=prompt_left, drafts=growth.forwards, drafting=growth.seconds,
                              drafter=type(models.draft2).__name__, guesses=growth.guesses,
                              nodes=verdict.nodes, groups=verdict.groups, lookups=verdict.lookups,
                              trigrams=verdict.trigrams, heads=verdict.heads)
            done_started = step_started
            if speculate:
                yield Verified("draft", len(growth.forwards), len(growth.guesses), sum(growth.guesses))
            yield Verified("oracle", 1, len(chosen), len(verdict.path))

            if heads is not None:
                state = _state(oracle, chosen, verdict)
            oracle.keep([slots[i] for i in verdict.path])
            if speculate:
                draft.keep(tree.drafted(verdict.path))
            events = [Token(tree.nodes[i].token, ACCEPTED, tree.nodes[i].stage) for i in verdict.path]
            events += [Token(tree.nodes[i].token, REJECTED, tree.nodes[i].stage) for i in verdict.rejected]
            events.append(Token(verdict.final, CORRECTED if verdict.rejected else BONUS, "oracle"))
            yield from out.emit(events, out.decided(verdict.forward, verdict.rows))

    finally:  # (the last step: reported as the completion ends, or is dropped)
        oracle.keeps_hidden = False
        if done is not None:
            done.wall = time.perf_counter() - done_started
            policy.report(done)


def _plain(oracle, out: Output, sampler: Sampler, draws: Draws, policy: adapt.Policy, first, plain_next):
    """Plain steps from `first` (the pending token, on the device or the host) while `plain_next()` says the
    next is plain too, each step's forward queued before the host reads the token before it (`chain.ahead`): on
    a device that queues forwards the host's work between steps (the read, the events, the policy) overlaps the
    next forward, as in baseline.
    Returns the last token, on the device, for the next step (None: the completion ended). Each step is
    reported at its read, at the run's mean time a token so far: a queued step's own read-to-read time swings
    (a read may find its token done, or wait for two forwards)."""
    started, steps = time.perf_counter(), 0
    result = oracle.forward(first, commit=1, last=1)
    token, row = pick(result.logits[-1], sampler, draws), out.decided(result, [-1])
    while True:
        following = ahead(oracle, token, out, sampler, draws) if plain_next() else None
        final = int(token)  # the step's one host read
        steps += 1
        seconds = (time.perf_counter() - started) / steps
        policy.report(adapt.Step(speculated=False, tokens=1, verified=0, oracle_tail=1, oracle_seconds=seconds,
                                 wall=seconds))
        yield Verified("oracle", 1, 0, 0)
        yield from out.emit([Token(final, BONUS, "oracle")], row)
        if out.reason:
            return None
        if following is None:
            return token
        token, row = following


def _guesses(index: Index, text: list[int], rule: str, depth: int, branches: int,
             calibration: adapt.Calibration, trigram: KatzTrigram | None = None) -> Growth:
    """The step's tree without a model: what followed the text's latest matches (`spec_cli.draft2.lookup`), `depth`
    deep, and draft2's trigram's chain where it has one (`_trigram`), each guess worth the calibrated chance that
    the oracle accepts the path to it. The guesses are deterministic, so sampling verifies them by the one-hot
    rule (`rule`)."""
    growth = Growth(Tree(rule))
    _graft(growth, index, text, depth, branches, calibration)  # (onto nothing: the lookup's trie as it is)
    if trigram is not None:
        _trigram(growth, trigram, text, min(depth, TRIGRAM_MOST), calibration)
    return growth


def _state(oracle, chosen: list[int], verdict: "Verdict") -> tuple[torch.Tensor, int] | None:
    """What the fitted heads read next: the oracle's state at the row that chose the step's own token (the root's
    row, or the last accepted node's), and that token."""
    if oracle.hidden is None:
        return None
    row = chosen.index(verdict.path[-1]) + 1 if verdict.path else 0
    return oracle.hidden[row].clone(), verdict.final


def _heads(growth: Growth, heads, state: tuple[torch.Tensor, int], depth: int, calibration: adapt.Calibration) -> None:
    """The fitted heads' guesses (`spec_cli.draft2.heads`) added to the lookup's and the trigram's tree: head 1's
    likeliest tokens under the root, a head 2's (where fitted) under head 1's first; each worth its parent's worth
    times the chance that the guesses there before it were refused and the oracle takes this one (by the head's
    probability of it, calibrated). They guess text neither the lookup nor the trigram can (new code, where the
    first is right about two times in five: benchmarks/reports)."""
    if depth <= 0:
        return
    started = time.perf_counter()
    tree = growth.tree
    for guess in heads.guesses(*state):
        node = _offer(tree, ROOT, guess.token, guess.p, "heads",
                      lambda rank, p=guess.p: calibration.head(1, p, rank))
        if depth > 1:
            for token, p in guess.below:
                _offer(tree, node, token, p, "heads", lambda rank, p=p: calibration.head(2, p, rank))
    growth.seconds += time.perf_counter() - started


def _offer(tree: Tree, parent: int, token: int, p: float, stage: str, chance) -> int:
    """A guess of `stage` under `parent` (or the node already there): worth the parent's worth times the chance that
    the guesses there before it were refused and the oracle takes this one (`chance(rank)`, calibrated)."""
    known = tree.index.get((parent, token))
    if known is None:
        worth, siblings = tree.value(parent), tree.children(parent)
        missed = max(0.0, 1.0 - sum(tree.nodes[c].value for c in siblings) / worth) if worth > 0 else 0.0
        known = tree.add(token, parent, p, len(siblings), worth * missed * chance(len(siblings)))
        tree.nodes[known].stage = stage
    return known


def _trigram(growth: Growth, trigram: KatzTrigram, text: list[int], depth: int,
             calibration: adapt.Calibration) -> None:
    """The trigram's greedy chain after the text, added to the lookup's trie: down the trie while they agree,
    then new nodes, each worth its parent's worth times the chance that the lookup's guesses there were refused
    and the oracle takes this one (by the trigram's probability of it, calibrated). Text the lookup cannot copy
    (new code) is where the trigram's guesses are right often enough to pay (benchmarks/reports: the 1.5B alone)."""
    started = time.perf_counter()
    tree = growth.tree

    def add(node: int, token: int, p: float) -> int:
        return _offer(tree, node, token, p, "trigram", lambda rank: calibration.trigram(p, rank))

    node = ROOT
    for token, p in trigram.chain(text, depth):
        node = add(node, token, p)
    if depth > 0 and TRIGRAM_ROOT > 1:  # the next likeliest first token too, beside the chain's (not below it)
        for token, p in trigram.tops(*trigram.last_two(text))[1:TRIGRAM_ROOT]:
            if p > 0:
                add(ROOT, token, p)
    growth.seconds += time.perf_counter() - started


def _graft(growth: Growth, index: Index, text: list[int], depth: int, branches: int,
           calibration: adapt.Calibration) -> None:
    """The lookup's guesses (`_guesses`) added to the draft's greedy tree where the draft did not propose them:
    the oracle then also checks what the text repeats where the draft foresees otherwise (a loop the draft
    expects to leave, a copy it cannot know). A guess's chance is the calibrated lookup's, but no more than
    what the draft's own children there leave to it. With one child a node, the lookup only goes on from
    where the draft's chain ends."""
    started = time.perf_counter()
    tree = growth.tree
    at: list[int | None] = []  # the lookup's guesses -> their nodes in the tree (None: left out)
    missed: dict[int, float] = {}  # parent -> the chance that the guesses before were all refused
    for guess in index.guess(text, depth, branches, most=LOOKUP_MOST):
        parent = ROOT if guess.parent == ROOT else at[guess.parent]
        known = None if parent is None else tree.index.get((parent, guess.token))
        if known is not None or parent is None or (branches == 1 and tree.children(parent)):
            at.append(known)  # (one child a node: chains stay chains, the lookup only goes on from their ends)
            continue
        worth = tree.value(parent)
        if parent not in missed:
            missed[parent] = max(0.0, 1.0 - sum(tree.nodes[c].value for c in tree.children(parent)) / worth) \
                if worth > 0 else 0.0
        accept = calibration.lookup(guess.match, guess.share, guess.rank)
        i = tree.add(guess.token, parent, guess.share, guess.rank, worth * missed[parent] * accept)
        tree.nodes[i].stage, tree.nodes[i].match = "lookup", guess.match
        missed[parent] *= 1 - accept
        at.append(i)
    growth.seconds += time.perf_counter() - started


@dataclass
class Verdict:
    """The oracle's walk down the tree: the path it accepted, the candidates it rejected at the end, its own
    token, and what it judged on the way (drafted children: q, rank, accepted; sampled groups: top q,
    accepted; lookup guesses: match, share, rank, accepted; trigram guesses: p, rank, accepted; the heads':
    depth, p, rank, accepted)."""

    path: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    final: int = -1
    nodes: list[tuple[float, int, bool]] = field(default_factory=list)
    groups: list[tuple[float, bool]] = field(default_factory=list)
    lookups: list[tuple[int, float, int, bool]] = field(default_factory=list)
    trigrams: list[tuple[float, int, bool]] = field(default_factory=list)
    heads: list[tuple[int, float, int, bool]] = field(default_factory=list)
    forward: Forward | None = None  # the oracle's, and the row of it each output token (path, final) came from
    rows: list[int] = field(default_factory=list)

    def judge(self, node: Node, accepted: bool) -> None:
        """Note the oracle's judgement of a node, for the calibration to learn."""
        if node.match:
            self.lookups.append((node.match, node.q, node.rank, accepted))
        elif node.stage == "trigram":
            self.trigrams.append((node.q, node.rank, accepted))
        elif node.stage == "heads":
            self.heads.append((node.depth, node.q, node.rank, accepted))
        else:
            self.nodes.append((node.q, node.rank, accepted))


def _verify(oracle, tree: Tree, chosen: list[int], slots: dict[int, int], tail: list[int], last, sampler: Sampler,
            draws: Draws, looked: bool) -> tuple[Verdict, torch.Tensor | None]:
    """The oracle's forward over its pending tail and the `chosen` nodes (at `slots`), and its walk down them.
    With no nodes it is a plain step, whose token stays on the device for the next one: returned as well."""
    parents = [ROOT if tree.nodes[i].parent == ROOT else slots[tree.nodes[i].parent] for i in chosen]
    candidates = None if sampler.greedy or not chosen else _candidates(tree, chosen)
    if chosen or last is None or len(tail) > 1:
        result = oracle.forward(tail + [tree.nodes[i].token for i in chosen], commit=len(tail), parents=parents,
                                last=len(chosen) + 1, carry=None if candidates is None else candidates[0])
    else:  # a plain step: the last token never left the device
        result = oracle.forward(last, commit=1, last=1)
    if not chosen:
        token = pick(result.logits[-1], sampler, draws)
        final = int(token)  # the step's one host read
        verdict = Verdict(final=final, forward=result, rows=[len(result.logits) - 1])
        if looked and sampler.greedy:  # a look at guesses too unsure to offer: were they right all the same?
            _unverified(tree, verdict)
        return verdict, token
    if sampler.greedy:
        verdict = _walk(tree, chosen, result.logits)
    else:
        verdict = _walk_sampled(tree, chosen, result.logits, result.carried, candidates[1], sampler, draws)
    row = {node: r for r, node in enumerate([ROOT] + chosen)}  # (the logits' rows: the root's, then chosen's)
    verdict.forward, verdict.rows = result, [row[node] for node in [ROOT] + verdict.path]
    return verdict, None


def _walk(tree: Tree, chosen: list[int], logits: torch.Tensor) -> Verdict:
    """Follow the oracle's argmax down the tree. Every test tells the calibration how often the oracle takes a
    child of this rank and draft probability."""
    row = {node: k + 1 for k, node in enumerate(chosen)}
    row[ROOT] = 0
    in_tree = set(chosen)
    targets = argmax(logits).tolist()  # the step's one host read
    verdict, node = Verdict(), ROOT
    while True:
        children = [c for c in tree.children(node) if c in in_tree]
        target = targets[row[node]]
        match = None
        for c in children:
            hit = tree.nodes[c].token == target
            verdict.judge(tree.nodes[c], hit)
            if hit:
                match = c
                break
        if match is None:
            verdict.rejected, verdict.final = children, target
            return verdict
        verdict.path.append(match)
        node = match


def _candidates(tree: Tree, chosen: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """The children each verified node tests, in order, as the device walk's table ([children's rows, their
    tokens], flattened, one row per node and the root) and as node -> candidate child nodes for the host.
    Sampled groups test every draw in draw order (repeats too: SpecInfer); top tokens, those verified."""
    in_tree = set(chosen)
    nodes = [ROOT] + chosen
    row = {node: r for r, node in enumerate(nodes)}
    tests = {}
    for node in nodes:
        if tree.grouped:
            tests[node] = [tree.index[(node, t)] for t in tree.draws.get(node, ())
                           if tree.index[(node, t)] in in_tree]
        else:
            tests[node] = [c for c in tree.children(node) if c in in_tree]
    width = max(1, max(len(t) for t in tests.values()))
    kids = [[row[c] for c in tests[n]] + [-1] * (width - len(tests[n])) for n in nodes]
    tokens = [[tree.nodes[c].token for c in tests[n]] + [0] * (width - len(tests[n])) for n in nodes]
    return [x for r in kids for x in r] + [x for r in tokens for x in r], tests


def _walk_sampled(tree: Tree, chosen: list[int], logits: torch.Tensor, table: torch.Tensor,
                  tests: dict[int, list[int]], sampler: Sampler, draws: Draws) -> Verdict:
    """Follow the oracle down the tree when sampling: every node's children are tested in order, against the
    draft's distribution at their parent (whoever proposed them), with the rule that matches how they were
    drawn, on the device (`accept.tree_walk`); then one read."""
    nodes = [ROOT] + chosen
    table = table.view(2, len(nodes), -1)
    empty = torch.zeros_like(logits[0])
    qs = torch.stack([_proposal(tree, node) if node in tree.q else empty for node in nodes])
    widths = [0] * (1 + max((tree.nodes[i].depth for i in chosen), default=0))
    for node in nodes:
        widths[tree.depth(node)] = max(widths[tree.depth(node)], len(tests[node]))
    walked = accept.tree_walk(sampler.probs(logits), qs, table[0], table[1],
                              "deterministic" if not tree.grouped else CHECK[tree.rule], widths,
                              draws).tolist()  # the step's one host read
    verdict, node = Verdict(), ROOT
    for place in walked[:-1]:
        tested = tests[node] if place < 0 else tests[node][: place + 1]
        if tree.grouped and tests[node]:
            verdict.groups.append((tree.top[node], place >= 0))
        for k, child in enumerate(tested):
            verdict.judge(tree.nodes[child], k == place)
        if place < 0:
            break
        node = tests[node][place]
        verdict.path.append(node)
    in_tree = set(chosen)
    verdict.rejected, verdict.final = [c for c in tree.children(node) if c in in_tree], walked[-1]
    return verdict


def _proposal(tree: Tree, node: int) -> torch.Tensor:
    """The distribution the children of `node` were drawn from: the draft's there, whoever proposed them
    (a child draft2 guessed was kept by the draft's own acceptance test, so it too is a draw from it)."""
    return tree.q[node]


def _unverified(tree: Tree, verdict: Verdict) -> None:
    """What the oracle's own token says of the root's children the draft (or the lookup) offered and nobody
    verified: the one it chose would have been accepted (greedy), those before it not. Free, and it is how a
    draft that became good is noticed while its guesses are not yet trusted enough to verify."""
    for child in tree.children(ROOT):
        hit = tree.nodes[child].token == verdict.final
        verdict.judge(tree.nodes[child], hit)
        if hit:
            break
