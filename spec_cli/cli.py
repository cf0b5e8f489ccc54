"""The `spec` command line: a thin layer over the engine's events."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from rich.table import Table

from spec_cli import __version__, profiles as profile_store, tuned as tuned_store
from spec_cli.errors import SpecError

app = typer.Typer(
    help="Fast, exact local text generation with staged speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        print(f"spec {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Fast, exact local text generation with staged speculative decoding.

    The output is always exactly what the oracle model alone would produce; a small draft model only
    makes it faster.
    """


DEFAULT_PROFILE = "gpt2l"


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt; - reads it from standard input."),
    profile: str = typer.Option(DEFAULT_PROFILE, "--profile", "-p", help="Profile name or path to a .toml file."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="baseline, speculative, staged or self (the oracle drafts for itself by skipping layers)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Stop after this many tokens."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="0 is greedy."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0: off)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass (1: off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling."),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens", "-k", help="Draft tokens per oracle forward (speculative)."),
    tree_budget: Optional[int] = typer.Option(None, "--tree-budget", help="Tree nodes the oracle scores per forward (staged)."),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", help="Deepest level of the tree (staged)."),
    tree_branching: Optional[int] = typer.Option(None, "--tree-branching", help="Children offered per tree node (staged)."),
    tree_width: Optional[int] = typer.Option(None, "--tree-width", help="Nodes the draft expands per forward (staged)."),
    draft2: Optional[str] = typer.Option(None, "--draft2", help="Second stage: none, prompt-lookup, an n-gram .npz file, or prompt-lookup+FILE.npz."),
    draft2_tokens: Optional[int] = typer.Option(None, "--draft2-tokens", help="Most tokens draft2 guesses below a node (staged)."),
    tree_rule: Optional[str] = typer.Option(None, "--tree-rule", help="Sampling: sequoia, specinfer or one-hot siblings (staged)."),
    tree_mass: Optional[float] = typer.Option(None, "--tree-mass", help="Siblings cover this much of the draft's probability (staged)."),
    tree_adaptive: Optional[bool] = typer.Option(None, "--tree-adaptive/--fixed-tree", help="Size the speculation by measured speed (staged; default) or use the tree settings as they are."),
    skip_attention: Optional[str] = typer.Option(None, "--skip-attention", help="Self-draft: attention sublayers to skip, e.g. 3,5,7."),
    skip_mlp: Optional[str] = typer.Option(None, "--skip-mlp", help="Self-draft: MLP sublayers to skip, e.g. 4,6."),
    self_threshold: Optional[float] = typer.Option(None, "--self-threshold", help="Self-draft: stop drafting under this confidence (adapts as it runs)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32, bfloat16 or float16."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the live view."),
    untuned: bool = typer.Option(False, "--untuned", help="Ignore what `spec tune` saved for this machine."),
) -> None:
    """Complete a prompt, streaming the tokens as the oracle decides them.

    Colours: [green]accepted draft tokens[/green] ([bold green]bold[/bold green] when draft2 guessed them),
    [red strike]rejected draft tokens[/red strike], [blue]the oracle's own tokens[/blue] (corrections and
    bonus tokens).
    """
    from spec_cli.engine import Engine
    from spec_cli.events import Stats
    from spec_cli.view import TokenView, loading, summary

    if prompt == "-":
        prompt = sys.stdin.read()
    if dtype is not None and dtype not in profile_store.DTYPES:
        raise SpecError(f"--dtype must be one of {', '.join(profile_store.DTYPES)}, not '{dtype}'")
    chosen = tuned_store.load_profile(profile, device, dtype, temperature, use_tuned=not untuned)
    settings = chosen.decoding.replace(
        method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, draft_tokens=draft_tokens, tree_budget=tree_budget, tree_depth=tree_depth,
        tree_branching=tree_branching, tree_width=tree_width, draft2_tokens=draft2_tokens, tree_rule=tree_rule,
        tree_mass=tree_mass, tree_adaptive=tree_adaptive, self_threshold=self_threshold,
    )
    with loading(err, chosen.name):
        engine = Engine(chosen, device=device, dtype=dtype, need_draft=settings.method in ("speculative", "staged"),
                        draft2=draft2, self_draft=skip_flags(skip_attention, skip_mlp, chosen))
    ids = engine.encode(prompt)
    view = TokenView(engine.tokenizer, ids, color=False if as_json else None)
    stats = Stats()
    events = []
    if not as_json:
        staged_with_draft2 = settings.method == "staged" and engine.draft2 is not None
        view.start(f"{chosen.name} · {settings.method} · {engine.device.type} "
                   f"{str(engine.dtype).removeprefix('torch.')}", draft2=staged_with_draft2)
        if view.color:
            view.console.print(prompt, style="dim", end="")
    start = time.perf_counter()
    interrupted = False
    try:
        for event in engine.events(ids, settings):
            stats.add(event)
            if as_json:
                events.append(event)
            else:
                view.add(event)
    except KeyboardInterrupt:
        interrupted = True
    seconds = time.perf_counter() - start
    if as_json:
        tokens = [e.token for e in events if getattr(e, "output", False)]
        record = {
            "profile": chosen.name,
            "method": settings.method,
            "settings": {k: v for k, v in vars(settings).items()},
            "tuned": chosen.tuned,
            "device": engine.device.type,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "prompt": prompt,
            "completion": engine.tokenizer.decode(tokens, skip_special_tokens=True),
            "tokens": tokens,
            "events": [{"token": e.token, "kind": e.kind, "stage": e.stage} for e in events if hasattr(e, "kind")],
            "seconds": round(seconds, 4),
            "tokens_per_second": round(stats.new_tokens / seconds, 2) if seconds else None,
            "stats": stats.as_dict(),
            "interrupted": interrupted,
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        view.finish()
        line = summary(stats, seconds) + (" · interrupted" if interrupted else "")
        err.print(line, style="dim")
    if interrupted:
        raise typer.Exit(130)


@app.command()
def chat(
    profile: str = typer.Option(DEFAULT_PROFILE, "--profile", "-p", help="Profile name or path to a .toml file."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (also /system in the chat)."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="baseline, speculative, staged or self (the oracle drafts for itself by skipping layers)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Longest reply, in tokens."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="0 is greedy."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0: off)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass (1: off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (reply i uses seed + i)."),
    draft2: Optional[str] = typer.Option(None, "--draft2", help="Second stage: none, prompt-lookup, an n-gram .npz file, or prompt-lookup+FILE.npz."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32, bfloat16 or float16."),
    template: Optional[str] = typer.Option(None, "--template", help="plain, or a Jinja chat template file (overrides the profile's)."),
    load: Optional[Path] = typer.Option(None, "--load", help="Continue a conversation saved with /save."),
) -> None:
    """Chat with the oracle: replies stream in the colours of generate; /help lists the commands.

    Each turn only runs the new tokens: the conversation's KV cache is kept between turns.
    """
    from spec_cli import chat as chat_session

    if dtype is not None and dtype not in profile_store.DTYPES:
        raise SpecError(f"--dtype must be one of {', '.join(profile_store.DTYPES)}, not '{dtype}'")
    chosen = tuned_store.load_profile(profile, device, dtype, temperature)
    overrides = dict(method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     top_p=top_p, seed=seed)
    settings = chosen.decoding.replace(**overrides)
    raise typer.Exit(chat_session.start(chosen, settings, overrides, system=system, template=template, load=load,
                                        draft2=draft2, device=device, dtype=dtype))


@app.command("fit-draft2")
def fit_draft2(
    out: Path = typer.Argument(..., help="Where to write the n-gram model (.npz)."),
    profile: str = typer.Option(DEFAULT_PROFILE, "--profile", "-p", help="Profile whose draft and tokenizer to use."),
    corpus: Optional[list[Path]] = typer.Option(None, "--corpus", help="Text files or folders to fit on instead of sampling."),
    tokens: int = typer.Option(1_000_000, "--tokens", help="Tokens to sample from the draft."),
    temperature: float = typer.Option(1.5, "--temperature", help="Sampling temperature (the paper: 1.5)."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = typer.Option(None, "--device"),
) -> None:
    """Fit the paper's draft2: a Katz back-off trigram, on text sampled from the draft or on your files."""
    from spec_cli.fit import fit_from_corpus, fit_from_draft

    chosen = profile_store.load(profile)
    if corpus:
        model = fit_from_corpus(chosen, corpus)
    else:
        model, _ = fit_from_draft(chosen, tokens, temperature, seed, device, err)
    model.save(out)
    err.print(f"wrote {out}: {int(model.unigram_counts.sum())} tokens, {len(model.tri_keys)} distinct trigrams",
              style="dim")


bench_app = typer.Typer(help="Benchmarks: the paper's experiment on your machine.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("humaneval")
def bench_humaneval(
    profile: str = typer.Option(DEFAULT_PROFILE, "--profile", "-p", help="Profile name or .toml path."),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="A local HumanEval .jsonl or .jsonl.gz (default: downloaded once into the cache)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N problems."),
    tasks: Optional[list[str]] = typer.Option(None, "--tasks", help="Problems to run, e.g. 0,5,HumanEval/7."),
    methods: str = typer.Option("baseline,speculative,staged,hf_assisted", "--methods", help="Comma-separated: baseline, speculative, staged, self, auto (the profile's or tuned method), hf_greedy, hf_assisted; add :untuned (e.g. auto:untuned) to ignore `spec tune`'s results."),
    modes: str = typer.Option("greedy,topk", "--modes", help="greedy and/or topk (k=50, T=1)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    repeats: int = typer.Option(1, "--repeats", help="Time each run this many times (median)."),
    stop: bool = typer.Option(False, "--stop/--no-stop", help="Stop at a new top-level def/class/print/if __name__."),
    out: Path = typer.Option(Path("spec-bench"), "--out", help="Folder for results.jsonl, summary.json and the plot."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run in --out."),
    check: bool = typer.Option(False, "--check", help="Run each completion against the problem's tests (pass@1). EXECUTES MODEL-WRITTEN CODE."),
    draft2: Optional[str] = typer.Option(None, "--draft2", help="none, prompt-lookup, an n-gram .npz file, or prompt-lookup+FILE.npz."),
    device: Optional[str] = typer.Option(None, "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype"),
) -> None:
    """Speed across HumanEval: baseline vs speculative vs staged vs Hugging Face assisted generation."""
    from spec_cli import bench, humaneval
    from spec_cli.benchview import run_bench

    chosen = profile_store.load(profile)
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in method_list:
        if m not in bench.METHODS:
            raise SpecError(f"unknown method '{m}' (choose from {', '.join(bench.METHODS)})")
    for m in mode_list:
        if m not in bench.MODES:
            raise SpecError(f"unknown mode '{m}' (choose from {', '.join(bench.MODES)})")
    if "baseline" not in method_list:
        method_list.insert(0, "baseline")
    if repeats < 1 or max_new_tokens < 1:
        raise SpecError("--repeats and --max-new-tokens must be at least 1")
    if dtype is not None and dtype not in profile_store.DTYPES:
        raise SpecError(f"--dtype must be one of {', '.join(profile_store.DTYPES)}, not '{dtype}'")
    problems = humaneval.select(humaneval.load(dataset), tasks, limit)
    run_bench(err, chosen, problems, method_list, mode_list, max_new_tokens, repeats,
              humaneval.CODE_STOPS if stop else (), out, resume, check, draft2, device, dtype)


def skip_flags(attention: str | None, mlp: str | None, profile) -> "profile_store.SelfDraft | None":
    """--skip-attention/--skip-mlp as a SelfDraft (a flag left out keeps the profile's list)."""
    if attention is None and mlp is None:
        return None
    base = profile.self_draft or profile_store.SelfDraft()

    def layers(text: str | None, default: tuple[int, ...], flag: str) -> tuple[int, ...]:
        if text is None:
            return default
        try:
            found = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
        except ValueError:
            raise SpecError(f"{flag} takes layer numbers separated by commas (e.g. 2,4,6), not '{text}'") from None
        if any(i < 0 for i in found):
            raise SpecError(f"{flag}: layer numbers start at 0")
        return tuple(found)

    return profile_store.SelfDraft(layers(attention, base.skip_attention, "--skip-attention"),
                                   layers(mlp, base.skip_mlp, "--skip-mlp"))


@app.command()
def tune(
    profile: str = typer.Option(DEFAULT_PROFILE, "--profile", "-p", help="Profile name or .toml path."),
    only: Optional[str] = typer.Option(None, "--only", help="Comma-separated steps: draft2, skip, shape (default: all that apply)."),
    show: bool = typer.Option(False, "--show", help="Show what was tuned for this profile and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print the tuning record as JSON."),
    reset: bool = typer.Option(False, "--reset", help="Forget this machine's earlier results instead of refining them."),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="HumanEval .jsonl(.gz) whose prompts to tune on (default: the cached download)."),
    prompts_from: Optional[list[Path]] = typer.Option(None, "--prompts", help="Your own prompts instead: text files (one prompt each) or a .jsonl with \"prompt\" fields."),
    count: int = typer.Option(8, "--count", help="How many prompts to tune on (HumanEval: the first N problems)."),
    modes: str = typer.Option("greedy", "--modes", help="greedy and/or topk (k=50, T=1): tune the shape for each."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", "-n", help="Tokens per measured completion."),
    iterations: int = typer.Option(30, "--iterations", help="Skip sets to measure (Bayesian optimisation)."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Stop searching after this long and keep the best so far."),
    draft2_tokens: int = typer.Option(200_000, "--draft2-tokens", help="Tokens to sample from the draft to fit draft2."),
    draft2_temperature: float = typer.Option(1.5, "--draft2-temperature", help="Sampling temperature for draft2's text (the paper: 1.5)."),
    corpus: Optional[list[Path]] = typer.Option(None, "--corpus", help="Fit draft2 on these files or folders instead of sampling."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = typer.Option(None, "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype"),
) -> None:
    """Find the fastest exact settings for a profile on this machine, and save them for generate, chat and bench.

    Steps: fit draft2 (a Katz trigram on text sampled from the draft), search the self-draft's skip set
    (Bayesian optimisation of measured tokens/s), race speculation shapes (successive halving). Results
    go to the data dir per profile and machine; settings the profile file states still win.
    """
    from spec_cli.tuneview import run_tune, show_record

    chosen = profile_store.load(profile)
    if show:
        show_record(chosen, tuned_store.resolve_key(chosen, device, dtype), as_json)
        return
    run_tune(err, chosen, only, reset, dataset, prompts_from, count, modes, max_new_tokens, iterations, minutes,
             draft2_tokens, draft2_temperature, corpus, seed, device, dtype, as_json)



@app.command("profiles")
def profiles_command(
    name: Optional[str] = typer.Argument(None, help="Show this profile (a name or a .toml path)."),
) -> None:
    """List the profiles (built-in and your own), or show one."""
    out = Console(highlight=False)
    if name is None:
        table = Table(box=None, pad_edge=False)
        for column in ("name", "from", "oracle", "draft", "description"):
            table.add_column(column)
        for profile_name, path in sorted(profile_store.available().items()):
            try:
                p = profile_store.load(str(path))
                table.add_row(profile_name, profile_store.origin(path), p.oracle.model,
                              p.draft.model if p.draft else "-", p.description)
            except SpecError as e:
                table.add_row(profile_name, profile_store.origin(path), "[red]invalid[/red]", "", str(e))
        out.print(table)
        out.print(f"\nyour profiles go in {profile_store.config_dir()}", style="dim")
        return
    p = profile_store.load(name)
    out.print(f"[bold]{p.name}[/bold]  ({p.source})")
    if p.description:
        out.print(p.description)
    out.print(f"oracle  {p.oracle.model}" + (f" @ {p.oracle.revision}" if p.oracle.revision else ""))
    out.print(f"draft   {p.draft.model if p.draft else '-'}")
    out.print(f"draft2  {p.draft2.kind + (' ' + p.draft2.path if p.draft2.path else '') if p.draft2 else '-'}")
    out.print(f"device  {p.device}   dtype  {p.dtype}")
    for key, value in vars(p.decoding).items():
        out.print(f"  {key} = {value!r}")


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        result = app(standalone_mode=False)
    except SpecError as e:
        if debug:
            raise
        err.print(f"error: {e}", style="bold red", highlight=False, markup=False)
        sys.exit(2)
    except click.exceptions.Abort:
        err.print("interrupted", style="dim")
        sys.exit(130)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", style="dim")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - last resort: one line, not a traceback
        if debug:
            raise
        err.print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", markup=False)
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)
