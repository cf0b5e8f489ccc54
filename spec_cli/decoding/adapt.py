"""What staged decoding measures as it runs, to choose how much to speculate on this machine.

- `Cost`: seconds per forward of one model by its number of tokens, as measured. On a GPU, or a CPU with
  matrix units, a forward of a few dozen tokens costs about what one costs: a bigger tree is nearly free. On a
  CPU without them the cost grows with the tokens (with weights packed for oneDNN, little for several, then
  more; unpacked, steeply from one to a few), and a tree must earn every node.
- `Calibration`: how often the oracle accepts a drafted child, by the draft's probability of it and its rank
  among its siblings (and, for sampled sibling groups, how often a group yields the token, by the draft's top
  probability there), learned from every verification.
- `Policy`: the questions a staged step asks (speculate at all? what do verified nodes cost? how long a chain
  of draft2's guesses? how many nodes to expand next?), answered for a fixed shape: the settings' caps as they
  are. Each step ends with one `Step` report of what it did and took; a fixed policy learns the calibration.
- `Controller`: the policy that measures: both, and the recent rate in tokens per second, speculating and
  plain. A step maximises its expected tokens minus the recent rate times its expected seconds (Dinkelbach's
  rule for a best ratio):
  the oracle gets the nodes (or whole sampled groups) that pay for their slots, the draft stops when its next
  forward would not pay, draft2's chains are as long as they pay; and when speculating at all is slower than
  the oracle alone (measured), steps are plain oracle steps, with probes: a few speculative steps judged
  together, ended at once when the draft is too unsure to offer anything (a cheap look). Every kind of
  probe is paid from one credit: 3% of plain decoding's time (1% once probes keep losing), less what
  losing probes lost. A timed probe waits until the credit covers what the last one lost; text that starts
  repeating itself (a cue) gets a probe at once: a burst while the credit is not overdrawn, else one step
  while the overdraft is under one probe's loss (so losing probes never cost more than their share plus a
  constant). A new completion gets a one-step look at its first step, paid by the completion, not the credit;
  while such looks keep losing, 1, 3, 7, then at most 8 completions in a row begin without one.
  Speculating counts as paying (and a probe as winning) when it beats plain decoding by 5%, plain decoding's
  speed being the lower quartile of its recent steps (robust to the stalls of a busy machine and to cold
  starts), measured on three plain steps before it is trusted. Steps without the draft verify the lookup's
  guesses while that beats the oracle alone (measured apart: plain decoding's speed is the oracle alone's).
- In company (`company` sequences sharing each forward, `exec.lockstep`), what a step adds beyond a plain step
  every other sequence waits for too: its extra seconds count `company` times, and nodes and draft forwards are
  priced at the batch's rate, so a step speculates only where the batch as a whole gains (plain steps win
  sooner the more sequences share a forward and the more each extra row costs). A probe there waits until the
  credit covers the draft catching up on the text it skipped, since everyone waits for that too; and rates
  measured in one size of company (alone, 2-3, 4-7, 8-15, ... sequences) are forgotten in another.
- Kept across processes (`learned`), timings are a start, not the truth: the process that took them may have
  met a busy machine or another build, and a size priced too dear is never run again to be timed anew. So this
  process's own timings of a size replace the kept ones (three of them, or at once where the kept ones say a
  size is slower than a bigger one timed here, or faster than a smaller one), every process ages kept timings,
  an early plain step in each process checks the kept plain speed (where it is off, all that was kept but the
  calibration is measured anew), and a step that read the prompt (its seconds read off the curve, not timed) is
  never a plain step's timing.

None of this can change the output: it only picks the shape of the speculation, and every shape is exact.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

TRUSTED = 3  # forwards of a size before its time counts (until then, its neighbours' line stands in)
AGE = 500  # forwards after which a timing is forgotten
SPAN = AGE // 4  # forwards a process's end ages a timing by: one taken while the machine was busy fades within a few
EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # forward sizes measured apart


class Cost:
    """Seconds per forward of one model by its number of tokens: the median of the last few forwards of each
    size bucket (robust to a warm-up or a busy neighbour), read as a non-decreasing piecewise-linear curve
    (a GPU's is flat; a CPU's nearly flat for several tokens with packed weights, steep from 1 to a few without)."""

    def __init__(self, keep: int = 9):
        self.keep = keep
        self.buckets: dict[int, deque] = {}  # bucket -> recent (tokens, seconds, when: the count at its add)
        self.count = 0  # forwards added so far
        self.kept = 0  # timings with `when` up to this were kept from another process (`restore`)
        self._curve: list[tuple[float, float]] | None = None
        self._at: dict[float, float] = {}  # tokens -> seconds, on the current curve (a step asks dozens of times)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > EDGES[-1] or seconds <= 0:  # a prompt: not a size speculation chooses between
            return
        b = bisect.bisect_left(EDGES, tokens)
        self.count += 1
        seen = self.buckets.setdefault(b, deque(maxlen=self.keep))
        seen.append((tokens, seconds, self.count))
        own = [x for x in seen if x[2] > self.kept]
        if len(own) == TRUSTED < len(seen):  # this process's timings of a size replace those kept from another
            self.buckets[b] = deque(own, maxlen=self.keep)
        self._curve = None
        self._at.clear()

    def fresh(self) -> dict[int, list[tuple[int, float, int]]]:
        """Each bucket's timings of the last AGE forwards: a size no longer run is forgotten, so that timings
        taken while the machine was busy (or in another process) cannot price it out for good."""
        return {b: [x for x in seen if x[2] > self.count - AGE] for b, seen in sorted(self.buckets.items())
                if seen[-1][2] > self.count - AGE}

    def curve(self) -> list[tuple[float, float]]:
        """(tokens, seconds) points, made non-decreasing by pooling adjacent violators (isotonic regression)."""
        if self._curve is None:
            points = []
            fresh = self.fresh()
            trusted = [b for b in fresh if len(fresh[b]) >= TRUSTED]
            for b in trusted or list(fresh):  # a size seen once or twice might have met a hiccup
                seen = fresh[b]
                points.append((sum(x[0] for x in seen) / len(seen), _median([x[1] for x in seen]),
                               all(x[2] > self.kept for x in seen)))
            points = [(n, t) for n, t, own in points if own or _consistent(n, t, points)]
            pooled: list[list] = []  # [points pooled, their mean seconds]
            for _, t in points:
                pooled.append([1, t])
                while len(pooled) > 1 and pooled[-2][1] > pooled[-1][1]:
                    k, t2 = pooled.pop()
                    k1, t1 = pooled[-1]
                    pooled[-1] = [k1 + k, (k1 * t1 + k * t2) / (k1 + k)]
            fitted = [t for k, t in pooled for _ in range(k)]
            self._curve = [(n, t) for (n, _), t in zip(points, fitted)]
        return self._curve

    def __call__(self, tokens: float) -> float:
        seconds = self._at.get(tokens)
        if seconds is None:
            seconds = self._at[tokens] = self._read(tokens)
        return seconds

    def _read(self, tokens: float) -> float:
        points = self.curve()
        if not points:
            return 0.0
        if len(points) == 1:
            return points[0][1]
        # the segment holding `tokens`, or the nearest end segment, extended
        k = next((k for k in range(1, len(points)) if tokens <= points[k][0]), len(points) - 1)
        (n0, t0), (n1, t1) = points[k - 1], points[k]
        slope = (t1 - t0) / (n1 - n0) if n1 > n0 else 0.0
        return max(0.0, t0 + slope * (tokens - n0))

    def forget_kept(self) -> None:
        """Drop the timings kept from another process."""
        self.buckets = {b: deque(own, maxlen=self.keep) for b, seen in self.buckets.items()
                        if (own := [x for x in seen if x[2] > self.kept])}
        self._curve = None
        self._at.clear()

    def timed(self, most: int) -> int:
        """How many sizes up to `most` tokens have fresh timings."""
        return sum(1 for b, seen in self.buckets.items() if EDGES[b] <= most and seen[-1][2] > self.count - AGE)

    def extra(self, tokens: int, more: int) -> float:
        """Seconds `more` tokens add to a forward of `tokens`."""
        return max(0.0, self(tokens + more) - self(tokens)) if more > 0 else 0.0

    def state(self) -> dict:
        """The fresh timings, each with its age in forwards."""
        return {str(b): [[n, t, self.count - when] for n, t, when in seen] for b, seen in self.fresh().items()}

    def restore(self, state: dict) -> None:
        for b, seen in state.items():  # (each process they outlive ages them by SPAN forwards more)
            self.buckets[int(b)] = deque(((int(n), float(t), self.count - int(age) - SPAN) for n, t, age in seen),
                                         maxlen=self.keep)
        self.kept = self.count
        self._curve = None
        self._at.clear()


BINS = 10
TABLES = ("nodes", "groups", "lookups", "trigrams", "heads")
OPTIONAL = ("trigrams", "heads")  # (a state kept before such guesses were verified lacks theirs: their prior stands)
TRIGRAM_TRUST = 0.5
HEADS_TRUST = 0.7
RANKS = 4
MATCHES = (1, 2, 3, 4, 6, 9, 14, 20, 32)  # lookup guesses by the length of the match they extend (a last bin beyond)
SHARES = (0.4, 0.75)  # ... by the share of the match's occurrences that went on with them


@dataclass
class Rate:
    """Hits over tries with a prior, halved when it grows old so that it follows the text."""

    hits: float
    tries: float

    def add(self, hit: bool, cap: float = 400.0) -> None:
        self.hits += hit
        self.tries += 1
        if self.tries > cap:
            self.hits, self.tries = self.hits / 2, self.tries / 2

    @property
    def value(self) -> float:
        return self.hits / self.tries

    def restore(self, state: list) -> None:
        self.hits, self.tries = float(state[0]), float(state[1])


def _consistent(tokens: float, seconds: float, points: list) -> bool:
    """Whether a size's timing kept from another process agrees with this process's own: no size timed here
    with more tokens is faster, none with fewer slower. Kept timings of a process that ran while the machine was
    busy (or on another build) would otherwise price sizes this one never runs again out for good."""
    return all(t >= seconds if n > tokens else t <= seconds for n, t, own in points if own and n != tokens)


def _median(values) -> float:
    """statistics.median's value of `values` (any iterable), without its cost (a step asks for several)."""
    values = sorted(values)
    half = len(values) // 2
    return values[half] if len(values) % 2 else (values[half - 1] + values[half]) / 2


