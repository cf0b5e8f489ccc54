"""The `spec` command line: a thin layer over the engine's events."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from spec_cli import __version__, flags
from spec_cli.core.errors import SpecError
from spec_cli.core.process import starting, unsettle
from spec_cli.models import profiles as profile_store
from spec_cli.models import tuned as tuned_store
from spec_cli.usage import is_parser_error, usage_error
from spec_cli.view import make_console

app = typer.Typer(
    help="Fast, exact local text generation with staged speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = make_console(stderr=True)


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


def _check_dtype(value: str | None) -> str | None:
    """--dtype, checked in one place for every command."""
    if value is not None and value not in profile_store.DTYPES:
        raise SpecError(f"--dtype must be one of {', '.join(profile_store.DTYPES)}, not '{value}'")
    return value


def _check_quantize(value: str | None) -> str | None:
    if value is not None and value not in profile_store.QUANTIZE:
        raise SpecError(f"--quantize must be one of {', '.join(profile_store.QUANTIZE)}, not '{value}'")
    return value


def quantize_option():
    return typer.Option(None, "--quantize", callback=_check_quantize,
                        help="The models' projections: auto (as stored; a GGUF file at its own quantization), "
                             "none (float), int8 or int4 (weight-only).")


def _check_max_memory(value: str | None) -> str | None:
    from spec_cli.exec import placement as offload

    offload.parse(value)
    return value


def max_memory_option():
    return typer.Option(None, "--max-memory", callback=_check_max_memory,
                        help="The oracle's memory per device, filled in order, the rest read from disk at every "
                             "forward, e.g. cpu=30GiB or cuda=20GiB,cpu=48GiB (none: no limit).")


def quantized(profile, quantize: str | None, max_memory: str | None = None):
    """The profile with --quantize and --max-memory applied (a model's own `quantize` in the profile still wins)."""
    from spec_cli.exec import placement as offload

    if max_memory is not None:
        profile = dataclasses.replace(profile, max_memory=offload.parse(max_memory))
    return profile if quantize is None else dataclasses.replace(profile, quantize=quantize)


def profile_option():
    return typer.Option(None, "--profile", "-p", help=f"Profile name or path to a .toml file (default: "
                                                      f"{DEFAULT_PROFILE}, unless --oracle is given).")


def oracle_option():
    return typer.Option(None, "--oracle", help="The oracle model (a folder, a hub id or a GGUF file) instead of the profile's.")


def draft_option():
    return typer.Option(None, "--draft", help="The draft model (a folder, a hub id, a GGUF file, 'self' or 'none') "
                                              "instead of the profile's; one of another vocabulary has its guesses "
                                              "translated (method speculative).")


def device_option():
    return typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N or mps.")


def compile_option():
    return typer.Option(None, "--compile/--no-compile", help="Compile each token bucket's forward into one graph "
                        "(CUDA graphs on a GPU); default: the profile's compile, auto = on CUDA only.")


def dtype_option():
    return typer.Option(None, "--dtype", callback=_check_dtype, help="auto, float32, bfloat16 or float16.")


def read_prompt(prompt: str | None) -> str:
    """The prompt argument; `-`, or none with something piped in, reads standard input."""
    if prompt == "-":
        return sys.stdin.read()
    if prompt is not None:
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise SpecError("missing prompt: give it as an argument, or pipe it into standard input")
    text = sys.stdin.read()
    if not text:
        raise SpecError("no prompt: nothing came on standard input (pass the prompt as an argument)")
    return text


@app.command()
@flags.expand
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; - or nothing (with a pipe) reads standard input."),
    profile: Optional[str] = profile_option(),
    oracle: Optional[str] = oracle_option(),
    draft: Optional[str] = draft_option(),
    given: flags.Given = flags.group(),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    quantize: Optional[str] = quantize_option(),
    max_memory: Optional[str] = max_memory_option(),
    compile: Optional[bool] = compile_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (with every event) instead of the live view."),
    trace: bool = typer.Option(False, "--trace", help="Leave the rejected draft tokens in the output ([-like this-] without colour)."),
    untuned: bool = typer.Option(False, "--untuned", help="Ignore what `spec tune` saved for this machine."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="End the completion before this text (repeatable; \\\\n is a newline)."),
) -> None:
    """Complete a prompt, streaming the tokens as the oracle decides them.

    Colours: [green]accepted draft tokens[/green] ([bold green]bold[/bold green] when draft2 guessed them),
    [red strike]rejected draft tokens[/red strike], [blue]the oracle's own tokens[/blue] (corrections and
    bonus tokens). When it ends, the screen holds the clean completion (--trace keeps the rejected ones).
    """
    from spec_cli.completion import complete, peak_memory
    from spec_cli.core.events import Token
    from spec_cli.core.process import settle
    from spec_cli.decoding.methods import DRAFTED
    from spec_cli.detok import TextStream
    from spec_cli.engine import Engine
    from spec_cli.view import TokenView, loading, summary

    prompt = read_prompt(prompt)
    chosen = tuned_store.load_profile(quantized(profile_store.select(profile, oracle, draft, DEFAULT_PROFILE),
                                                quantize, max_memory), device, dtype, given.settings.get("temperature"),
                                      use_tuned=not untuned)
    settings = chosen.decoding.replace(**given.settings)
    with loading(err, chosen.name):
        engine = Engine(chosen, device=device, dtype=dtype, need_draft=settings.method in DRAFTED,
                        compile=compile, fit_draft2=settings.method == "staged")
        plan = engine.plan(settings, given.draft2, self_draft=skip_flags(given.skip_attention, given.skip_mlp, chosen))
        settings = plan.settings  # (a draft of another vocabulary runs speculative)
        ids = engine.encode(prompt)
        engine.warm_up(plan, len(ids))
    settle()
    for note in engine.notes(plan):
        err.print(note, style="dim")
    stops = [text.replace("\\n", "\n").replace("\\t", "\t") for text in stop or ()]  # (as typed: \n, \t)
    view = TokenView(engine.tokenizer, ids, color=False if as_json else None, trace=trace, stops=stops)
    # (--json's completion, cut at a stop string; on screen the view cuts what it shows)
    stream = TextStream(engine.tokenizer, ids, stops) if as_json and stops else None
    if not as_json:
        view.start(f"{chosen.name} · {settings.method} · {engine.device.type} "
                   f"{str(engine.dtype).removeprefix('torch.')}",
                   draft2=settings.method == "staged" and plan.draft2 is not None and engine.has_draft, prompt=prompt,
                   copied=settings.method == "staged" and settings.lookup)

    def watch(event) -> bool:
        if stream is not None:
            if isinstance(event, Token) and event.output:
                stream.add(event.token)
            return stream.stopped
        if not as_json:
            view.add(event)
        return view.stopped

    done = complete(engine, ids, plan, watch=watch, trace=as_json)
    if stream is not None:
        stream.finish()
    memory = peak_memory(engine.device)
    if as_json:
        record = {
            "profile": chosen.name,
            "method": settings.method,
            "settings": {k: v for k, v in vars(settings).items()},
            "tuned": chosen.tuned,
            "device": engine.device.type,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "weights": engine.weights,
            "draft_weights": engine.draft_weights,
            "prompt": prompt,
            "completion": (stream.text if stream is not None
                           else engine.tokenizer.decode(done.tokens, skip_special_tokens=True)),
            "tokens": done.tokens,
            "events": [{"token": e.token, "kind": e.kind, "stage": e.stage,
                        **({"logprob": e.logprob, "top": [list(t) for t in e.top]} if e.logprob is not None else {})}
                       for e in done.events if isinstance(e, Token)],
            "seconds": round(done.seconds, 4),
            "tokens_per_second": round(done.tokens_per_second, 2) if done.seconds else None,
            "prompt_tokens": done.stats.prompt_tokens,
            "first_token_seconds": round(done.first_token_seconds, 4),
            "prompt_tokens_per_second": _round(done.prompt_tokens_per_second),
            "generation_tokens_per_second": _round(done.generation_tokens_per_second),
            "load_seconds": round(engine.load_seconds, 4),
            "compiled": bool(engine.compile),
            "warm_seconds": round(engine.warm_seconds, 4),
            "peak_memory": {"kind": memory[0], "bytes": memory[1]} if memory else None,
            "stats": done.stats.as_dict(),
            "interrupted": done.interrupted,
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        view.finish()
        line = summary(done, engine.load_seconds, memory, engine.warm_seconds if engine.compile else None,
                       engine.weights)
        line += " · interrupted" if done.interrupted else ""
        err.print(line, style="dim", markup=False)
    if done.interrupted:
        raise SystemExit(130)  # (said above: not main's "interrupted" too)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@app.command()
@flags.expand
def chat(
    profile: Optional[str] = profile_option(),
    oracle: Optional[str] = oracle_option(),
    draft: Optional[str] = draft_option(),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (also /system in the chat)."),
    given: flags.Given = flags.group("method", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "sampling",
                                     "draft2", max_new_tokens="Longest reply, in tokens.",
                                     seed="Seed for sampling (reply i uses seed + i)."),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    quantize: Optional[str] = quantize_option(),
    max_memory: Optional[str] = max_memory_option(),
    compile: Optional[bool] = compile_option(),
    template: Optional[str] = typer.Option(None, "--template", help="plain, or a Jinja chat template file (overrides the profile's)."),
    load: Optional[Path] = typer.Option(None, "--load", help="Continue a conversation saved with /save (with its profile, unless you name one)."),
    trace: bool = typer.Option(False, "--trace", help="Leave the rejected draft tokens in the replies on screen."),
) -> None:
    """Chat with the oracle: replies stream in the colours of generate; /help lists the commands.

    Each turn only runs the new tokens: the conversation's KV cache is kept between turns.
    """
    from spec_cli import chat as chat_session
    from spec_cli.chat.store import read_saved

    saved = read_saved(Path(load).expanduser()) if load else None
    if saved and saved.get("profile_args") and profile is None and oracle is None and draft is None:
        profile, oracle, draft = profile_store.parse_profile_args(saved["profile_args"])
    chosen = tuned_store.load_profile(quantized(profile_store.select(profile, oracle, draft, DEFAULT_PROFILE),
                                                quantize, max_memory), device, dtype, given.settings.get("temperature"))
    settings = chosen.decoding.replace(**given.settings)
    raise typer.Exit(chat_session.start(chosen, settings, given.settings, system=system, template=template,
                                        saved=saved, load=load, draft2=given.draft2, device=device, dtype=dtype,
                                        trace=trace, compile=compile))


@app.command()
@flags.expand
def serve(
    ctx: typer.Context,
    profile: Optional[str] = profile_option(),
    oracle: Optional[str] = oracle_option(),
    draft: Optional[str] = draft_option(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (another than this machine's own "
                                                          "needs an API key, or warns)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPEC_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on /v1."),
    given: flags.Given = flags.group(without=("seed", "skip_attention", "skip_mlp", "logprobs"),
                                     method="baseline, speculative, staged or self.",
                                     max_new_tokens="Tokens when a request gives no max_tokens.",
                                     temperature="When a request gives none (0 is greedy).",
                                     top_p="When a request gives none (1: off)."),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    quantize: Optional[str] = quantize_option(),
    max_memory: Optional[str] = max_memory_option(),
    compile: Optional[bool] = compile_option(),
    template: Optional[str] = typer.Option(None, "--template", help="Chat template: plain, or a Jinja file (overrides the profile's)."),
    queue: int = typer.Option(32, "--queue", help="Requests that may wait while the slots decode; more get 429."),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="Slots: requests decoded at once, each with "
                                           "its own speculation, their forwards shared (1: one at a time) "
                                           "\\[default: 4 where forwards can be shared, else 1]."),
    prefix_cache: str = typer.Option("1GiB", "--prefix-cache", help="Cache entries of earlier requests each model "
                                     "keeps for requests that share a prefix with one (0: none), e.g. 512MiB."),
    untuned: bool = typer.Option(False, "--untuned", help="Ignore what `spec tune` saved for this machine."),
    name: Optional[str] = typer.Option(None, "--name", help="The model's name in the API: what /v1/models lists "
                                       "and requests name \\[default: the profile's]."),
) -> None:
    """Serve the profile over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health), streamed or not, with exact speculative decoding.

    --parallel requests decode at once, their forwards shared; the others queue. A request that shares a
    prefix with an earlier one (a chat's next turn) runs only what follows it.
    """
    from spec_cli import serve as server
    from spec_cli.exec.placement import parse_size

    server.need_packages()
    chosen = quantized(profile_store.select(profile, oracle, draft, DEFAULT_PROFILE), quantize, max_memory)
    profiles = {sampled: tuned_store.load_profile(chosen, device, dtype, 1.0 if sampled else 0.0,
                                                   use_tuned=not untuned) for sampled in (False, True)}
    profiles[False].decoding.replace(**given.settings)  # a bad setting is one line now, not at the first request
    debug = bool(ctx.find_root().params.get("debug"))
    raise typer.Exit(server.start(profiles, given.settings, host=host, port=port, api_key=api_key or None,
                                  draft2=given.draft2, template=template, device=device, dtype=dtype,
                                  max_queue=queue, debug=debug, compile=compile,
                                  prefix_cache=parse_size(prefix_cache, "--prefix-cache"), parallel=parallel,
                                  name=name))


@app.command("fit-draft2")
def fit_draft2(
    out: Optional[Path] = typer.Argument(None, help="Where to write the n-gram model (.npz); without it, into the cache, where draft2 = \"auto\" (the default) finds it."),
    profile: Optional[str] = profile_option(),
    oracle: Optional[str] = oracle_option(),
    draft: Optional[str] = draft_option(),
    corpus: Optional[list[Path]] = typer.Option(None, "--corpus", help="Text files or folders to fit on instead of sampling (with no separate draft, by default Python's standard library)."),
    tokens: int = typer.Option(1_000_000, "--tokens", help="Tokens to sample from the draft."),
    temperature: float = typer.Option(1.5, "--temperature", help="Sampling temperature (the paper: 1.5)."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = device_option(),
) -> None:
    """Fit the paper's draft2: a Katz back-off trigram, on text sampled from the draft or on your files.

    With no separate draft (one model alone) it is fitted on a corpus (Python's standard library unless --corpus says otherwise) and its guesses go to the oracle directly.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from spec_cli.core.paths import write_whole
    from spec_cli.core.process import settle
    from spec_cli.draft2 import trigrams
    from spec_cli.draft2.fit import fit_from_corpus, fit_from_draft
    from spec_cli.view import fancy

    settle()  # (its long work is the fit, not a load: the collector's full passes back on)
    chosen = profile_store.select(profile, oracle, draft, DEFAULT_PROFILE)
    draft = trigrams.separate_draft(chosen)
    if not corpus and draft is not None:  # (a separate draft: sampled from it, as the paper does)
        model, _ = fit_from_draft(chosen, tokens, temperature, seed, device, err)
        cached = trigrams.sampled_path(draft)
    else:
        from spec_cli.models.loading import load_tokenizer

        what = "your files" if corpus else "Python's standard library"
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=not fancy(err)) as progress:
            task = progress.add_task(f"fitting draft2's trigram on {what}")
            tokenizer = load_tokenizer(chosen.oracle)
            model = fit_from_corpus(chosen, corpus, lambda done, total: progress.update(task, completed=done,
                                                                                        total=total), tokenizer)
        cached = trigrams.corpus_path(tokenizer)
    target = write_whole(out or cached, model.save)  # (whole or not at all: `auto` may read it)
    err.print(f"wrote {target}: {int(model.unigram_counts.sum())} tokens, {len(model.tri_keys)} distinct trigrams"
              + ("" if out else "; draft2 = \"auto\" uses it from now on"), style="dim")


bench_app = typer.Typer(help="Benchmarks: the paper's experiment on your machine.", no_args_is_help=True,
                        context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(bench_app, name="bench")


@bench_app.command("humaneval")
def bench_humaneval(
    profile: Optional[str] = profile_option(),
    oracle: Optional[str] = oracle_option(),
    draft: Optional[str] = draft_option(),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="A local HumanEval .jsonl or .jsonl.gz (default: downloaded once into the cache), or any .jsonl of {\"prompt\": ...} lines (named FILE/0, FILE/1 ...)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N problems."),
    tasks: Optional[list[str]] = typer.Option(None, "--tasks", help="Problems to run, e.g. 0,5,HumanEval/7 or 100-111."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated: baseline, speculative, staged, self, auto (the profile's or tuned method), hf_greedy, hf_assisted; add :untuned (e.g. auto:untuned) to ignore `spec tune`'s results. baseline:again times the oracle alone a second time: its ratios are the noise floor of one timing. \\[default: baseline,speculative,staged,hf_assisted]"),
    modes: Optional[str] = typer.Option(None, "--modes", help="greedy, topk (k=50, T=1) and/or topp (p=0.95, T=0.8). \\[default: greedy,topk]"),
    max_new_tokens: Optional[int] = flags.option("max_new_tokens", "\\[default: 128]"),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Time each run this many times (median). \\[default: 1]"),
    stop: Optional[bool] = typer.Option(None, "--stop/--no-stop", help="Stop at a new top-level def/class/print/if __name__. \\[default: no-stop]"),
    out: Path = typer.Option(Path("spec-bench"), "--out", help="Folder for run.json, results.jsonl, summary.json and the plot."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run in --out, with the settings it was started with."),
    check: Optional[bool] = typer.Option(None, "--check/--no-check", help="Run each completion against the problem's tests (pass@1). EXECUTES MODEL-WRITTEN CODE."),
    draft2: Optional[str] = flags.option("draft2", "auto, none, prompt-lookup, an n-gram .npz file, or prompt-lookup+FILE.npz."),
    sampling: Optional[str] = flags.option("sampling", "sampled modes: coupled (every method samples baseline's text for the problem's seed, so speeds compare on the same text) or rejection. \\[default: the profile's]"),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    quantize: Optional[str] = quantize_option(),
    max_memory: Optional[str] = max_memory_option(),
) -> None:
    """Speed across HumanEval: baseline vs speculative vs staged vs Hugging Face assisted generation.

    --resume --out DIR alone continues a run: DIR/run.json remembers every setting it was started with.
    """
    from spec_cli.benchview import resolve_options, run_bench

    given = dict(profile=profile, oracle=oracle, draft=draft, dataset=dataset, limit=limit, tasks=tasks,
                 methods=methods, modes=modes, max_new_tokens=max_new_tokens, repeats=repeats, stop=stop,
                 check=check, draft2=draft2, sampling=sampling, device=device, dtype=dtype, quantize=quantize,
                 max_memory=max_memory)
    options = resolve_options({k: v for k, v in given.items() if v is not None}, out, resume)
    chosen = quantized(profile_store.select(options["profile"], options["oracle"], options["draft"], DEFAULT_PROFILE),
                       options["quantize"], options["max_memory"])
    run_bench(err, chosen, options, out, resume)


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
    profile: Optional[str] = profile_option(),
    oracle: Optional[str] = oracle_option(),
    draft: Optional[str] = draft_option(),
    only: Optional[str] = typer.Option(None, "--only", help="Comma-separated steps: draft2, heads, skip, shape (default: all that apply)."),
    show: bool = typer.Option(False, "--show", help="Show what was tuned for this profile and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print the tuning record as JSON."),
    reset: bool = typer.Option(False, "--reset", help="Forget this machine's earlier results instead of refining them."),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="A .jsonl(.gz) whose prompts to tune on: HumanEval's, or any {\"prompt\": ...} lines (default: the cached HumanEval)."),
    prompts_from: Optional[list[Path]] = typer.Option(None, "--prompts", help="Your own prompts instead: text files (one prompt each) or a .jsonl with \"prompt\" fields."),
    count: int = typer.Option(8, "--count", help="How many prompts to tune on (HumanEval: the first N problems)."),
    modes: str = typer.Option("greedy", "--modes", help="greedy and/or topk (k=50, T=1): tune the shape for each."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", "-n", help="Tokens per measured completion."),
    iterations: int = typer.Option(30, "--iterations", help="Skip sets to measure (Bayesian optimisation)."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Stop searching after this long and keep the best so far."),
    draft2_tokens: int = typer.Option(200_000, "--draft2-tokens", help="Tokens to sample from the draft to fit draft2."),
    draft2_temperature: float = typer.Option(1.5, "--draft2-temperature", help="Sampling temperature for draft2's text (the paper: 1.5)."),
    corpus: Optional[list[Path]] = typer.Option(None, "--corpus", help="Fit draft2 (and a model alone's heads) on these files or folders instead of sampling (a model alone: instead of Python's standard library)."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
) -> None:
    """Find the fastest exact settings for a profile on this machine, and save them for generate, chat and bench.

    Steps: fit draft2 (a Katz trigram on text sampled from the draft), for a model alone fit heads on its own
    reads of a corpus (guesses from its last state: minutes on a CPU), search the self-draft's skip set
    (Bayesian optimisation of measured tokens/s), race speculation shapes (successive halving) against the
    oracle alone. Results go to the data dir per profile and machine; settings the profile file states
    still win.
    """
    from spec_cli.tuneview import TuneCommand, run_tune, show_record

    chosen = profile_store.select(profile, oracle, draft, DEFAULT_PROFILE)
    if show:
        show_record(chosen, tuned_store.resolve_key(chosen, device, dtype), as_json)
        return
    run_tune(err, chosen, TuneCommand(
        only=only, reset=reset, dataset=dataset, prompt_files=prompts_from, count=count, modes=modes,
        max_new_tokens=max_new_tokens, iterations=iterations, minutes=minutes, draft2_tokens=draft2_tokens,
        draft2_temperature=draft2_temperature, corpus=corpus, seed=seed, device=device, dtype=dtype,
        as_json=as_json))


@app.command()
def check(
    model: str = typer.Argument(..., help="A hub id, a local model folder or a GGUF file."),
    device: Optional[str] = device_option(),
    tokens: int = typer.Option(24, "--tokens", help="Greedy tokens to compare with generate()."),
) -> None:
    """Check that spec reproduces a model exactly (float32): greedy decoding against the model's own
    generate(), and a speculative tree scored in one forward against each path run alone. A family spec has
    no test for runs a shorter form of this on first load; this one's verdict is kept for those loads too."""
    import time

    import torch

    from spec_cli.core import paths
    from spec_cli.core.families import FAMILIES
    from spec_cli.core.hardware import pick_device
    from spec_cli.core.process import settle
    from spec_cli.core.settings import ModelRef
    from spec_cli.models import firstload
    from spec_cli.models.conformance import conformance
    from spec_cli.models.loading import load
    from spec_cli.view import loading, make_console

    chosen = pick_device(device or "auto")
    with loading(err, model):
        loaded = load(ModelRef(model), chosen, torch.float32, untested=True)
    settle()
    kind = loaded.model.config.model_type
    err.print(f"{model}: {kind} ({FAMILIES.get(kind, 'not among the tested families')}), {chosen.type} float32")
    out = make_console()
    results = []
    start = time.perf_counter()
    for result in conformance(loaded.model, loaded.tokenizer, tokens):
        results.append(result)
        mark = "[green]ok[/green]  " if result.ok else "[red]FAIL[/red]"
        out.print(f"{mark} {result.name}: {result.detail}")
    if kind not in FAMILIES:
        firstload.record(loaded.model.config, results, torch.float32, time.perf_counter() - start)
    if not all(r.ok for r in results):
        out.print("spec cannot run this model exactly", style="bold red")
        raise typer.Exit(1)
    if kind not in FAMILIES:
        out.print(f"passes: the '{kind}' family is not in spec's tests, and this verdict is kept (in "
                  f"{paths.cache_dir()}) so loading it runs at once")


@app.command("profiles")
def profiles_command(
    name: Optional[str] = typer.Argument(None, help="Show this profile (a name or a .toml path)."),
) -> None:
    """List the profiles (built-in and your own), or show one."""
    out = make_console()
    if name is None:
        table = Table(box=None, pad_edge=False)
        for column in ("name", "for", "oracle", "draft", "from"):  # a name is never broken: it is typed back
            table.add_column(column, overflow="fold", no_wrap=column == "name")
        for profile_name, path in sorted(profile_store.available().items()):
            try:
                p = profile_store.load(str(path))
                table.add_row(profile_name, p.description, p.oracle.model, p.draft.model if p.draft else "-",
                              profile_store.origin(path))
            except SpecError as e:
                table.add_row(profile_name, str(e), "[red]invalid[/red]", "", profile_store.origin(path))
        out.print(table)
        out.print(f"\nyour profiles go in {profile_store.config_dir()}; `spec check MODEL` tells whether spec runs "
                  f"a model (a hub id or a folder) exactly", style="dim")
        return
    p = profile_store.load(name)
    out.print(f"[bold]{p.name}[/bold]  ({p.source})")
    if p.description:
        out.print(p.description)
    out.print(f"oracle  {p.oracle.model}" + (f" @ {p.oracle.revision}" if p.oracle.revision else "")
              + (f"  gguf_file {p.oracle.gguf_file}" if p.oracle.gguf_file else ""))
    out.print(f"draft   {p.draft.model if p.draft else '-'}"
              + (f"  gguf_file {p.draft.gguf_file}" if p.draft and p.draft.gguf_file else ""))
    out.print(f"draft2  {p.draft2.kind + (' ' + p.draft2.path if p.draft2.path else '') if p.draft2 else '-'}")
    out.print(f"device  {p.device}   dtype  {p.dtype}")
    for key, value in vars(p.decoding).items():
        out.print(f"  {key} = {value!r}")


@app.command("cache")
def cache_command(
    clear: Optional[list[str]] = typer.Option(
        None, "--clear", metavar="WHAT", help="Remove: 'stale' (what this spec can never use again), a kind (gguf, quantized, native, "
        "draft2, learned, checks, vocabulary, offload), an entry's name, or 'all'. Repeat it for several."),
    unused_for: Optional[float] = typer.Option(None, "--unused-for", metavar="DAYS", help="Only entries not used "
                                               "for DAYS days (a GGUF or quantized copy: loaded; the rest: written)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries (or those removed) as one JSON object."),
) -> None:
    """List what spec keeps in its cache dir (GGUF files read at their quantization, kernels, trigrams, what the
    controllers learned), its size and what is stale; --clear removes it. All of it is made again when needed."""
    from spec_cli import cachedir
    from spec_cli.core.paths import cache_dir
    from spec_cli.view import size

    out = make_console()
    found = cachedir.entries()
    if unused_for is not None:
        if unused_for < 0:
            raise SpecError(f"--unused-for takes days (0 or more), not {unused_for:g}")
        found = [e for e in found if e.modified < time.time() - unused_for * 86400]
    if clear:
        gone = cachedir.select(found, clear)
        for entry in gone:
            cachedir.remove(entry)
            if as_json:
                continue
            out.print(f"removed {entry.kind}/{entry.path.name}  {size(entry.bytes)}  {entry.what}", highlight=False)
        if as_json:
            print(json.dumps({"cache_dir": str(cache_dir()), "removed": [cachedir.as_dict(e) for e in gone],
                              "freed_bytes": sum(e.bytes for e in gone)}))
            return
        out.print(f"{len(gone)} removed, {size(sum(e.bytes for e in gone))} freed in {cache_dir()}", style="dim",
                  highlight=False)
        return
    if as_json:
        print(json.dumps({"cache_dir": str(cache_dir()), "entries": [cachedir.as_dict(e) for e in found],
                          "bytes": sum(e.bytes for e in found),
                          "stale_bytes": sum(e.bytes for e in found if e.stale)}))
        return
    if not found:
        out.print(f"{cache_dir()} holds nothing of spec's"
                  + (f" unused for {unused_for:g} days" if unused_for is not None else ""), highlight=False)
        return
    width = max(len(f"{e.kind}/{e.path.name}") for e in found)
    for entry in found:  # (two lines an entry, whatever the terminal's width: its name is typed back whole)
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.modified))
        out.print(f"{entry.kind + '/' + entry.path.name:<{width}}  {size(entry.bytes):>9}  {used}", highlight=False,
                  markup=False, soft_wrap=True)
        out.print(f"    {escape(entry.what)}" + (f" [red](stale: {escape(entry.stale)})[/red]" if entry.stale else ""),
                  highlight=False)
    stale = [e for e in found if e.stale]
    line = f"\n{size(sum(e.bytes for e in found))} in {cache_dir()} (SPEC_CACHE_DIR moves it)"
    if stale:
        line += f"; {len(stale)} stale, {size(sum(e.bytes for e in stale))}: `spec cache --clear stale` removes them"
    out.print(line, style="dim", highlight=False)


def main() -> None:
    starting()
    args = sys.argv[1:]
    debug = "--debug" in args
    if os.environ.get("NO_COLOR"):  # typer's help too: not even bold
        from typer import rich_utils

        rich_utils.COLOR_SYSTEM = None
    try:
        result = app(args=args, prog_name="spec", standalone_mode=False)
    except SpecError as e:
        if debug:
            raise
        err.print(f"error: {e}", style="bold red", highlight=False, markup=False)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted", style="dim")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - usage errors (typer's or click's), then a last resort
        if type(e).__name__ == "Abort" and is_parser_error(e):  # end of input at a parser prompt
            err.print("interrupted", style="dim")
            sys.exit(130)
        if debug:
            raise
        usage = usage_error(e)
        if usage is not None:
            code, line, out = usage
            if out:
                print(out, end="" if out.endswith("\n") else "\n")
            if line:
                err.print(f"error: {line}", style="bold red", highlight=False, markup=False)
            sys.exit(code)
        err.print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", markup=False)
        sys.exit(1)
    finally:
        unsettle()
    if result == 130:  # typer turns a Ctrl-C no command handled into this code, silently
        err.print("interrupted", style="dim")
    sys.exit(result if isinstance(result, int) else 0)
