"""The paper's experiment: methods side by side on the same prompts, in one process, interleaved.

No Rich here: `run` yields one row per (problem, mode, method) and `summarize` folds rows into the table.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from spec_cli.completion import complete
from spec_cli.core.events import Stats, Token
from spec_cli.detok import Detokenizer
from spec_cli.engine import Plan
from spec_cli.exec.hostreads import counting
from spec_cli.humaneval import truncate
from spec_cli.models.tuned import SHAPE_KEYS

MODES = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0), "topk": dict(temperature=1.0, top_k=50, top_p=1.0),
         "topp": dict(temperature=0.8, top_k=0, top_p=0.95)}  # (top-p: the usual chat and API setting)
OURS = ("baseline", "speculative", "staged", "self", "auto")  # auto: the method the settings name
PEERS = ("hf_greedy", "hf_assisted")
UNTUNED = ("speculative:untuned", "staged:untuned", "self:untuned", "auto:untuned")  # ignoring `spec tune`
AGAIN = ("baseline:again",)  # the oracle alone timed a second time: how far apart two timings of the same work fall
METHODS = OURS + UNTUNED + AGAIN + PEERS


@dataclass
class Measurement:
    tokens: list[int]
    text: str
    seconds: float
    stats: Stats
    reads: int | None = None  # host reads during the completion (a GPU's synchronisations)
    first: float | None = None  # seconds to the first token (the prompt read), where known


def _ours(engine, ids, plan, stops) -> Measurement:
    detok = Detokenizer(engine.tokenizer, ids)
    text = ""

    def watch(event) -> bool:
        nonlocal text
        if stops and isinstance(event, Token) and event.output:
            text, stopped = truncate(text + detok.add(event.token), stops)
            return stopped
        return False

    with counting() as counts:
        done = complete(engine, ids, plan, watch=watch)
    if done.interrupted:  # a measurement cut short is no measurement
        raise KeyboardInterrupt
    if not stops:
        text = engine.tokenizer.decode(done.tokens, skip_special_tokens=True)
    return Measurement(done.tokens, text, done.seconds, done.stats, counts["reads"], done.first_token_seconds)


class _Counter:
    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


def _hugging_face(engine, ids, settings, stops, assisted: bool) -> Measurement:
    """Hugging Face `generate` on the same oracle, alone or assisted by the same draft (the peer to beat)."""
    oracle = engine.oracle.model
    draft = engine.load_draft().model if assisted else None
    kwargs = dict(max_new_tokens=settings.max_new_tokens, pad_token_id=engine.tokenizer.eos_token_id)
    if assisted:
        kwargs.update(assistant_model=draft)
    if settings.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_k=settings.top_k or None,
                      top_p=settings.top_p)
        torch.manual_seed(settings.seed or 0)
    if stops:
        kwargs.update(stop_strings=list(stops), tokenizer=engine.tokenizer)
    counters = [_Counter(oracle)] + ([_Counter(draft)] if assisted else [])
    try:
        start = time.perf_counter()
        out = oracle.generate(torch.tensor([ids], device=engine.device), **kwargs)
        seconds = time.perf_counter() - start
    finally:
        for c in counters:
            c.handle.remove()
    tokens = out[0, len(ids):].tolist()
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    if stops:
        text, _ = truncate(text, stops)
    stats = Stats(new_tokens=len(tokens), forwards={"oracle": counters[0].calls,
                                                    "draft": counters[1].calls if assisted else 0})
    return Measurement(tokens, text, seconds, stats)


def measure(engine, method: str, ids: list[int], plan: Plan, stops) -> Measurement:
    if method in PEERS:
        return _hugging_face(engine, ids, plan.settings, stops, assisted=method == "hf_assisted")
    name = method.split(":")[0]
    return _ours(engine, ids, plan if name == "auto" else plan.replace(settings=plan.settings.replace(method=name)),
                 stops)


def run(engine, problems, methods, modes, plan, stops=(), repeats=1, done=None,
        check=None) -> Iterator[dict]:
    """Rows of measurements; `done` maps (task_id, mode, method) to rows already measured (for --resume).

    `plan(mode, untuned)` gives the Plan (settings, draft2, skip set) for a mode; a plain Plan or Decoding
    stands for the same everywhere.
    """
    done = done or {}
    if not callable(plan):
        fixed = plan if isinstance(plan, Plan) else Plan(plan)
        plan = lambda mode, untuned: fixed  # noqa: E731
    if problems:
        warm = engine.encode(problems[0]["prompt"])
        for method in methods:
            chosen = plan("greedy" if "greedy" in modes else modes[0], method.endswith(":untuned"))
            measure(engine, method, warm, chosen.replace(settings=chosen.settings.replace(
                max_new_tokens=16, **MODES["greedy"])), stops)
    for i, problem in enumerate(problems):
        ids = engine.encode(problem["prompt"])
        for mode in modes:
            order = list(methods[i % len(methods):] + methods[: i % len(methods)])
            if "baseline" in order:  # greedy identity is judged against baseline: run it first
                order.remove("baseline")
                order.insert(0, "baseline")
            reference = done.get((problem["task_id"], mode, "baseline"), {}).get("tokens")
            order = [m for m in order if (problem["task_id"], mode, m) not in done]
            runs: dict[str, list[Measurement]] = {m: [] for m in order}
            for r in range(repeats):  # repeats interleaved, every other round in reverse: a slow spell of a
                for method in order if r % 2 == 0 else order[::-1]:  # busy machine falls on every method alike
                    chosen = plan(mode, method.endswith(":untuned"))
                    settings = chosen.settings.replace(**MODES[mode], seed=i)
                    runs[method].append(measure(engine, method, ids, chosen.replace(settings=settings), stops))
                    if method == "baseline" and reference is None:
                        reference = runs[method][0].tokens
                    if r == repeats - 1:  # a method's last timing: its row now (a Ctrl-C loses no finished row)
                        yield _row(engine, problem, ids, mode, method, settings, runs[method], reference, check)


def _row(engine, problem, ids, mode, method, settings, runs, reference, check) -> dict:
    m = runs[0]
    seconds = statistics.median(r.seconds for r in runs)
    row = {
        "task_id": problem["task_id"], "mode": mode, "method": method,
        "new_tokens": len(m.tokens), "seconds": round(seconds, 6),
        "tokens_per_second": round(len(m.tokens) / seconds, 3) if seconds else None,
        "oracle_forwards": m.stats.oracle_forwards, "draft_forwards": m.stats.draft_forwards,
        "proposed": dict(m.stats.proposed), "accepted": dict(m.stats.accepted),
        "tokens_per_oracle_forward": round(m.stats.tokens_per_oracle_forward, 4),
        "repeats": len(runs), "tokens": m.tokens, "completion": m.text,
    }
    firsts = [r.first for r in runs if r.first is not None]
    if firsts:
        row["first_token_seconds"] = round(statistics.median(firsts), 6)
    if m.reads is not None:
        row["host_reads"] = m.reads
    if method not in PEERS:
        name = method.split(":")[0]
        row["settings"] = {**{k: getattr(settings, k) for k in SHAPE_KEYS},
                           "method": settings.method if name == "auto" else name}
    if reference is not None and (mode == "greedy" or (settings.coupled and method not in PEERS)):
        row["identical"] = m.tokens == reference
        if not row["identical"]:
            row["divergence"] = _divergence(engine, ids, reference, m.tokens)
    if check is not None:
        row["passed"] = check(problem, m.text)
    return row


def _divergence(engine, ids, reference, tokens) -> dict:
    """Where greedy output left baseline's, and how close the oracle's choice was to a tie there."""
    j = next((k for k in range(min(len(reference), len(tokens))) if reference[k] != tokens[k]), None)
    if j is None:
        return {"index": min(len(reference), len(tokens)), "reason": "length"}
    with torch.no_grad():
        logits = engine.oracle.model(torch.tensor([ids + reference[:j]], device=engine.device)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return {"index": j, "baseline_token": reference[j], "token": tokens[j],
            "top_two_margin": round(float(top[0] - top[1]), 6),
            "gap": round(float(logits[reference[j]] - logits[tokens[j]]), 6)}


def summarize(rows: list[dict]) -> dict:
    """Per mode and method: throughput, speedups over baseline (per problem), oracle traffic, acceptance."""
    out: dict = {}
    by_key = {(r["task_id"], r["mode"], r["method"]): r for r in rows}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        out[mode] = {}
        base_rows = [r for r in rows if r["mode"] == mode and r["method"] == "baseline"]
        base_fpt = _ratio(sum(r["oracle_forwards"] for r in base_rows), sum(r["new_tokens"] for r in base_rows))
        for method in dict.fromkeys(r["method"] for r in rows if r["mode"] == mode):
            mine = [r for r in rows if r["mode"] == mode and r["method"] == method]
            tokens = sum(r["new_tokens"] for r in mine)
            seconds = sum(r["seconds"] for r in mine)
            speedups = []
            for r in mine:
                b = by_key.get((r["task_id"], mode, "baseline"))
                if b and b["tokens_per_second"] and r["tokens_per_second"]:
                    speedups.append(r["tokens_per_second"] / b["tokens_per_second"])
            against_best = []  # against the better of the oracle alone and plain speculation, on the same problem
            if method not in ("baseline", "speculative"):
                for r in mine:
                    rivals = [by_key.get((r["task_id"], mode, m)) for m in ("baseline", "speculative")]
                    best = max((x["tokens_per_second"] or 0.0 for x in rivals if x), default=0.0)
                    if best and r["tokens_per_second"] and all(rivals):
                        against_best.append(r["tokens_per_second"] / best)
            proposed = sum(r["proposed"].get("oracle", 0) for r in mine)
            accepted = sum(r["accepted"].get("oracle", 0) for r in mine)
            fpt = _ratio(sum(r["oracle_forwards"] for r in mine), tokens)
            entry = {
                "problems": len(mine), "tokens": tokens, "seconds": round(seconds, 4),
                "tokens_per_second": round(tokens / seconds, 3) if seconds else None,
                "speedup_mean": _round(statistics.fmean(speedups)) if speedups else None,
                "speedup_median": _round(statistics.median(speedups)) if speedups else None,
                "speedup_geomean": _round(math.exp(statistics.fmean(math.log(s) for s in speedups)))
                if speedups else None,
                "speedups": [_round(s) for s in speedups],
                "vs_best_geomean": _round(math.exp(statistics.fmean(math.log(s) for s in against_best)))
                if against_best else None,
                "vs_best": [_round(s) for s in against_best],
                "below_0.9_of_best": sum(s < 0.9 for s in against_best) if against_best else None,
                "oracle_traffic": _round(fpt / base_fpt) if fpt and base_fpt else None,
                "tokens_per_oracle_forward": _round(tokens / sum(r["oracle_forwards"] for r in mine))
                if any(r["oracle_forwards"] for r in mine) else None,
                "acceptance": _round(accepted / proposed) if proposed else None,
                "draft_forwards_per_token": _round(_ratio(sum(r.get("draft_forwards", 0) for r in mine), tokens))
                if any(r.get("draft_forwards") for r in mine) else None,
                "host_reads_per_token": _round(_ratio(sum(r["host_reads"] for r in mine), tokens))
                if all("host_reads" in r for r in mine) else None,
                "first_token_median": _round(statistics.median(r["first_token_seconds"] for r in mine))
                if all("first_token_seconds" in r for r in mine) else None,
            }
            identical = [r["identical"] for r in mine if "identical" in r]
            if identical:
                entry["identical"] = sum(identical)
                entry["divergences"] = [{"task_id": r["task_id"], **r["divergence"]} for r in mine
                                        if r.get("identical") is False]
            passed = [r["passed"] for r in mine if "passed" in r]
            if passed:
                entry["pass@1"] = _round(sum(passed) / len(passed))
            out[mode][method] = entry
    return out


def _ratio(a, b):
    return a / b if b else None


def _round(x):
    return None if x is None else round(x, 4)