def _bin(q: float) -> int:
    return min(BINS - 1, max(0, int(q * BINS)))


def _lookup_bins(match: int, share: float, rank: int) -> tuple[int, int, int]:
    return bisect.bisect_left(MATCHES, match), bisect.bisect_right(SHARES, share), min(rank, 1)


class Calibration:
    """P(a child is accepted | its parent was, and the siblings tested before it were not): of a drafted child
    by the draft's probability of it and its rank, of a lookup guess (`spec_cli.draft2.lookup`) by the length of the
    match it extends, the share of the match's occurrences that went on with it, and whether it is the first
    of its siblings; of a trigram's guess (a step without the draft, `spec_cli.decoding.staged._trigram`) by its
    probability under the trigram and whether a lookup guess is its sibling; of a fitted head's
    (`spec_cli.draft2.heads`) by the head (its depth), its probability and whether it is its parent's first child."""

    def __init__(self):
        prior = 2.0  # pseudo-tries at the draft's own probability (a calibrated draft)
        self.nodes = [[Rate(prior * (b + 0.5) / BINS, prior) for b in range(BINS)] for _ in range(RANKS)]
        self.groups = [Rate(prior * (b + 0.5) / BINS, prior) for b in range(BINS)]
        # lookup guesses: a longer match is likelier copied on, a shared continuation likelier than a lone one
        self.lookups = [[[Rate(prior * min(0.9, 0.25 + 0.08 * m) * (0.5 + 0.25 * s) * (1 - 0.5 * r), prior)
                          for r in range(2)] for s in range(len(SHARES) + 1)] for m in range(len(MATCHES) + 1)]
        # a trigram's guesses: fitted on other text than this, so trusted at half its probability until measured
        self.trigrams = [[Rate(prior * TRIGRAM_TRUST * (b + 0.5) / BINS, prior) for b in range(BINS)] for _ in range(2)]
        # the heads' guesses: fitted on other text than this, trusted below their probability until measured
        self.heads = [[[Rate(prior * HEADS_TRUST * (b + 0.5) / BINS, prior) for b in range(BINS)] for _ in range(2)]
                      for _ in range(2)]

    def node(self, q: float, rank: int) -> float:
        return self.nodes[min(rank, RANKS - 1)][_bin(q)].value

    def group(self, top: float) -> float:
        """P(a sampled sibling group yields the accepted token), by the draft's top probability at the parent."""
        return self.groups[_bin(top)].value

    def add_node(self, q: float, rank: int, accepted: bool) -> None:
        self.nodes[min(rank, RANKS - 1)][_bin(q)].add(accepted)

    def add_group(self, top: float, accepted: bool) -> None:
        self.groups[_bin(top)].add(accepted)

    def lookup(self, match: int, share: float, rank: int) -> float:
        m, s, r = _lookup_bins(match, share, rank)
        return self.lookups[m][s][r].value

    def add_lookup(self, match: int, share: float, rank: int, accepted: bool) -> None:
        m, s, r = _lookup_bins(match, share, rank)
        self.lookups[m][s][r].add(accepted)

    def trigram(self, p: float, rank: int) -> float:
        return self.trigrams[min(rank, 1)][_bin(p)].value

    def add_trigram(self, p: float, rank: int, accepted: bool) -> None:
        self.trigrams[min(rank, 1)][_bin(p)].add(accepted)

    def head(self, depth: int, p: float, rank: int) -> float:
        return self.heads[min(depth, 2) - 1][min(rank, 1)][_bin(p)].value

    def add_head(self, depth: int, p: float, rank: int, accepted: bool) -> None:
        self.heads[min(depth, 2) - 1][min(rank, 1)][_bin(p)].add(accepted)

    def state(self) -> dict:
        return {name: _rates(getattr(self, name), lambda r: [r.hits, r.tries]) for name in TABLES}

    def restore(self, state: dict) -> None:
        for name in TABLES:
            if name in state or name not in OPTIONAL:
                _restore(getattr(self, name), state[name])


