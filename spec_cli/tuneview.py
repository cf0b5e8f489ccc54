"""`spec tune` on screen: progress bars per step, the findings, and `--show`."""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from spec_cli import tune
from spec_cli.core.errors import SpecError
from spec_cli.core.settings import SelfDraft
from spec_cli.models import tuned
from spec_cli.models.profiles import profile_args
from spec_cli.view import fancy, loading, make_console


def read_prompts(dataset: Path | None, files: list[Path] | None, count: int) -> list[str]:
    """Prompts to tune on: the user's files, or the first `count` HumanEval problems."""
    from spec_cli import humaneval

    if files:
        prompts = []
        for path in files:
            if not path.is_file():
                raise SpecError(f"prompt file not found: {path}")
            if path.name.endswith((".jsonl", ".jsonl.gz")):
                opener = gzip.open if path.suffix == ".gz" else open
                with opener(path, "rt", encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                prompts.append(json.loads(line)["prompt"])
                            except (json.JSONDecodeError, KeyError, TypeError):
                                raise SpecError(f"{path}:{number}: expected a JSON object with a \"prompt\"") from None
            else:
                prompts.append(path.read_text(errors="replace"))
        prompts = [p for p in prompts if p.strip()][:count]
        if not prompts:
            raise SpecError("no prompts in the given files")
        return prompts
    return [p["prompt"] for p in humaneval.load(dataset)[:count]]


@dataclass(frozen=True)
class TuneCommand:
    """What `spec tune` was given (its options, as `spec tune --help` describes them)."""

    only: str | None
    reset: bool
    dataset: str | None
    prompt_files: list[str] | None
    count: int
    modes: str
    max_new_tokens: int
    iterations: int
    minutes: float | None
    draft2_tokens: int
    draft2_temperature: float
    corpus: str | None
    seed: int
    device: str | None
    dtype: str | None
    as_json: bool


def run_tune(err: Console, profile, asked: TuneCommand) -> None:
    from spec_cli.core.process import settle
    from spec_cli.engine import Engine

    steps = tuple(s.strip() for s in asked.only.split(",") if s.strip()) if asked.only else tune.STEPS
    for step in steps:
        if step not in tune.STEPS:
            raise SpecError(f"unknown step '{step}' (choose from {', '.join(tune.STEPS)})")
    mode_list = tuple(m.strip() for m in asked.modes.split(",") if m.strip())
    for mode in mode_list:
        if mode not in ("greedy", "topk"):
            raise SpecError(f"unknown mode '{mode}' (choose from greedy, topk)")
    if asked.count < 1 or asked.max_new_tokens < 1 or asked.iterations < 0:
        raise SpecError("--count and --max-new-tokens must be at least 1, --iterations at least 0")
    texts = read_prompts(asked.dataset, asked.prompt_files, asked.count) if {"skip", "shape"} & set(steps) else []
    key = tuned.resolve_key(profile, asked.device, asked.dtype)
    if asked.reset:
        try:
            data = tuned.read(profile)
        except SpecError:  # unreadable: --reset is the way out, so start afresh
            data = {"profile": profile.name, "machines": {}}
        data["machines"].pop(key, None)
        tuned.write(profile, data)
    options = tune.Options(steps=steps, modes=mode_list, max_new_tokens=asked.max_new_tokens,
                           skip_iterations=asked.iterations,
                           deadline=time.monotonic() + 60 * asked.minutes if asked.minutes else None,
                           draft2_tokens=asked.draft2_tokens, draft2_temperature=asked.draft2_temperature,
                           draft2_corpus=asked.corpus, seed=asked.seed)
    for pinned in sorted(profile.explicit & set(tuned.SHAPE_KEYS)):
        err.print(f"note: {profile.source} sets {pinned}; it wins over the tuned value (remove it to use tuning)",
                  style="yellow")

    with loading(err, profile.name):
        engine = Engine(profile, device=asked.device, dtype=asked.dtype,
                        need_draft=profile.draft is not None and profile.draft.model != "self")
    prompts = [engine.encode(t) for t in texts]
    settle()
    if engine.translator is not None and "draft2" in steps:  # (draft2 speculates for a draft in the oracle's words)
        steps = tuple(step for step in steps if step != "draft2")
        err.print("note: the draft speaks another vocabulary than the oracle: no draft2 to fit (staged needs one "
                  "vocabulary)", style="yellow")
    if engine.has_draft and "heads" in steps:  # (fitted heads guess for a model alone)
        steps = tuple(step for step in steps if step != "heads")
        if asked.only:
            err.print("note: fitted heads are for a model alone (no draft): nothing to fit for this profile",
                      style="yellow")
    previous_skip = tuned.entry(profile, key).get("self_draft")
    skip = engine.skip_set(profile.self_draft)
    if skip is None and previous_skip:
        skip = engine.skip_set(SelfDraft(tuple(previous_skip["skip_attention"]), tuple(previous_skip["skip_mlp"])))
    err.print(f"tuning {profile.name} on {key}: {len(prompts)} prompts × {asked.max_new_tokens} tokens; "
              f"steps {', '.join(steps)}", style="dim")

    found: dict = {}
    interrupted = False
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, disable=not fancy(err)) as progress:
        def reporter(name):
            task = progress.add_task(name, total=None, rate="")
            started = time.monotonic()

            def report(what, done, total):
                rate = ""
                if done and (what == name == "draft2" or what == "reading the corpus" and name == "heads"):
                    rate = f"{done / max(time.monotonic() - started, 1e-9):,.0f} tok/s"  # (sampled or read tokens)
                progress.update(task, description=f"{name}: {what}" if what != name else name, completed=done,
                                total=total, rate=rate)
            return report

        try:
            if "draft2" in steps:
                found["draft2"] = tune.tune_draft2(engine, profile, key, options, reporter("draft2"))
                if not found["draft2"]["complete"]:
                    raise KeyboardInterrupt
            if "heads" in steps:
                try:
                    found["heads"] = tune.tune_heads(engine, profile, key, options, reporter("heads"))
                except SpecError as e:
                    if asked.only:  # (asked for: the error; among all the steps: a note, and the rest go on)
                        raise
                    err.print(f"note: no heads fitted: {e}", style="yellow")
                else:
                    if not found["heads"]["complete"]:
                        raise KeyboardInterrupt
            if "skip" in steps:
                found["self_draft"] = tune.tune_skip(engine, profile, key, prompts, options, reporter("skip set"))
                skip = engine.skip_set(SelfDraft(tuple(found["self_draft"]["skip_attention"]),
                                                 tuple(found["self_draft"]["skip_mlp"])))
            if "shape" in steps:
                for mode in mode_list:
                    found[mode] = tune.tune_shape(engine, profile, key, prompts, mode, options,
                                                  reporter(f"shape ({mode})"), skip=skip)
        except KeyboardInterrupt:
            interrupted = True
    record = tuned.entry(profile, key)
    if asked.as_json:
        print(json.dumps({"profile": profile.name, "machine": key, "record": record, "interrupted": interrupted},
                         indent=2))
    else:
        show_record(profile, key, False, console=err)
    where = tuned.record_path(profile)
    if interrupted:
        err.print(f"interrupted: what was measured so far is saved in {where}; refine it with: "
                  f"spec tune {profile_args(profile)}", style="yellow")
        raise SystemExit(130)
    err.print(f"saved to {where}; generate, chat and bench use it on this machine (--untuned to ignore it)",
              style="dim")


