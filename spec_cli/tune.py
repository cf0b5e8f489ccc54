"""Tuning on this machine: the self-draft's skip set (Bayesian optimisation) and the speculation shape
(successive halving), both by measuring real tokens/s of exact decoding on a few prompts. No Rich here:
progress goes to a callback; each finding is returned for the caller to save.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spec_cli.completion import complete
from spec_cli.core.errors import SpecError
from spec_cli.core.families import num_layers
from spec_cli.core.settings import TREE_RULES, Decoding, SelfDraft
from spec_cli.engine import Plan

Progress = Callable[[str, float, float], None]  # (what, done, total)


def _quiet(what: str, done: float, total: float) -> None:
    pass


@dataclass
class Score:
    tokens: int
    seconds: float
    oracle_forwards: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def measure(engine, prompts: list[list[int]], plan: Plan | Decoding) -> Score:
    """Tokens/s of `plan` over `prompts` (each completion timed from its first forward)."""
    tokens = forwards = 0
    seconds = 0.0
    for ids in prompts:
        done = complete(engine, ids, plan)
        if done.interrupted:
            raise KeyboardInterrupt
        seconds += done.seconds
        tokens += done.stats.new_tokens
        forwards += done.stats.oracle_forwards
    return Score(tokens, seconds, forwards)


# --- the self-draft's skip set: Bayesian optimisation over which sublayers to skip ------------------------

def encode_skip(skip: SelfDraft, layers: int) -> tuple[int, ...]:
    return tuple(int(i in skip.skip_attention) for i in range(layers)) + \
        tuple(int(i in skip.skip_mlp) for i in range(layers))


def decode_skip(x: tuple[int, ...], layers: int) -> SelfDraft:
    return SelfDraft(tuple(i for i in range(layers) if x[i]), tuple(i for i in range(layers) if x[layers + i]))


class HammingGP:
    """A Gaussian process on {0,1}^d with kernel exp(-hamming / lengthscale); hyperparameters by evidence."""

    def __init__(self, xs: list[tuple[int, ...]], ys: list[float]):
        self.x = torch.tensor(xs, dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64)
        self.mean, self.scale = float(y.mean()), float(y.std()) if len(ys) > 1 and float(y.std()) > 0 else 1.0
        self.y = (y - self.mean) / self.scale
        d = self.x.shape[1]
        best = None
        for lengthscale in (d / 16, d / 8, d / 4, d / 2, d):
            for noise in (1e-3, 1e-2, 1e-1, 0.3):
                fit = self._fit(lengthscale, noise)
                if fit is not None and (best is None or fit[0] > best[0]):
                    best = fit
        _, self.lengthscale, self.noise, self.chol, self.alpha = best

    def _kernel(self, a: torch.Tensor, b: torch.Tensor, lengthscale: float) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b, p=1) / lengthscale)

    def _fit(self, lengthscale: float, noise: float):
        k = self._kernel(self.x, self.x, lengthscale) + noise * torch.eye(len(self.x), dtype=torch.float64)
        chol, info = torch.linalg.cholesky_ex(k)
        if int(info):
            return None
        alpha = torch.cholesky_solve(self.y[:, None], chol)
        evidence = -0.5 * float(self.y @ alpha[:, 0]) - float(torch.log(torch.diagonal(chol)).sum())
        return evidence, lengthscale, noise, chol, alpha

    def predict(self, xs: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor(xs, dtype=torch.float64)
        k = self._kernel(x, self.x, self.lengthscale)
        mean = (k @ self.alpha)[:, 0]
        v = torch.cholesky_solve(k.T, self.chol)
        var = torch.clamp(1 + self.noise - (k * v.T).sum(-1), min=1e-12)
        return mean * self.scale + self.mean, var.sqrt() * self.scale


def expected_improvement(mean: torch.Tensor, std: torch.Tensor, best: float) -> torch.Tensor:
    z = (mean - best) / std
    normal = torch.distributions.Normal(0.0, 1.0)
    return (mean - best) * normal.cdf(z) + std * torch.exp(normal.log_prob(z))


def _random_point(rng: random.Random, d: int) -> tuple[int, ...]:
    fraction = rng.uniform(0.15, 0.6)  # Draft & Verify skips about half the sublayers of big models
    return tuple(int(rng.random() < fraction) for _ in range(d))


def _neighbours(x: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = []
    for i in range(len(x)):
        out.append(x[:i] + (1 - x[i],) + x[i + 1:])
        for j in range(i + 1, len(x)):
            if x[i] != x[j]:  # swap a skipped and a kept sublayer
                y = list(x)
                y[i], y[j] = y[j], y[i]
                out.append(tuple(y))
    return out


def propose_skip(observed: dict[tuple[int, ...], float], d: int, rng: random.Random, initial: int = 6,
                 candidates: int = 512) -> tuple[int, ...]:
    """The next skip set to measure: random at first, then the best expected improvement under a GP."""
    fresh = lambda x: x not in observed and any(x)  # noqa: E731  (never the empty set: that drafts nothing)
    if len(observed) < initial:
        while True:
            x = _random_point(rng, d)
            if fresh(x):
                return x
    xs, ys = list(observed), list(observed.values())
    gp = HammingGP(xs, ys)
    top = sorted(observed, key=observed.get, reverse=True)[:3]
    pool = {x for t in top for x in _neighbours(t)} | {_random_point(rng, d) for _ in range(candidates)}
    pool = [x for x in pool if fresh(x)]
    if not pool:
        return _random_point(rng, d)
    mean, std = gp.predict(pool)
    ei = expected_improvement(mean, std, max(ys))
    return pool[int(ei.argmax())]


@dataclass
class SkipSearch:
    layers: int
    observations: dict[tuple[int, ...], float] = field(default_factory=dict)  # skip vector -> speedup

    def best(self) -> tuple[SelfDraft, float] | None:
        if not self.observations:
            return None
        x = max(self.observations, key=self.observations.get)
        return decode_skip(x, self.layers), self.observations[x]

    def as_records(self) -> list[dict]:
        return [{**vars(decode_skip(x, self.layers)), "speedup": round(s, 4)} for x, s in self.observations.items()]

    @classmethod
    def from_records(cls, layers: int, records: list[dict]) -> "SkipSearch":
        search = cls(layers)
        for r in records:
            skip = SelfDraft(tuple(r["skip_attention"]), tuple(r["skip_mlp"]))
            if all(i < layers for i in skip.skip_attention + skip.skip_mlp):
                search.observations[encode_skip(skip, layers)] = float(r["speedup"])
        return search


def search_skip(engine, prompts: list[list[int]], base: Decoding, search: SkipSearch, iterations: int,
                deadline: float | None = None, seed: int = 0, progress: Progress = _quiet,
                on_observation: Callable[[SkipSearch], None] | None = None) -> SkipSearch:
    """Draft & Verify's recipe: maximise measured self-speculative speed over skip sets (each measured
    with its own Plan; the engine keeps none)."""
    rng = random.Random(seed + len(search.observations))
    settings = base.replace(method="self", temperature=0.0)
    baseline = measure(engine, prompts, base.replace(method="baseline", temperature=0.0)).rate
    d = 2 * search.layers
    for i in range(iterations):
        if deadline is not None and time.monotonic() > deadline:
            break
        x = propose_skip(search.observations, d, rng)
        plan = Plan(settings, skip=engine.skip_set(decode_skip(x, search.layers)))
        search.observations[x] = measure(engine, prompts, plan).rate / baseline
        best = search.best()
        progress(f"skip set {i + 1}/{iterations}: best {best[1]:.2f}x", i + 1, iterations)
        if on_observation:
            on_observation(search)
    return search


# --- the speculation shape: successive halving over measured candidates --------------------------------

def shape_candidates(methods: list[str], draft2_kinds: list[str], sampling: bool, rng: random.Random,
                     count: int = 18) -> list[dict]:
    """Settings to race: every draft length for speculative, a random sample of trees for staged."""
    out: list[dict] = []
    if "speculative" in methods:
        out += [dict(method="speculative", draft_tokens=k) for k in (1, 2, 3, 4, 5, 6, 8)]
    if "self" in methods:
        out += [dict(method="self", draft_tokens=k, self_threshold=t) for k in (4, 8, 12) for t in (0.5, 0.8)]
    if "staged" in methods:
        # caps for the run-time adaptation (it sizes each step by measured speed), draft2, the sibling rule
        d = Decoding()
        trees = {(d.tree_budget, d.tree_depth, d.tree_branching, d.tree_width,
                  "prompt-lookup" if "prompt-lookup" in draft2_kinds else "none", d.draft2_tokens,
                  d.tree_rule, d.tree_mass)}  # the defaults always race
        while len(trees) < count:
            budget = rng.choice((8, 12, 16, 24, 32))
            depth = rng.choice(tuple(x for x in (3, 4, 6, 8, 10) if x <= budget))
            branching = rng.choice((1, 2, 3, 4) if not sampling else (2, 3, 4, 6))
            width = rng.choice(tuple(w for w in (1, 2, 3, 4, 6) if w <= budget))
            kind = rng.choice(draft2_kinds)
            guesses = rng.choice((2, 4, 6, 8)) if kind != "none" else d.draft2_tokens
            rule = rng.choice(TREE_RULES) if sampling else d.tree_rule
            trees.add((budget, depth, branching, width, kind, guesses, rule, rng.choice((0.8, 0.9, 1.0))))
        for budget, depth, branching, width, kind, guesses, rule, mass in sorted(trees):
            out.append(dict(method="staged", tree_budget=budget, tree_depth=depth, tree_branching=branching,
                            tree_width=width, draft2=kind, draft2_tokens=guesses, tree_rule=rule, tree_mass=mass))
    return out


def successive_halving(evaluate: Callable[[dict, int], float], candidates: list[dict], prompts: int,
                       keep: float = 1 / 3, progress: Progress = _quiet) -> list[tuple[dict, float]]:
    """Race candidates on 1, 2, 4, ... prompts, keeping the fastest third each round (Jamieson & Talwalkar)."""
    alive = [(c, 0.0) for c in candidates]
    budget = 1
    rounds = max(1, math.ceil(math.log(max(len(candidates), 2), 1 / keep)))
    total = sum(min(prompts, 2**r) * max(1, math.ceil(len(candidates) * keep**r)) for r in range(rounds + 1))
    done = 0
    while True:
        scored = []
        for c, _ in alive:
            scored.append((c, evaluate(c, budget)))
            done += budget
            progress(f"shape: {len(alive)} candidates on {budget} prompt{'s' * (budget > 1)}", done, total)
        scored.sort(key=lambda cs: cs[1], reverse=True)
        if len(scored) == 1 or budget >= prompts:
            return scored
        alive = scored[: max(1, math.ceil(len(scored) * keep))]
        budget = min(prompts, budget * 2)


# --- the whole job ------------------------------------------------------------------------------------

STEPS = ("draft2", "heads", "skip", "shape")


@dataclass
class Options:
    steps: tuple[str, ...] = STEPS
    modes: tuple[str, ...] = ("greedy",)
    max_new_tokens: int = 96
    skip_iterations: int = 30
    skip_prompts: int = 3
    deadline: float | None = None  # time.monotonic() after which searches stop and keep their best
    draft2_tokens: int = 200_000
    draft2_temperature: float = 1.5
    draft2_corpus: list | None = None
    seed: int = 0


SAMPLING = dict(temperature=1.0, top_k=50, top_p=1.0)  # the paper's top-k mode


def tune_draft2(engine, profile, key: str, options: Options, progress: Progress = _quiet) -> dict:
    """draft2's trigram: on text sampled from the draft, or on `draft2_corpus`; with no separate draft, on a corpus
    (Python's standard library unless given) into the cache, where `draft2 = "auto"` finds it everywhere."""
    from spec_cli.core.paths import write_whole
    from spec_cli.draft2 import trigrams
    from spec_cli.draft2.fit import fit_from_corpus, fit_from_draft
    from spec_cli.models import tuned

    alone = trigrams.separate_draft(profile) is None
    path = (trigrams.corpus_path(engine.tokenizer) if alone
            else tuned.tuned_dir() / f"{profile.name}-{key}-draft2.npz")
    if options.draft2_corpus or alone:
        model = fit_from_corpus(profile, options.draft2_corpus,
                                lambda n, total: progress("reading the corpus", n, total), engine.tokenizer)
        fitted = int(model.unigram_counts.sum())
        source = {"corpus": [str(p) for p in options.draft2_corpus] if options.draft2_corpus
                  else "Python's standard library"}
    else:
        model, fitted = fit_from_draft(profile, options.draft2_tokens, options.draft2_temperature, options.seed,
                                       str(engine.device), progress=lambda n, total: progress("draft2", n, total))
        source = {"sampled_from": "draft", "temperature": options.draft2_temperature, "seed": options.seed}
    write_whole(path, model.save)  # (whole or not at all: `auto` may read it any time)
    record = {"path": str(path), "tokens": fitted, "complete": fitted >= options.draft2_tokens
              or bool(options.draft2_corpus) or alone, **source}
    tuned.update(profile, key, draft2=record)
    return record


def tune_heads(engine, profile, key: str, options: Options, progress: Progress = _quiet) -> dict:
    """Heads fitted on the oracle's own reads of a corpus (`draft2_corpus`, else Python's standard library), for a
    model alone (`spec_cli.draft2.heads`), into the cache, where staged finds them. Four more pieces, read from
    the files after those (none of their text fitted on), say how often head 1's first guess is the oracle's own
    next token (pieces held out of the same read, right after the text fitted on, said 68% where other files said
    42% and HumanEval's code 38%: the 1.5B coder, session 40). Ctrl-C while reading fits on what was read."""
    from spec_cli.core.paths import write_whole
    from spec_cli.draft2 import heads
    from spec_cli.draft2.fit import corpus_files
    from spec_cli.exec import Runner
    from spec_cli.models import tuned

    runner = Runner(engine.oracle.model, vocab_size=engine.vocab_size, capacity=heads.PIECE)
    if runner.lean is None or not heads.fits(engine.oracle.model):
        raise SpecError("fitted heads need spec's own layer loop and a head it can cut: not this model")
    started = time.perf_counter()
    held = 4 * heads.PIECE
    texts = iter(heads.corpus_texts(corpus_files(options.draft2_corpus)))
    reads = heads.read(runner, texts, engine.tokenizer, heads.TOKENS,
                       lambda n, total: progress("reading the corpus", n, heads.TOKENS + held))
    check = None
    if not reads.interrupted:
        try:  # (the files after those read: their text starts afresh, none of it fitted on)
            check = heads.read(runner, texts, engine.tokenizer, held,
                               lambda n, total: progress("reading the corpus", heads.TOKENS + n, heads.TOKENS + held))
        except ValueError:  # (a corpus too small to hold any out)
            pass
        except KeyboardInterrupt:
            reads.interrupted = True
    saved = heads.fit(reads, engine.oracle.model, progress=lambda n, total: progress("fitting", n, total))
    path = write_whole(heads.path_for(profile.oracle), lambda f: torch.save(saved, f))
    fitted = heads.bound(saved, engine.oracle.model, path)
    agreement = heads.agreement(fitted, check) if check is not None else None
    engine.heads(fitted)  # (the shape step races the defaults with them)
    corpus = [str(p) for p in options.draft2_corpus] if options.draft2_corpus else "Python's standard library"
    record = {"path": str(path), "tokens": saved["tokens"], "words": len(saved["words"]),
              "complete": not reads.interrupted, "agreement": None if agreement is None else round(agreement, 3),
              "seconds": round(time.perf_counter() - started, 1), "corpus": corpus}
    tuned.update(profile, key, heads=record)
    return record


def tune_skip(engine, profile, key: str, prompts: list[list[int]], options: Options,
              progress: Progress = _quiet) -> dict:
    from spec_cli.models import tuned

    layers = num_layers(engine.oracle.model.config)
    previous = (tuned.entry(profile, key).get("self_draft") or {}).get("observations", [])
    search = SkipSearch.from_records(layers, previous)
    base = engine_settings(profile, options).replace(self_adaptive=True)

    def save(s: SkipSearch) -> None:
        best, speedup = s.best()
        tuned.update(profile, key, self_draft={**vars(best), "speedup": round(speedup, 4),
                                               "observations": s.as_records(),
                                               "prompts": len(prompts[: options.skip_prompts])})

    search_skip(engine, prompts[: options.skip_prompts], base, search, options.skip_iterations, options.deadline,
                options.seed, progress, on_observation=save)
    best = search.best()
    return {**vars(best[0]), "speedup": best[1], "measured": len(search.observations)}


def engine_settings(profile, options: Options) -> Decoding:
    return profile.decoding.replace(max_new_tokens=options.max_new_tokens, seed=options.seed)


def tune_shape(engine, profile, key: str, prompts: list[list[int]], mode: str, options: Options,
               progress: Progress = _quiet, skip=None) -> dict:
    """Race the candidate shapes, then the fastest three, the defaults and baseline on every prompt: the
    fastest of these is saved, so what is saved is never slower than baseline there. `skip`: the
    self-draft's skip set (method self races only with one)."""
    from spec_cli.draft2 import trigrams
    from spec_cli.draft2.ngram import PromptLookup
    from spec_cli.engine import load_draft2
    from spec_cli.models import tuned

    sampling = mode != "greedy"
    base = engine.runnable(engine_settings(profile, options).replace(**(SAMPLING if sampling else
                                                                       dict(temperature=0.0))))
    methods = []
    if engine.has_draft:  # (a draft of another vocabulary runs speculative alone: no trees)
        methods += ["speculative"] if engine.translator is not None else ["speculative", "staged"]
    if skip is not None:
        methods.append("self")
    drafters = {"none": None, "prompt-lookup": PromptLookup()}
    fitted = (tuned.entry(profile, key).get("draft2") or {}).get("path")
    if fitted:
        try:
            drafters["ngram"] = load_draft2(fitted, None, engine.vocab_size)
            drafters["prompt-lookup+ngram"] = load_draft2("prompt-lookup+" + fitted, None, engine.vocab_size)
        except Exception:  # noqa: BLE001 - a stale file just leaves n-grams out of the race
            pass
    own = profile.draft2.kind if profile.draft2 else "none"  # what the untuned defaults run with
    rng = random.Random(options.seed)
    candidates = shape_candidates(methods, list(drafters), sampling, rng)
    previous = ((tuned.entry(profile, key).get(tuned.mode_of(base)) or {}).get("settings"))
    if previous and previous not in candidates:
        candidates.append(previous)  # re-running refines: last time's winner races again

    def settings_of(candidate: dict) -> Plan:
        settings = base.replace(**{k: v for k, v in candidate.items() if k != "draft2"})
        drafter = candidate.get("draft2", "none")
        return Plan(settings, drafters.get(drafter), skip, heads=drafter == "profile" and own == "auto")

    def evaluate(candidate: dict, n: int) -> float:
        return measure(engine, prompts[:n], settings_of(candidate)).rate

    raced = successive_halving(evaluate, candidates, len(prompts), progress=progress)
    # the final: the fastest three and the untuned defaults, interleaved prompt by prompt on every prompt
    default = {"method": base.method, "draft2": "profile"}
    drafters["profile"] = load_draft2(None, profile.draft2, engine.vocab_size,
                                      trigrams.ready(profile, engine.tokenizer))
    finalists = [("baseline", {"method": "baseline"}), ("default", default)]
    finalists += [(f"finalist {i + 1}", c) for i, (c, _) in enumerate(raced[:3])]
    totals = {name: Score(0, 0.0, 0) for name, _ in finalists}
    for i, ids in enumerate(prompts):
        for name, candidate in finalists[i % len(finalists):] + finalists[: i % len(finalists)]:
            score = measure(engine, [ids], settings_of(candidate))
            total = totals[name]
            totals[name] = Score(total.tokens + score.tokens, total.seconds + score.seconds,
                                 total.oracle_forwards + score.oracle_forwards)
        progress("final: the fastest three and the defaults on every prompt", i + 1, len(prompts))
    best_name, winner = max(finalists, key=lambda nc: totals[nc[0]].rate)  # baseline races too: never a loser
    if best_name == "default":
        winner = {k: getattr(base, k) for k in tuned.SHAPE_KEYS}
        winner["draft2"] = own
    elif best_name == "baseline":
        winner = {"method": "baseline", "draft2": "none"}
    base_rate = totals["baseline"].rate
    best = totals[best_name]
    result = {
        "settings": winner,
        "defaults_won": best_name == "default",
        "baseline_won": best_name == "baseline",
        "tokens_per_second": round(best.rate, 2),
        "baseline_tokens_per_second": round(base_rate, 2),
        "default_tokens_per_second": round(totals["default"].rate, 2),
        "speedup": round(best.rate / base_rate, 4),
        "default_speedup": round(totals["default"].rate / base_rate, 4),
        "tokens_per_oracle_forward": round(best.tokens / max(1, best.oracle_forwards), 3),
        "prompts": len(prompts), "max_new_tokens": options.max_new_tokens,
        "final": [{**c, "tokens_per_second": round(totals[n].rate, 2)} for n, c in finalists],
        "raced": [{**c, "tokens_per_second": round(r, 2)} for c, r in raced[:10]],
    }
    tuned.update(profile, key, **{tuned.mode_of(base): result})
    return result
