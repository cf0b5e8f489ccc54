"""`spec bench humaneval` on screen and on disk: progress, the summary table, JSONL rows, summary and plot."""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from spec_cli import __version__, bench
from spec_cli.core.errors import SpecError
from spec_cli.core.paths import write_whole
from spec_cli.view import fancy, loading, make_console

BLOCKS = " ▁▂▃▄▅▆▇█"


def _machine() -> dict:
    import torch
    import transformers

    from spec_cli.core.hardware import cpu_name

    info = {"platform": platform.platform(), "cpu": cpu_name(), "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": transformers.__version__, "spec": __version__,
            "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _read_rows(path: Path) -> list[dict]:
    """The rows of a results file; a last line cut short by an interruption is dropped from the file."""
    rows = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise SpecError(f"{path}:{number}: not a JSON row; cannot resume from it") from None
            write_whole(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


DEFAULTS = {"profile": None, "oracle": None, "draft": None, "dataset": None, "limit": None, "tasks": None,
            "methods": ["baseline", "speculative", "staged", "hf_assisted"], "modes": ["greedy", "topk"],
            "max_new_tokens": 128, "repeats": 1, "stop": False, "check": False, "draft2": None, "sampling": None, "device": None,
            "dtype": None, "quantize": None, "max_memory": None}
FLAGS = {"max_new_tokens": "--max-new-tokens", "stop": "--stop/--no-stop", "check": "--check/--no-check"}


def _canonical(options: dict) -> dict:
    """Options as run.json keeps them: lists for lists, absolute paths for paths (a resume may run elsewhere)."""
    from spec_cli.models.profiles import _command_line_model

    out = dict(options)
    for key in ("methods", "modes"):
        if isinstance(out.get(key), str):
            out[key] = [m.strip() for m in out[key].split(",") if m.strip()]
    if out.get("tasks") is not None:
        out["tasks"] = [t.strip() for item in out["tasks"] for t in str(item).split(",") if t.strip()]
    if out.get("dataset") is not None:
        out["dataset"] = str(Path(out["dataset"]).expanduser().resolve())
    profile = out.get("profile")
    if profile is not None and (profile.endswith(".toml") or Path(profile).expanduser().is_file()):
        out["profile"] = str(Path(profile).expanduser().resolve())
    for key in ("oracle", "draft"):
        if out.get(key) is not None:
            out[key] = _command_line_model(out[key])
    draft2 = out.get("draft2")
    if draft2 is not None and draft2 not in ("auto", "none", "prompt-lookup"):
        from spec_cli.engine import LOOKUP_PLUS

        lookup = LOOKUP_PLUS if draft2.startswith(LOOKUP_PLUS) else ""
        file = draft2.removeprefix(lookup)
        out["draft2"] = lookup + str(Path(file).expanduser().resolve())
    return out


def resolve_options(given: dict, out: Path, resume: bool) -> dict:
    """The run's options: those given, else (with --resume) those in out/run.json, else the defaults.
    A resume that gives an option with another value than the run's is refused, naming each one."""
    given = _canonical(given)
    if not resume:
        return {**DEFAULTS, **given}
    run_file = out / "run.json"
    if not run_file.is_file():
        if (out / "results.jsonl").is_file():  # a run from before run.json kept its options
            return {**DEFAULTS, **given}
        raise SpecError(f"nothing to resume in {out}: it has no run.json (start the run without --resume)")
    try:
        before = json.loads(run_file.read_text()).get("options")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise SpecError(f"{run_file}: unreadable ({e}); start a new run with another --out") from None
    before = {**DEFAULTS, **(before or {})}
    differ = [key for key, value in given.items() if before.get(key) != value]
    if differ:
        details = "; ".join(f"{_flag(k)} is {_show(before.get(k))} there, {_show(given[k])} here" for k in differ)
        raise SpecError(f"cannot resume the run in {out}: {details} (leave {'them' if len(differ) > 1 else 'it'} "
                        "out to continue with the run's)")
    return before


def _flag(key: str) -> str:
    return FLAGS.get(key, "--" + key.replace("_", "-"))


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def run_bench(err: Console, profile, options: dict, out: Path, resume: bool) -> None:
    from spec_cli import humaneval
    from spec_cli.core.process import settle
    from spec_cli.engine import Engine
    from spec_cli.humaneval import check as run_check
    from spec_cli.models import tuned
    from spec_cli.models.profiles import profile_args

    methods, modes = list(options["methods"]), list(options["modes"])
    for m in methods:
        if m not in bench.METHODS:
            raise SpecError(f"unknown method '{m}' (choose from {', '.join(bench.METHODS)})")
    for m in modes:
        if m not in bench.MODES:
            raise SpecError(f"unknown mode '{m}' (choose from {', '.join(bench.MODES)})")
    if not modes:
        raise SpecError(f"--modes names no mode (choose from {', '.join(bench.MODES)})")
    if "baseline" not in methods:
        methods.insert(0, "baseline")
    max_new_tokens, repeats, check = options["max_new_tokens"], options["repeats"], options["check"]
    if repeats < 1 or max_new_tokens < 1:
        raise SpecError("--repeats and --max-new-tokens must be at least 1")
    stops = humaneval.CODE_STOPS if options["stop"] else ()
    draft2, device, dtype = options["draft2"], options["device"], options["dtype"]
    problems = humaneval.select(humaneval.load(options["dataset"]), options["tasks"], options["limit"])
    untested = [p["task_id"] for p in problems if "test" not in p or "entry_point" not in p]
    if check and untested:
        raise SpecError(f"--check: {untested[0]} has no tests to run ('test' and 'entry_point'); run without --check")

    results, run_file = out / "results.jsonl", out / "run.json"
    done: dict = {}
    if results.exists() and results.stat().st_size and not resume:
        raise SpecError(f"{results} already has results; pass --resume to continue that run, or choose another --out")
    if resume and results.exists():
        for row in _read_rows(results):
            done[(row["task_id"], row["mode"], row["method"])] = row
    settings_record = {"options": options, "profile": profile.name, "profile_source": profile.source,
                       "profile_args": profile_args(profile, durable=True), "methods": methods,
                       "tasks": [p["task_id"] for p in problems]}
    try:
        out.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(settings_record, indent=2))
    except OSError as e:
        raise SpecError(f"cannot write the run's files in {out}: {e.strerror or e}") from None

    key = tuned.resolve_key(profile, device, dtype)
    record = tuned.entry(profile, key)
    with loading(err, profile.name):
        engine = Engine(tuned.apply(profile, key, record=record), device=device, dtype=dtype,
                        need_draft=any(m.split(":")[0] in ("speculative", "staged", "hf_assisted") for m in methods))
    if engine.translator is not None:  # a draft of another vocabulary: speculative only (translated guesses)
        dropped = [m for m in methods if m.split(":")[0] in ("staged", "hf_assisted")]
        if dropped:
            methods = [m for m in methods if m not in dropped]
            err.print(f"note: the draft speaks another vocabulary than the oracle: {', '.join(dropped)} left out "
                      f"(speculative translates its guesses)", style="yellow")
    plans = {}  # (mode, untuned) -> Plan: tuned per mode unless a method says :untuned
    for mode in modes:
        for untuned in (False, True):
            p = profile if untuned else tuned.apply(profile, key, sampling=mode != "greedy", record=record)
            plans[(mode, untuned)] = engine.plan(p.decoding.replace(max_new_tokens=max_new_tokens,
                                                                  sampling=options.get("sampling")), draft2, profile=p)

    def plan(mode: str, untuned: bool):
        return plans[(mode, untuned)]

    base = plans[(modes[0], False)].settings
    if check:
        err.print("--check: running model-written code in a separate Python process (10 s limit each)",
                  style="yellow")
    total = len(problems) * len(modes) * len(methods)
    rows = list(done.values())
    settle()
    interrupted, unwritten, kept = False, None, len(done)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=False, disable=not fancy(err)) as progress:
        task = progress.add_task("humaneval", total=total, completed=len(done))
        try:
            with results.open("a") as f:
                for row in bench.run(engine, problems, methods, modes, plan, stops, repeats, done,
                                     run_check if check else None):
                    rows.append(row)  # (measured: in the table below whatever becomes of the file)
                    append(f, row)
                    kept += 1
                    progress.update(task, advance=1, description=_running(rows) if fancy(err) else None)
        except KeyboardInterrupt:
            interrupted = True
        except OSError as e:  # (a disk that fills: the rows measured are shown, those written kept for --resume)
            interrupted, unwritten = True, e
    summary = bench.summarize(rows) if rows else {}
    record = {"machine": _machine(), "device": engine.device.type,
              "dtype": str(engine.dtype).removeprefix("torch."), "weights": engine.weights,
              "draft_weights": engine.draft_weights, "profile": {
                  "name": profile.name, "source": profile.source, "oracle": profile.oracle.model,
                  "draft": profile.draft.model if profile.draft else None,
                  "decoding": vars(base), "tuned": {f"{mode}{' untuned' * u}": vars(v.settings)
                                                    for (mode, u), v in plans.items()} if profile.tuned or
                  any(v.settings != plans[(m, True)].settings for (m, u), v in plans.items()) else None},
              "settings": settings_record, "complete": not interrupted,
              "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary}
    try:
        write_whole(out / "summary.json", json.dumps(record, indent=2))
    except OSError as e:
        unwritten = unwritten or e
    console = make_console()
    if not console.is_terminal:
        console.width = 160
    console.print(table(summary, profile.name, record["device"], record["dtype"]))
    for mode, methods_summary in summary.items():
        for method, entry in methods_summary.items():
            for d in entry.get("divergences", []):
                err.print(f"[yellow]{method} differs from baseline on {d['task_id']} ({mode}) at token {d['index']}"
                          f"{_margin(d)}[/yellow]")
    plotted = plot(summary, out) if unwritten is None else None
    if plotted:
        err.print(f"plot: {', '.join(str(p) for p in plotted)}", style="dim")
    else:
        console.print("speed relative to baseline per problem, sorted (each block one problem):")
        console.print(chart(summary))
    if unwritten is not None:
        err.print(f"error: cannot write to {out}: {unwritten.strerror or unwritten}; the table holds all {len(rows)} "
                  f"rows measured, {results.name} the first {kept}: free space, then continue with: spec bench "
                  f"humaneval --resume --out {shlex.quote(str(out))}", style="bold red", markup=False, highlight=False)
        raise SystemExit(1)
    err.print(f"results: {results}  summary: {out / 'summary.json'}", style="dim")
    if interrupted:
        err.print(f"interrupted: {len(rows)} rows kept; continue with: spec bench humaneval --resume --out "
                  f"{shlex.quote(str(out))}", style="yellow")
        raise SystemExit(130)


def append(f, row: dict) -> None:
    """One result row onto the run's results.jsonl, at once (a run stopped later keeps it for --resume)."""
    f.write(json.dumps(row) + "\n")
    f.flush()


def _margin(d: dict) -> str:
    if "top_two_margin" not in d:
        return " (length only)"
    return f" (oracle top-two logit margin {d['top_two_margin']:.4f} there)"


def _running(rows: list[dict]) -> str:
    summary = bench.summarize(rows)
    parts = []
    for mode, methods in summary.items():
        best = max((m for m in methods if m != "baseline" and methods[m]["speedup_geomean"]),
                   key=lambda m: methods[m]["speedup_geomean"], default=None)
        if best:
            parts.append(f"{mode}: {best} x{methods[best]['speedup_geomean']:.2f}")
    return "humaneval " + " · ".join(parts)


def table(summary: dict, name: str, device: str, dtype: str) -> Table:
    t = Table(title=f"spec bench humaneval · {name} · {device} {dtype}", title_justify="left", box=box.SIMPLE_HEAD,
              caption="speedup: mean over problems of tokens/s relative to baseline; traffic: oracle forwards "
                      "per token relative to baseline; tok/fwd: tokens per oracle forward; d/tok: draft "
                      "forwards per token; reads/tok: host reads per token (on a GPU, synchronisations); "
                      "1st tok: median seconds to the first token (the prompt read); "
                      "same: output identical to baseline (greedy, or coupled sampling); vs best: geomean over problems of tokens/s "
                      "relative to the faster of baseline and speculative on that problem (in brackets: problems "
                      "below 0.9 of it)", caption_justify="left")
    for column in ("mode", "method", "tok/s", "speedup", "median", "geomean", "vs best", "traffic", "tok/fwd",
                   "d/tok", "reads/tok", "accept", "1st tok", "same", "pass@1"):
        t.add_column(column, justify="left" if column in ("mode", "method") else "right")
    for mode, methods in summary.items():
        for method, e in methods.items():
            identical = f"{e['identical']}/{e['problems']}" if "identical" in e else "-"
            t.add_row(mode, method, _f(e["tokens_per_second"], 1), _f(e["speedup_mean"], 2, "x"),
                      _f(e["speedup_median"], 2, "x"), _f(e["speedup_geomean"], 2, "x"), _vs_best(e),
                      _f(e["oracle_traffic"], 2), _f(e["tokens_per_oracle_forward"], 2),
                      _f(e.get("draft_forwards_per_token"), 2), _f(e.get("host_reads_per_token"), 2),
                      _f(e["acceptance"], 2), _f(e.get("first_token_median"), 3), identical, _f(e.get("pass@1"), 2))
    return t


def _vs_best(e: dict) -> str:
    if e.get("vs_best_geomean") is None:
        return "-"
    return f"x{e['vs_best_geomean']:.2f} ({e['below_0.9_of_best']})"


def _f(value, digits, prefix="") -> str:
    return "-" if value is None else f"{prefix}{value:.{digits}f}"


def chart(summary: dict) -> Table:
    """Relative speed per problem, sorted (the paper's Figure 2) as block characters, when matplotlib is absent."""
    t = Table(show_header=False, box=None)
    for mode, methods in summary.items():
        top = max((max(e["speedups"]) for e in methods.values() if e["speedups"]), default=1.0)
        for method, e in methods.items():
            if method == "baseline" or not e["speedups"]:
                continue
            blocks = "".join(BLOCKS[min(8, max(1, round(8 * s / top)))] for s in sorted(e["speedups"]))
            t.add_row(mode, method, blocks[:200], f"{min(e['speedups']):.2f}–{max(e['speedups']):.2f}x")
    return t


def plot(summary: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    modes = list(summary)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for method, e in summary[mode].items():
            if e["speedups"]:
                ax.plot(range(len(e["speedups"])), sorted(e["speedups"]), label=method)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_title(f"{mode}: speed relative to baseline")
        ax.set_xlabel("problem (sorted)")
        ax.set_ylabel("relative tokens/s")
        ax.legend()
    fig.tight_layout()
    paths = [out / "relative-speed.png", out / "relative-speed.svg"]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths
