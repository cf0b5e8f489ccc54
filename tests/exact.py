"""Exact output distributions: a strategy run once per combination of its random choices.

Every random choice a strategy makes goes through the `Draws` it is given (`spec_cli.decoding.sampling`).
`exhaust(run)` gives `run` an `Enumerating` one, whose choices branch: `sample(p)` over every token with p > 0
(weight p / sum p), `sample_group` draw by draw (without replacement: from what is left), and `uniform() < a`
into True (weight a) and False (1 - a). `run(draws)` is replayed once per path, depth first, and the weights of
the paths that give each outcome are summed: the outcome's exact probability, up to float64 rounding. Its
generator is not one, so a draw that bypasses the methods fails.

With `exhaust(run, deferred=True)` a tree's rows (`Draws.tree_rows`, where the device draws every drafted
row's sampled group before reading any back) come from `deferred_rows`: the same tops (by the real code),
with each row's group drawn through the methods when the host first reads it, draw by draw, by the law the
device `_rows` draws it with. Enumerating every row's group up front multiplies the paths past what can be
summed; deferring is exact because each row's draws are independent of every other random choice and of
everything the host computes before reading them: drawing a row's group when it is read, or never for a row
nobody opens, leaves the joint law of the whole run unchanged, whatever the host code does (code that read
draws before deciding which rows to open would still show its bias). That the deferred law is the device's is
tested on its own: both enumerated row by row, and real device draws sampled against it.

`StandIn` is a model with its cache for such runs: the logits after each row's context are a table lookup on
its last two tokens (float64), and it speaks the part of the runner's interface that the strategies use
(a tree of scratch slots with parents, commit, keep).
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from spec_cli.core.events import Token
from spec_cli.core.settings import Decoding
from spec_cli.decoding import staged as tree
from spec_cli.decoding.methods import decode
from spec_cli.decoding.sampling import Draws
from spec_cli.exec import Forward

MAX_PATHS = 300_000


class _Path:
    """One replay: the choices it must repeat (`prefix`), the ones it takes, and their joint weight."""

    def __init__(self, prefix: tuple[int, ...]):
        self.prefix = prefix
        self.taken: list[int] = []
        self.siblings: list[tuple[int, ...]] = []  # prefixes of the paths that branch off this one
        self.weight = 1.0

    def choose(self, options: list[tuple[object, float]]):
        options = [(value, w) for value, w in options if w > 0]
        assert options, "a random choice with nothing to choose from"
        i = len(self.taken)
        if i < len(self.prefix):
            j = self.prefix[i]
            assert j < len(options), "the run is not deterministic given its random choices"
        else:
            j = 0
            self.siblings += [tuple(self.taken) + (k,) for k in range(1, len(options))]
        self.taken.append(j)
        value, w = options[j]
        self.weight *= w
        return value


class _Uniform:
    """A uniform draw on [0, 1) that is only ever compared: `u < a` branches into True (weight a) and False."""

    def __init__(self, path: _Path):
        self.path = path

    def __lt__(self, a):
        a = min(max(float(a), 0.0), 1.0)
        return self.path.choose([(True, a), (False, 1.0 - a)])


class _Uniforms:
    """Uniform draws on the device, for many rows at once, only ever compared: `u < a` (a tensor) branches
    element by element, `u[i, j] < a` as one uniform does."""

    def __init__(self, path: _Path, shape):
        self.path, self.shape = path, shape

    def __lt__(self, a):
        return torch.tensor([_Uniform(self.path) < x for x in a.reshape(-1).tolist()]).reshape(a.shape)

    def __getitem__(self, index):
        return _Uniform(self.path)


class _NotAGenerator:
    """What the strategies get instead of a generator: torch refuses it, so an unrouted draw fails loudly."""


NO_GENERATOR = _NotAGenerator()


class Enumerating(Draws):
    """Draws whose every choice branches: taken, on each replay, as the path being replayed says."""

    def __init__(self, deferred: bool = False):
        super().__init__(NO_GENERATOR)
        self.deferred = deferred
        self.path: _Path | None = None

    def sample(self, p):
        weights = p.double().tolist()
        assert min(weights) >= 0 and sum(weights) > 0, "torch.multinomial would refuse this distribution"
        total = sum(weights)
        return self.path.choose([(i, w / total) for i, w in enumerate(weights)])

    def sample_group(self, q, k, replacement):
        rest, draws = q.double().clone(), []
        for _ in range(k):
            if not (rest > 0).any():
                raise RuntimeError("not enough categories to draw without replacement")
            draws.append(self.sample(rest))
            if not replacement:
                rest[draws[-1]] = 0
        return draws

    def uniform(self):
        return _Uniform(self.path)

    def uniforms(self, shape, device=None):
        return _Uniforms(self.path, shape)

    def sample_rows(self, p):
        return torch.tensor([self.sample(row) for row in p])

    def sample_groups(self, q, k, replacement):
        out = []
        for row in q:  # a row with fewer than k tokens left ends with zeros, which nobody uses
            draws = self.sample_group(row, min(k, int((row > 0).sum())), replacement)
            out.append(draws + [0] * (k - len(draws)))
        return torch.tensor(out)

    def tree_rows(self, q, branching, rule, guesses, summarise):
        if self.deferred:
            return deferred_rows(q, branching, rule, guesses, self, summarise)
        return summarise(q, branching, rule, guesses, self)


def exhaust(run, max_paths: int = MAX_PATHS, deferred: bool = False) -> dict:
    """{outcome: probability} of `run(draws)` (deterministic but for its draws' choices), over every path;
    `deferred`: a tree's groups drawn when read (`deferred_rows`)."""
    result: dict = defaultdict(float)
    todo = [()]
    paths = 0
    draws = Enumerating(deferred)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only waits on a busy machine
    try:
        while todo:
            draws.path = path = _Path(todo.pop())
            outcome = run(draws)
            result[outcome] += path.weight
            todo += path.siblings
            paths += 1
            assert paths <= max_paths, "too many paths to enumerate"
    finally:
        torch.set_num_threads(threads)
    total = sum(result.values())
    assert abs(total - 1) < 1e-12, total
    return dict(result)




class _Drawn:
    """A row's group, drawn through the primitives as far as it is read (`row.draws[:k]`, `row.probs[:k]`)."""

    def __init__(self, row: "_DeferredRow", probs: bool):
        self.row, self.probs = row, probs

    def __getitem__(self, index):
        stop = (index.stop or self.row.branching) if isinstance(index, slice) else index + 1
        self.row.draw(stop)
        draws = self.row.drawn
        return [float(self.row.q[x]) for x in draws][index] if self.probs else draws[index]


class _DeferredRow:
    """`tree.Row` with its sampled group drawn on first read, by the device `_rows`' law: draft2's guess x kept
    with probability q(x); the first draw x if kept, else from q with x removed (q itself if nothing is
    left); then the rest without replacement after it (sequoia) or i.i.d. from q (specinfer)."""

    def __init__(self, row: tree.Row, q: torch.Tensor, branching: int, rule: str, guess: int, draws: Draws):
        self.top, self.tokens, self.source = row.top, row.tokens, draws
        self.q, self.branching, self.rule, self.guess = q, branching, rule, guess
        self.drawn: list[int] = []
        self._kept = None
        self.draws, self.probs = _Drawn(self, False), _Drawn(self, True)

    @property
    def kept(self) -> bool:
        if self._kept is None:
            self._kept = self.guess >= 0 and bool(self.source.uniform() < float(self.q[self.guess]))
        return self._kept

    def draw(self, n: int) -> None:
        q = self.q
        while len(self.drawn) < min(n, self.branching):
            if not self.drawn:
                if self.kept:
                    self.drawn.append(self.guess)
                    continue
                others = q.clone()
                if self.guess >= 0:
                    others[self.guess] = 0
                self.drawn.append(self.source.sample(others if others.sum() > 0 else q))
            elif self.rule == "sequoia":
                rest = q.clone()
                rest[self.drawn] = 0
                if not (rest > 0).any():
                    return  # fewer tokens than draws: the device pads with tokens nobody uses
                self.drawn.append(self.source.sample(rest))
            else:
                self.drawn.append(self.source.sample(q))


def deferred_rows(q: torch.Tensor, branching: int, rule: str, guesses: torch.Tensor | None, draws: Draws,
                  summarise=tree._rows) -> list:
    """`tree._rows` with each sampled group drawn from `draws` when the host reads it (see the module's
    docstring)."""
    rows = summarise(q, branching, "top only", None, draws)  # tops and tokens: nothing drawn
    if rule not in tree.GROUPED:
        return rows
    b = min(branching, q.shape[-1])
    return [_DeferredRow(row, q[i], b, rule, int(g), draws) for i, (row, g) in enumerate(zip(rows, guesses.tolist()))]


def max_difference(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# --- stand-in models ------------------------------------------------------------------------------------

def table(vocab: int, scale: float, seed: int, like: torch.Tensor | None = None, noise: float = 0.0):
    """Logits for every (second last, last) token pair; `like` plus noise: a draft that shares its oracle's
    structure."""
    g = torch.Generator().manual_seed(seed)
    fresh = torch.randn(vocab, vocab, vocab, generator=g, dtype=torch.float64)
    return fresh * scale if like is None else like + noise * fresh


class StandIn:
    """A model and its cache: scratch slots with parents, committed on `keep`, like `spec_cli.exec.Runner`."""

    def __init__(self, logits: torch.Tensor, skipped: torch.Tensor | None = None, capacity: int = 64):
        self.table = logits
        self.skipped = skipped  # the logits of a forward with sublayers skipped (a self-draft)
        self.device = torch.device("cpu")
        self.capacity = capacity
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.base = 0  # (the sequence's tokens before the first slot: `Runner.window`)
        self.committed = 0
        self.tokens: list[int] = []
        self.scratch: list[int] = []
        self.parents: list[int] = []

    @property
    def length(self) -> int:
        return self.committed + len(self.scratch)

    def room(self) -> int:
        return self.capacity - self.length

    def context(self, slot: int) -> list[int]:
        if slot < self.committed:
            return self.tokens[: slot + 1]
        chain = []
        while slot >= self.committed:
            chain.append(self.scratch[slot - self.committed])
            slot = self.parents[slot - self.committed]
            if slot < 0:
                break
        return self.tokens + chain[::-1]

    def forward(self, tokens, commit=0, parents=None, last=None, skip=None, carry=None) -> Forward:
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)  # ids the device held
        assert tokens and len(tokens) <= self.room()
        assert not (commit and self.scratch), "commit with scratch pending"
        start = self.length
        self.tokens += tokens[:commit]
        self.committed += commit
        for i in range(commit, len(tokens)):
            parent = parents[i - commit] if parents is not None else start + i - 1
            if parent < self.committed:
                assert parent in (-1, self.committed - 1), "a speculative token must follow the last committed one"
                parent = -1
            self.scratch.append(tokens[i])
            self.parents.append(parent)
        self.forwards += 1
        first = len(tokens) - (last or len(tokens))
        logits = self.skipped if skip and self.skipped is not None else self.table
        contexts = [self.context(start + i) for i in range(first, len(tokens))]
        return Forward(torch.stack([_next(logits, c) for c in contexts]), torch.tensor([len(c) - 1 for c in contexts]),
                       torch.tensor(carry, dtype=torch.long) if carry else None)

    def reuse(self, sequence: list[int]) -> int:
        n = 0
        while n < min(self.committed, len(sequence) - 1) and self.tokens[n] == sequence[n]:
            n += 1
        self.rewind(n)
        return n

    def window(self, sequence: list[int], most: int) -> None:
        assert len(sequence) - self.committed <= most, "a stand-in reads its prompts whole"

    def rewind(self, n: int) -> None:
        self.committed = min(n, self.committed)
        del self.tokens[self.committed:]
        self.scratch, self.parents = [], []

    def name(self, sequence: list[int]) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def keep(self, path: list[int]) -> None:
        self.tokens += [self.scratch[s - self.committed] for s in path]
        self.committed += len(path)
        self.scratch, self.parents = [], []


def _next(logits: torch.Tensor, context: list[int]) -> torch.Tensor:
    return logits[context[-2] if len(context) > 1 else 0, context[-1]]


def oracle_distribution(logits: torch.Tensor, prompt: list[int], length: int, sampler) -> dict:
    """P(the first `length` tokens) of the oracle alone."""
    vocab = logits.shape[-1]
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        context, prob = list(prompt), 1.0
        for token in seq:
            prob *= float(sampler.probs(_next(logits, context))[token])
            context.append(token)
        if prob > 0:
            out[seq] = prob
    return out


def extended(outcomes: dict, logits: torch.Tensor, prompt: list[int], length: int, sampler) -> dict:
    """Outcomes shorter than `length` (a step that gave fewer tokens) continued by the oracle alone."""
    out: dict = defaultdict(float)
    for seq, prob in outcomes.items():
        if len(seq) >= length:
            out[seq[:length]] += prob
            continue
        rest = oracle_distribution(logits, list(prompt) + list(seq), length - len(seq), sampler)
        for tail, p in rest.items():
            out[seq + tail] += prob * p
    return dict(out)


def first_tokens(models, prompt: list[int], length: int, one_step: bool, draws: Draws, **settings) -> tuple[int, ...]:
    """The first `length` output tokens of a completion, or with `one_step` those of its first step (it ends
    with the oracle's own token), which may be fewer."""
    tokens = []
    for event in decode(models, prompt, Decoding(**{"sampling": "rejection", **settings}), draws=draws):  # the rules' draws
        if isinstance(event, Token) and event.output:
            tokens.append(event.token)
            if len(tokens) == length or (one_step and event.stage == "oracle"):
                break
    return tuple(tokens)
