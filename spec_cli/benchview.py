"""`spec bench humaneval` on screen and on disk: progress, the summary table, JSONL rows, summary and plot."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from spec_cli import __version__, bench
from spec_cli.errors import SpecError
from spec_cli.view import loading

BLOCKS = " ▁▂▃▄▅▆▇█"


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "python": sys.version.split()[0],
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
            partial = path.with_suffix(".tmp")
            partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
            partial.replace(path)
    return rows


def run_bench(err: Console, profile, problems, methods, modes, max_new_tokens, repeats, stops, out: Path,
              resume: bool, check: bool, draft2, device, dtype) -> None:
    from spec_cli.engine import Engine
    from spec_cli.humaneval import check as run_check

    out.mkdir(parents=True, exist_ok=True)
    results, run_file = out / "results.jsonl", out / "run.json"
    settings_record = {"profile": profile.name, "profile_source": profile.source, "methods": methods,
                       "modes": modes, "max_new_tokens": max_new_tokens, "repeats": repeats,
                       "stops": list(stops), "draft2": draft2, "dtype": dtype, "device": device,
                       "tasks": [p["task_id"] for p in problems]}
    done: dict = {}
    if results.exists() and results.stat().st_size and not resume:
        raise SpecError(f"{results} already has results; pass --resume to continue that run, or choose another --out")
    if resume and results.exists():
        if run_file.exists():
            before = json.loads(run_file.read_text())
            changed = [k for k in ("profile", "max_new_tokens", "stops", "dtype", "draft2") if before.get(k) != settings_record[k]]
            if changed:
                raise SpecError(f"cannot resume: {', '.join(changed)} differ from the run in {out}")
        for row in _read_rows(results):
            done[(row["task_id"], row["mode"], row["method"])] = row
    run_file.write_text(json.dumps(settings_record, indent=2))

    from spec_cli import tuned
    from spec_cli.engine import load_draft2
    from spec_cli.runner import Skip

    key = tuned.resolve_key(profile, device, dtype)
    record = tuned.entry(profile, key)
    plans = {}  # (mode, untuned) -> (settings, draft2 reference): tuned per mode unless a method says :untuned
    for mode in modes:
        for untuned in (False, True):
            p = profile if untuned else tuned.apply(profile, key, sampling=mode != "greedy", record=record)
            skip = Skip.of(p.self_draft.skip_attention, p.self_draft.skip_mlp) if p.self_draft else None
            plans[(mode, untuned)] = (p.decoding.replace(max_new_tokens=max_new_tokens), p.draft2, skip)
    with loading(err, profile.name):
        engine = Engine(tuned.apply(profile, key, record=record), device=device, dtype=dtype, draft2=draft2,
                        need_draft=any(m.split(":")[0] in ("speculative", "staged", "hf_assisted") for m in methods))
    drafters = {}

    def plan(mode: str, untuned: bool):
        settings, ref, skip = plans[(mode, untuned)]
        engine.self_skip = skip
        if (mode, untuned) not in drafters:
            drafters[(mode, untuned)] = load_draft2(draft2, ref, engine.vocab_size)
        engine.draft2 = drafters[(mode, untuned)]
        return settings

    base = plans[(modes[0], False)][0]
    if check:
        err.print("--check: running model-written code in a separate Python process (10 s limit each)",
                  style="yellow")
    total = len(problems) * len(modes) * len(methods)
    rows = list(done.values())
    interrupted = False
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=False, disable=not err.is_terminal) as progress:
        task = progress.add_task("humaneval", total=total, completed=len(done))
        try:
            with results.open("a") as f:
                for row in bench.run(engine, problems, methods, modes, plan, stops, repeats, done,
                                     run_check if check else None):
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    rows.append(row)
                    progress.update(task, advance=1, description=_running(rows) if err.is_terminal else None)
        except KeyboardInterrupt:
            interrupted = True
    summary = bench.summarize(rows) if rows else {}
    record = {"machine": _machine(), "device": engine.device.type,
              "dtype": str(engine.dtype).removeprefix("torch."), "profile": {
                  "name": profile.name, "source": profile.source, "oracle": profile.oracle.model,
                  "draft": profile.draft.model if profile.draft else None,
                  "decoding": vars(base), "tuned": {f"{mode}{' untuned' * u}": vars(v[0])
                                                    for (mode, u), v in plans.items()} if profile.tuned or
                  any(v[0] != plans[(m, True)][0] for (m, u), v in plans.items()) else None},
              "settings": settings_record, "complete": not interrupted,
              "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary}
    (out / "summary.json").write_text(json.dumps(record, indent=2))
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)
    console.print(table(summary, profile.name, record["device"], record["dtype"]))
    for mode, methods_summary in summary.items():
        for method, entry in methods_summary.items():
            for d in entry.get("divergences", []):
                err.print(f"[yellow]{method} differs from baseline on {d['task_id']} ({mode}) at token {d['index']}"
                          f"{_margin(d)}[/yellow]")
    plotted = plot(summary, out)
    if plotted:
        err.print(f"plot: {', '.join(str(p) for p in plotted)}", style="dim")
    else:
        console.print("speed relative to baseline per problem, sorted (each block one problem):")
        console.print(chart(summary))
    err.print(f"results: {results}  summary: {out / 'summary.json'}", style="dim")
    if interrupted:
        err.print(f"interrupted: {len(rows)} rows kept; continue with --resume --out {out}", style="yellow")
        raise SystemExit(130)


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
                      "forwards per token; same: greedy output identical to baseline", caption_justify="left")
    for column in ("mode", "method", "tok/s", "speedup", "median", "geomean", "traffic", "tok/fwd", "d/tok",
                   "accept", "same", "pass@1"):
        t.add_column(column, justify="left" if column in ("mode", "method") else "right")
    for mode, methods in summary.items():
        for method, e in methods.items():
            identical = f"{e['identical']}/{e['problems']}" if "identical" in e else "-"
            t.add_row(mode, method, _f(e["tokens_per_second"], 1), _f(e["speedup_mean"], 2, "x"),
                      _f(e["speedup_median"], 2, "x"), _f(e["speedup_geomean"], 2, "x"),
                      _f(e["oracle_traffic"], 2), _f(e["tokens_per_oracle_forward"], 2),
                      _f(e.get("draft_forwards_per_token"), 2),
                      _f(e["acceptance"], 2), identical, _f(e.get("pass@1"), 2))
    return t


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