def _rates(table, each):
    """A nested list of Rates, each turned into `each(rate)`."""
    return [_rates(x, each) for x in table] if isinstance(table, list) else each(table)


def _restore(table: list, state: list) -> None:
    if len(table) != len(state):
        raise ValueError("a calibration table of another shape")
    for rate, saved in zip(table, state):
        _restore(rate, saved) if isinstance(rate, list) else rate.restore(saved)


@dataclass
class Mean:
    value: float
    decay: float = 0.95

    def add(self, x: float) -> None:
        self.value = self.decay * self.value + (1 - self.decay) * x


PROBE_FIRST, PROBE_MAX, PROBE_NEW_TEXT, REFRESH = 2, 256, 1, 64
READ_ANYWAY = 32  # text the draft may read before a step whatever the completion has left (`worth_reading`)
PROBE_SHARE = 0.03  # probes that lose may cost at most this share of plain decoding's time
PROBE_SHARE_LOSING = 0.01  # ... and this much once probes have kept losing (the draft is no use on this text)
BURST = 3  # a probe: up to this many speculative steps, judged together (one step's tokens are a lottery)
WIN = 1.05  # speculating pays when it beats plain decoding by this much (a near tie is noise, and noise costs)
PLAIN_KEEP = 15  # plain steps whose lower quartile is plain decoding's speed
PLAIN_FIRST = 3  # ... and how many are measured before it is trusted (the first ones may meet cold starts)
KEPT_DRIFT = 1.5  # a plain speed kept from another process this far from this one's: its rates are not this one's
RECENT = 0.8  # per step: the reference rate follows the text within a few steps
LOOK_SKIP_MAX = 8  # completions without a look, at most, after new completions' looks kept losing
GUESS_PROBE = 8  # while guessing loses even where the text repeats, one cue in this many is still followed
COLD_PRICE = 0.15  # tokens a verified node costs before any timing says (near what a row adds to a CPU's int4 forward)


@dataclass
class Probe:
    """Speculative steps taken to test whether speculating pays again, and what they brought."""

    left: int = BURST
    charged: bool = True  # paid from the credit (a new completion's look is paid by the completion)
    tokens: float = 0.0
    seconds: float = 0.0
    spent: float = 0.0


@dataclass
class Step:
    """One staged step as it went, reported to the policy at its end: what it brought, what each part took, and
    how the draft and the oracle judged the guesses."""

    speculated: bool  # whether the draft ran (else the oracle alone, with any guesses copied from the text)
    tokens: int  # output tokens
    verified: int  # draft nodes (or lookup guesses) the oracle was given
    oracle_tail: int  # tokens the oracle committed first (its pending tail: one, or the prompt)
    oracle_seconds: float  # its forward and the walk down the tree
    draft_tail: int = 0  # tokens the draft caught up on in its first forward
    prompt_left: int = 0  # of those, the prompt's
    drafts: list[tuple[int, float]] = field(default_factory=list)  # each draft forward: tokens, seconds
    drafting: float = 0.0  # seconds the tree took to grow, all told (the draft's, or the lookup's)
    drafter: str = ""  # draft2's kind
    guesses: list[bool] = field(default_factory=list)  # draft2's guesses as the draft checked them: kept?
    nodes: list[tuple[float, int, bool]] = field(default_factory=list)  # children judged: q, rank, accepted?
    groups: list[tuple[float, bool]] = field(default_factory=list)  # sampled groups judged: top q, accepted?
    lookups: list[tuple[int, float, int, bool]] = field(default_factory=list)  # lookup guesses judged: match,
    # share, rank, accepted?
    trigrams: list[tuple[float, int, bool]] = field(default_factory=list)  # trigram guesses judged: p, rank,
    # accepted?
    heads: list[tuple[int, float, int, bool]] = field(default_factory=list)  # the heads' guesses judged: depth, p,
    # rank, accepted?
    wall: float | None = None  # all the step took, from its start to the next one's (the host's work around the
    # forwards, the caller's with its tokens: on a GPU as much as a small model's forward); None: not known


@dataclass
class Policy:
    """How much a staged step speculates: the questions it asks, answered for a fixed shape (the settings'
    caps as they are). Only the calibration learns, from each step's report."""

    calibration: Calibration = field(default_factory=Calibration)
    company: int = 1  # sequences whose forwards this one's share (`exec.lockstep`): each waits for the rows it adds
    row_seconds: float | None = None  # in company: what one more row adds to a shared forward (measured there)

    def seat(self, company: int, row_seconds: float | None) -> None:
        """This step's `company` (sequences sharing its forwards) and what a shared row costs there."""
        self.company, self.row_seconds = company, row_seconds

    def begin(self) -> None:
        """A new completion begins."""

    def speculate(self, cue=None, catch_up: int = 0, remaining: int | None = None) -> bool:
        """Whether this step speculates (`cue()`: whether the text has just started repeating itself;
        `catch_up`: the tokens the draft would read first, the text it has not seen; `remaining`: the tokens
        the completion may still produce)."""
        return True

    def guess(self, cue=None, priced: bool = False) -> bool:
        """Whether a step that does not speculate verifies the lookup's guesses (else: the oracle alone);
        `priced`: the step's guesses come with their own chances (fitted heads'), so each is priced as it stands."""
        return True

    def price(self, before: int):
        """What verifying n draft nodes after the oracle's `before` tokens costs, in tokens: a function of n, or
        None where nodes are free (the budget alone limits them)."""
        return None

    def chain(self, worth: float, length: int, before: int, drafter: str) -> int:
        """How many of draft2's `length` guesses below a node of `worth` to run, in a draft forward of `before`
        tokens so far."""
        return length

    def expand(self, values: list[float], levels: int, planned: int, oracle_tail: int) -> int:
        """How many of the best unexpanded nodes (their `values`, best first) the draft runs next (0: stop);
        `levels`: how many forwards could follow below the best one; `planned`: nodes the oracle would get."""
        return len(values)

    def report(self, step: Step) -> None:
        for q, rank, accepted in step.nodes:
            self.calibration.add_node(q, rank, accepted)
        for top, accepted in step.groups:
            self.calibration.add_group(top, accepted)
        for match, share, rank, accepted in step.lookups:
            self.calibration.add_lookup(match, share, rank, accepted)
        for p, rank, accepted in step.trigrams:
            self.calibration.add_trigram(p, rank, accepted)
        for depth, p, rank, accepted in step.heads:
            self.calibration.add_head(depth, p, rank, accepted)


@dataclass
class Controller(Policy):
    """A policy that measures: one oracle/draft pair on this machine, for one way of decoding, kept across
    completions."""

    oracle: Cost = field(default_factory=Cost)
    draft: Cost = field(default_factory=Cost)
    drafter: dict = field(default_factory=dict)  # draft2 kind -> Rate of its guesses the draft confirms
    top: Mean = field(default_factory=lambda: Mean(0.6))  # calibrated acceptance of a node's best child
    spec_tokens: float = 0.0
    spec_seconds: float = 0.0
    guess_tokens: float = 0.0  # steps that verified the lookup's guesses without the draft, decayed as spec_*
    guess_seconds: float = 0.0
    recent_tokens: float = 0.0  # this completion's steps, every kind, decayed per step (see reference)
    recent_seconds: float = 0.0
    plain: deque = field(default_factory=lambda: deque(maxlen=PLAIN_KEEP))  # recent plain steps' seconds per token
    plain_own: int = 0  # plain steps timed in this process (the others kept from another: see _check_kept)
    since_plain: int = 0  # speculative steps since the last plain one
    since_alone: int = 0  # steps since the last one of the oracle alone (no draft, no guesses)
    cue_tokens: float = 0.0  # ... those of them taken on a cue (the text repeating itself), decayed alike
    cue_seconds: float = 0.0
    cues: int = 0  # cues met while guessing even on cues lost (every GUESS_PROBE-th is followed)
    cued: bool = False  # whether the step under way guesses on a cue
    plain_run: int = 0  # plain steps in a row
    credit: float = 0.0  # seconds probes may still lose: PROBE_SHARE of each plain step's time, less their losses
    probe_loss: float = 0.0  # what the last losing probe lost (seconds): a timed probe waits for that much credit
    catch_up: float = 0.0  # in company: what the draft reading the text it skipped would cost the batch (seconds)
    wins: Mean = field(default_factory=lambda: Mean(0.5, decay=0.8))  # how often probes have won lately
    steps: int = 0  # steps into the current completion
    probe_new_text: bool = False  # one probe early in a new completion, whatever the wait
    looks_lost: int = 0  # new completions' looks lost in a row
    look_skip: int = 0  # completions to begin without a look
    probe: Probe | None = None  # the probe under way
    unsure: int = 0  # speculative steps in a row whose draft offered the oracle nothing
    hold: int = 0  # plain steps to take after such a step before looking at the draft again

    # --- what it learned, kept across processes (spec_cli.decoding.learned) -------------------------------------------
    def state(self) -> dict:
        """What this controller learned of the machine, the models and the text so far: costs, calibration,
        draft2's rates, whether speculating pays and how probes fared (not the completion under way)."""
        return {"oracle": self.oracle.state(), "draft": self.draft.state(), "calibration": self.calibration.state(),
                "drafter": {kind: [r.hits, r.tries] for kind, r in self.drafter.items()}, "top": self.top.value,
                "spec": [self.spec_tokens, self.spec_seconds], "guess": [self.guess_tokens, self.guess_seconds],
                "cue": [self.cue_tokens, self.cue_seconds],
                "plain": list(self.plain), "wins": self.wins.value,
                "credit": self.credit, "probe_loss": self.probe_loss, "looks_lost": self.looks_lost,
                "look_skip": self.look_skip}

    def restore(self, state: dict) -> None:
        """Start from what `state()` kept (a ValueError, KeyError or TypeError when it is not one)."""
        self.oracle.restore(state["oracle"])
        self.draft.restore(state["draft"])
        self.calibration.restore(state["calibration"])
        for kind, saved in state["drafter"].items():
            self.drafter_rate(kind).restore(saved)
        self.top.value, self.wins.value = float(state["top"]), float(state["wins"])
        self.spec_tokens, self.spec_seconds = (float(x) for x in state["spec"])
        self.guess_tokens, self.guess_seconds = (float(x) for x in state.get("guess", (0.0, 0.0)))
        self.cue_tokens, self.cue_seconds = (float(x) for x in state.get("cue", (0.0, 0.0)))
        self.plain.extend(float(x) for x in state["plain"])
        self.credit, self.probe_loss = float(state["credit"]), float(state["probe_loss"])
        self.looks_lost, self.look_skip = int(state["looks_lost"]), int(state["look_skip"])

    def forget_rates(self) -> None:
        """Keep the costs and the calibration, measure anew whether speculating pays (where the steps cost
        otherwise: a server's slot, beside the others)."""
        self.spec_tokens = self.spec_seconds = self.guess_tokens = self.guess_seconds = 0.0
        self.cue_tokens = self.cue_seconds = 0.0
        self.credit = self.probe_loss = self.catch_up = 0.0
        self.recent_tokens = self.recent_seconds = 0.0
        self.plain.clear()
        self.since_plain = self.since_alone = self.plain_run = self.plain_own = 0
        self.probe, self.unsure, self.hold = None, 0, 0

    def seat(self, company: int, row_seconds: float | None) -> None:
        """As Policy's; and where the company changes its size class (alone, 2-3, 4-7, 8-15, ... sequences), the
        rates measured in the old one are forgotten (`forget_rates`): a plain step beside 15 others takes several
        times one alone, so a server's slot that learned alone that speculating pays would go on speculating in a
        crowd, judged against plain steps it timed alone."""
        if company.bit_length() != self.company.bit_length():
            self.forget_rates()
        super().seat(company, row_seconds)

    def drafter_rate(self, kind: str) -> Rate:
        if kind not in self.drafter:
            self.drafter[kind] = Rate(1.0, 2.0)
        return self.drafter[kind]

    # --- the tree's shape: a step maximises tokens - reference * seconds (Dinkelbach) ---------------------
    def price(self, before: int):
        """What n verified nodes cost, in tokens: the recent rate times the seconds they add to the oracle's
        forward; COLD_PRICE a node until two of a speculation's sizes have been timed (on a new machine: a
        prompt's forward alone would extrapolate to flat costs)."""
        rate = self.reference * self.company
        if rate and self.shared:
            return lambda n: rate * self.row_seconds * n
        if not rate or self.oracle.timed(16) < 2:
            return lambda n: COLD_PRICE * n * self.company
        return lambda n: rate * self.oracle.extra(before, n)

    @property
    def shared(self) -> bool:
        """Whether verified rows are priced at the shared forward's cost of a row (in company, once measured)."""
        return self.company > 1 and self.row_seconds is not None

    def chain(self, worth: float, length: int, before: int, drafter: str) -> int:
        """The i-th guess is worth something only if draft2, the draft and the oracle agree all the way to it; it
        must bring the tokens its place in the draft's forward costs at the rate we already get."""
        if not self.reference:
            return length
        agree = self.drafter_rate(drafter).value * self.top.value
        each = self.reference * self.company * self.draft.extra(before, length) / length
        return sum(1 for i in range(1, length + 1) if worth * agree**i >= each)

    def expand(self, values: list[float], levels: int, planned: int, oracle_tail: int) -> int:
        """Running k of the nodes adds about their best child each; it may also open a line of m more forwards
        below the best one. The draft forwards and the oracle slots are paid at the rate we already get. Looking
        m forwards ahead matters where costs are concave: on a CPU the oracle's second token costs far more
        than its tenth."""
        rate = self.reference * self.company
        if not rate:
            return len(values)
        top = self.top.value
        best, best_net, gain = 0, 0.0, 0.0
        for k, value in enumerate(values, 1):
            gain += value * top
            deeper = 0.0
            for m in range(levels + 1):
                if m:
                    deeper += values[0] * top ** (m + 1)
                verifying = ((k + m) * self.row_seconds if self.shared
                             else self.oracle.extra(oracle_tail + planned, k + m))
                seconds = self.draft(k) + m * self.draft(1) + verifying
                net = gain + deeper - rate * seconds
                if net > best_net:
                    best, best_net = k, net
        return best

    # --- what each step did ------------------------------------------------------------------------------
    def report(self, step: Step) -> None:
        super().report(step)
        for q, rank, accepted in step.nodes:
            if rank == 0:
                self.top.add(float(accepted))
        for kept in step.guesses:
            self.drafter_rate(step.drafter).add(kept)
        for tokens, seconds in step.drafts:
            self.draft.add(tokens, seconds)
        self.oracle.add(step.oracle_tail + step.verified, step.oracle_seconds)
        self.observe(step.speculated, step.tokens, *self._seconds(step), verified=step.verified > 0,
                     guessed=step.verified > 0 and not step.speculated, timed=step.oracle_tail <= 1)

    def _seconds(self, step: Step) -> tuple[float, float]:
        """(the seconds that count towards the step's rate, all it cost but reading the prompt: once per
        completion, whatever it does). The draft catching up (the prompt, plain steps) is not the tree's cost."""
        seconds = step.oracle_seconds
        if step.oracle_tail > 1:  # the prompt went through with this step: count the step as if it had not
            seconds = self.oracle(1 + step.verified)
        if step.wall is not None:  # the rest of the step: the host's work, which a plain step pays less of
            seconds += max(0.0, step.wall - step.oracle_seconds - step.drafting)
        spent = seconds
        if step.speculated:  # (the cost curve is an estimate)
            reading = self.draft(step.draft_tail) - self.draft(step.draft_tail - step.prompt_left)
            catching_up = self.draft(step.draft_tail) - self.draft(1)
            spent += max(0.0, step.drafting - max(0.0, reading))
            seconds += max(0.0, step.drafting - max(0.0, catching_up))
        else:  # guesses copied from the text, with no model: their time counts whole
            seconds += step.drafting
            spent += step.drafting
        if self.company > 1 and step.verified and self.plain:  # in company, what a step takes beyond a plain
            extra = self.company - 1  # step's, every other sequence waits for too: the batch's rate is the measure
            plain = self.plain_seconds  # (a plain step: one token)
            seconds += extra * max(0.0, seconds - plain)
            spent += extra * max(0.0, spent - plain)
        return seconds, spent

    # --- plain or speculative -------------------------------------------------------------------------
    @property
    def spec_rate(self) -> float | None:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds else None

    @property
    def guess_rate(self) -> float | None:
        return self.guess_tokens / self.guess_seconds if self.guess_seconds else None

    @property
    def plain_seconds(self) -> float:
        """A plain step's seconds: the lower quartile of recent ones. Plain steps are few and far between while
        speculating, and one that met a busy neighbour or a cold start (a process's first steps: kernels built,
        graphs captured) must not make speculating look better; neither makes a step faster."""
        return sorted(self.plain)[(len(self.plain) - 1) // 4]

    @property
    def plain_rate(self) -> float | None:
        """Plain decoding's tokens per second (`plain_seconds`)."""
        return 1 / self.plain_seconds if self.plain else None

    @property
    def reference(self) -> float:
        """Tokens per second a step must beat (Dinkelbach's ratio): what this completion's steps of every kind
        have brought lately, and never less than plain decoding. Not the speculative steps' rate alone: after a
        fast copy run, fresh text would have to beat the copy's rate and a draft right nine times in ten would
        go unverified, though plain decoding, the real alternative, brings a fraction of it."""
        recent = self.recent_tokens / self.recent_seconds if self.recent_seconds else 0.0
        return max(recent, self.plain_rate or 0.0)

    def begin(self) -> None:
        """A new completion is new text, where speculation may pay though it did not lately: a one-step look
        early in it, whatever earlier text's probes lost (its cost is bounded per completion). A look costs the
        draft reading the prompt: while looks keep losing, some completions begin without one (see _probed)."""
        self.steps = 0
        self.recent_tokens = self.recent_seconds = 0.0
        self.probe_new_text = self.look_skip == 0
        self.look_skip = max(0, self.look_skip - 1)

    def speculate(self, cue=None, catch_up: int = 0, remaining: int | None = None) -> bool:
        """Whether this step speculates. `cue()`: whether the text has just started repeating itself (asked
        only when a cue could start a probe), where speculation may pay though it did not lately. `catch_up`:
        the tokens the draft would read first; in company every sequence waits for that, so a probe there waits
        until the credit covers it (beside 15 others, the draft reading a 300-token prompt costs the batch what
        a dozen of its plain steps do: a crowd's probes would cost more than the credit can ever pay); alone,
        a read that what speculating saves over the `remaining` tokens cannot pay for is not begun (a short
        answer to a long prompt)."""
        spec, plain = self.spec_rate, self.plain_rate
        alone = self.company == 1  # (in company: plain steps first, speculation only probed, never a free look)
        if alone and not self.worth_reading(catch_up, remaining):
            return False
        if spec is None and alone:
            return True
        if plain is None or len(self.plain) < PLAIN_FIRST:  # two speculative steps, then one plain step to
            return alone and self.since_plain < 2  # measure it, until plain decoding's speed is known
        if self.probe is not None:
            return True
        if not self.plain_own and self.since_plain >= 2:
            return False  # one plain step checks the plain speed kept from another process (see observe)
        if self.since_plain >= REFRESH:
            return False  # plain decoding's speed drifts with the context: measure it again now and then
        if spec is not None and spec >= WIN * plain:  # speculating pays (a near tie is noise: plain steps are the
            return self.plain_run >= self.hold  # safe side); after a step whose draft was unsure, a few plain ones
        # losing: a probe now and then. A new completion gets a one-step look, paid by the completion; the
        # rest are paid from one credit (see observe): a timed probe waits until the credit covers what the
        # last one lost, a cue (evidence that speculation may pay again) gets a burst while the credit is not
        # overdrawn, else one step while the overdraft is under one probe's loss.
        new_text = self.probe_new_text and self.steps >= PROBE_NEW_TEXT and alone
        if self.plain_run < PROBE_FIRST and not new_text:
            return False
        self.catch_up = 0.0 if alone else self.company * self.draft(catch_up)
        if not alone and self.credit < self.catch_up:
            return False
        if new_text:  # a one-step look, paid by the completion (see _probed), whatever the credit
            self.probe_new_text = False
            self.probe = Probe(left=1, charged=False)
            return True
        if self.credit >= self.probe_loss:
            left = BURST
        elif self.credit >= -self.probe_loss and cue is not None and cue():
            left = BURST if self.credit >= 0 else 1
        else:
            return False
        self.probe = Probe(left=left)
        return True

    def worth_reading(self, catch_up: int, remaining: int | None) -> bool:
        """Whether the draft's reading `catch_up` tokens first costs less than speculating saves over the
        `remaining` tokens, at the rates measured (the Qwen 0.5B reads 512 tokens in ~1.2 s on a 2-core Xeon,
        what speculating saves over ~40 of the 1.5B's tokens there); a read of a few tokens, or rates not known
        yet: yes."""
        spec, plain = self.spec_rate, self.plain_rate
        if catch_up <= READ_ANYWAY or remaining is None or spec is None or plain is None or spec <= plain:
            return True
        return self.draft(catch_up) - self.draft(1) < remaining * (1 / plain - 1 / spec)

    def guess(self, cue=None, priced: bool = False) -> bool:
        """Whether a step that does not speculate verifies the lookup's guesses: while such steps beat the
        oracle alone, measured (its steps' whole time: the extra rows, the walk; on a GPU a sampled walk is
        dozens of small kernels), else where the text starts repeating itself (`cue()`), a copy the guesses may
        follow; and while even those lose (sampling that leaves the copies), one cue in GUESS_PROBE, to measure
        again. The oracle alone is measured first, and again now and then: its rate is what every other kind
        of step must beat. A step whose guesses come with chances of their own (`priced`: fitted heads', guessing
        new text at every step) guesses between those measures: the tree's prices then decide, node by node, what
        pays its row; a step of guesses none of which does is a plain step. (The 1.5B coder alone, warm, on a Xeon:
        1.53x its baseline so, 1.40x with its heads' steps gated by the guesses' recent rate, which a few refused
        steps put below plain decoding's for long: benchmarks/reports.)"""
        if not self.plain or self.since_alone >= REFRESH:
            return False
        if priced:
            return True
        rate, plain = self.guess_rate, self.plain_rate
        if rate is None or rate >= plain:
            return True
        if cue is None or not cue():
            return False
        on_cue = self.cue_tokens / self.cue_seconds if self.cue_seconds else None
        if on_cue is None or on_cue >= plain:
            self.cued = True
            return True
        self.cues += 1
        self.cued = self.cues % GUESS_PROBE == 0
        return self.cued

    def observe(self, speculated: bool, tokens: int, seconds: float, spent: float | None = None,
                verified: bool = True, guessed: bool = False, timed: bool = True) -> None:
        """A step's tokens and the seconds that count towards its rate; `spent`: all it took (a probe also
        pays for the draft catching up on the text it skipped); `verified`: whether the oracle was given
        any of the draft's tokens (a step whose draft was too unsure to offer any is a plain step that
        paid for a look at the draft); `guessed`: whether a step without the draft verified the lookup's
        guesses (its rate is the guesses', not plain decoding's); `timed`: whether `seconds` were measured, not
        read off the cost curve (a step that read the prompt)."""
        decay = 0.9
        self.steps += 1
        self.recent_tokens = RECENT * self.recent_tokens + tokens
        self.recent_seconds = RECENT * self.recent_seconds + seconds
        self.since_alone = self.since_alone + 1 if speculated or guessed else 0
        if guessed:
            self.guess_tokens = decay * self.guess_tokens + tokens
            self.guess_seconds = decay * self.guess_seconds + seconds
            if self.cued:
                self.cue_tokens = decay * self.cue_tokens + tokens
                self.cue_seconds = decay * self.cue_seconds + seconds
        self.cued = False
        if speculated:
            self.probe_new_text = False
            self.spec_tokens = decay * self.spec_tokens + tokens
            self.spec_seconds = decay * self.spec_seconds + seconds
            self.since_plain += 1
            self.plain_run = 0
            self._held(verified, tokens, seconds if spent is None else spent)
            if self.probe is not None:
                self._probed(tokens, seconds, seconds if spent is None else spent, verified)
        else:  # the oracle alone, or with guesses copied from the text
            if not guessed and seconds > 0 and timed:
                if not self.plain_own and self.plain:
                    self._check_kept(seconds / tokens)
                self.plain.append(seconds / tokens)
                self.plain_own += 1
            self.since_plain = 0
            self.plain_run += 1
            earned = self.share * seconds
            self.credit = min(self.credit + earned, max(self.probe_loss, self.catch_up, earned))

    def _check_kept(self, seconds: float) -> None:
        """This process's first plain step against the plain speed kept from another (a busy machine's, another
        build's): where they differ by more than KEPT_DRIFT, so did every speed there, and the timings and rates
        kept are measured anew, as a new controller's (the calibration stays: it is the text's, not the machine's)."""
        if 1 / KEPT_DRIFT <= seconds / self.plain_seconds <= KEPT_DRIFT:
            return
        self.forget_rates()
        self.oracle.forget_kept()
        self.draft.forget_kept()

    @property
    def share(self) -> float:
        """The share of plain decoding's time that losing probes may cost: PROBE_SHARE while they win now and
        then, down to PROBE_SHARE_LOSING as they keep losing."""
        return PROBE_SHARE_LOSING + (PROBE_SHARE - PROBE_SHARE_LOSING) * min(1.0, 2 * self.wins.value)

    def _held(self, verified: bool, tokens: float, spent: float) -> None:
        """After a step whose draft offered nothing, plain steps before the next look: 1, 2, 4, ... while
        the draft stays unsure (an unsure spot is often followed by others), at most what keeps such looks
        within PROBE_SHARE of the time."""
        if verified:
            self.unsure = self.hold = 0
            return
        self.unsure += 1
        self.hold = min(2 ** (self.unsure - 1), max(1, self._paid_for(tokens, spent)), PROBE_MAX)

    def _paid_for(self, tokens: float, spent: float) -> int:
        """Plain steps after which speculative steps that brought `tokens` in `spent` seconds have cost at most
        PROBE_SHARE of the time (what they took beyond plain decoding's time for their tokens)."""
        if not self.plain_rate:
            return 0
        step = 1 / self.plain_rate
        return math.ceil(max(0.0, spent - tokens * step) / step / PROBE_SHARE)

    def _probed(self, tokens: float, seconds: float, spent: float, verified: bool) -> None:
        """A probe's step: judged with the probe's other steps when it ends (after BURST steps, or at once
        when the draft offered nothing: the text is not one it can guess). A probe that wins makes its
        rate the speculative rate (the text changed); one that loses sets the wait so that such probes
        cost at most PROBE_SHARE of the time: a look at a draft too unsure to offer anything costs one
        draft forward, so the next look comes soon; a probe whose guesses the oracle refused costs more,
        and teaches the calibration to offer fewer."""
        probe = self.probe
        probe.tokens += tokens
        probe.seconds += seconds
        probe.spent += spent
        probe.left -= 1
        if probe.left > 0 and verified:
            return
        self.probe = None
        plain = self.plain_rate
        won = plain is None or probe.tokens / probe.seconds >= WIN * plain
        if probe.charged:
            self.wins.add(float(won))
        else:  # a new completion's look: after a few lost in a row, completions 1, 3, 7, ... begin without one
            self.looks_lost = 0 if won else self.looks_lost + 1
            self.look_skip = min(LOOK_SKIP_MAX, 2 ** (self.looks_lost - 1) - 1) if self.looks_lost else 0
        if won:
            self.spec_tokens, self.spec_seconds = probe.tokens, probe.seconds
            return
        if probe.charged:
            self.probe_loss = max(0.0, probe.spent - probe.tokens / plain)
            self.credit -= self.probe_loss