def show_record(profile, key: str, as_json: bool, console: Console | None = None) -> None:
    data = tuned.read(profile)
    if as_json:
        print(json.dumps({"profile": profile.name, "this_machine": key, "path": str(tuned.record_path(profile)),
                          **data}, indent=2))
        return
    out = console or make_console()
    machine = data["machines"].get(key)
    others = [k for k in data["machines"] if k != key]
    if not machine:
        out.print(f"nothing tuned for {profile.name} on {key} yet: run `spec tune {profile_args(profile)}`",
                  markup=False)
        if others:
            out.print(f"(tuned on other machines: {', '.join(others)})", style="dim")
        return
    out.print(f"[bold]{profile.name}[/bold] on {key} (tuned {machine.get('updated', '?')})")
    table = Table(box=None, pad_edge=False)
    for column in ("what", "found", "measured"):
        table.add_column(column)
    if machine.get("draft2"):
        d = machine["draft2"]
        source = (d["corpus"] if isinstance(d.get("corpus"), str) else "your corpus" if d.get("corpus")
                  else f"draft samples at T={d.get('temperature')}")
        table.add_row("draft2", f"Katz trigram, {d['tokens']:,} tokens of {source}"
                      + ("" if d.get("complete") else " (interrupted: partial)"), d["path"])
    if machine.get("heads"):
        h = machine["heads"]
        corpus = h["corpus"] if isinstance(h.get("corpus"), str) else "your corpus"
        agreement = f"; head 1 guessed the oracle's next token {h['agreement']:.0%} of the time on held-out text" \
            if h.get("agreement") is not None else ""
        partial = "" if h.get("complete", True) else " (interrupted: partial)"
        table.add_row("heads", f"fitted on {h['tokens']:,} tokens of {corpus} ({h['words']:,} words){agreement}"
                      f"{partial}",
                      h["path"])
    if machine.get("self_draft"):
        s = machine["self_draft"]
        table.add_row("self-draft skips", f"attention {list(s['skip_attention'])}, MLP {list(s['skip_mlp'])}",
                      f"{s['speedup']:.2f}x baseline (best of {len(s.get('observations', []))} skip sets)")
    for mode in ("greedy", "sampling"):
        m = machine.get(mode)
        if not m:
            continue
        settings = ", ".join(f"{k}={v}" for k, v in m["settings"].items())
        verdict = ": the defaults were fastest" if m.get("defaults_won") else \
            ": nothing beat the oracle alone" if m.get("baseline_won") else ""
        table.add_row(f"shape ({mode})", settings,
                      f"{m['tokens_per_second']:.1f} tok/s = {m['speedup']:.2f}x baseline "
                      f"({m['baseline_tokens_per_second']:.1f} tok/s; defaults {m['default_speedup']:.2f}x) "
                      f"on {m['prompts']} prompts{verdict}")
    out.print(table)
    if others:
        out.print(f"(also tuned on: {', '.join(others)})", style="dim")
