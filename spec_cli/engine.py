"""The models of a profile, loaded once, turning token prompts into decoding events as each call's Plan says."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.core import process
from spec_cli.core.errors import SpecError, say
from spec_cli.core.events import Event
from spec_cli.core.families import Skip, num_layers
from spec_cli.core.hardware import pick_device
from spec_cli.core.settings import Decoding, Draft2Ref, ModelRef, Profile, SelfDraft
from spec_cli.decoding import learned
from spec_cli.decoding.chain import Models
from spec_cli.decoding.methods import DRAFTED, NEEDS_DRAFT, decode
from spec_cli.draft2 import trigrams
from spec_cli.draft2.ngram import Drafter, KatzTrigram, LookupOrTrigram, PromptLookup
from spec_cli.exec import Runner
from spec_cli.exec import placement as offload
from spec_cli.exec.prefixes import Prefixes
from spec_cli.models import translation
from spec_cli.models.loading import Loaded, dtype_for, load
from spec_cli.models.profiles import profile_args


@dataclass(frozen=True)
class Plan:
    """What one completion runs: the decoding settings, the second stage (a drafter or None), the skip set of a
    self-draft (None: none) and whether a model alone's fitted heads guess. Front ends build one per call; the
    engine keeps no settings."""

    settings: Decoding
    draft2: Drafter | None = None
    skip: Skip | None = None
    heads: bool = False  # whether a model alone's staged steps guess with its fitted heads too, if it has any

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)


def layer_weights(config) -> int:
    """About how many weights a model's layers hold (width squared, times the MLP's part, times depth): what a
    forward reads, for telling a draft from its oracle."""
    text = getattr(config, "text_config", None) or config
    width = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None) or getattr(text, "d_model", 0)
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * width
    return num_layers(text) * width * (4 * width + 3 * inner)


class Engine:
    """A cache of a profile's loaded models: the oracle at once, the draft on first use (`need_draft` loads
    it now), n-gram drafters by file, and a KV-cache runner per model. What to run comes with each call."""

    def __init__(self, profile: Profile, device: str | None = None, dtype: str | None = None,
                 need_draft: bool = False, compile: bool | None = None, fit_draft2: bool = False,
                 quantize: str | None = None, prefix_cache: int = 0):
        process.inference()
        start = time.perf_counter()
        self.profile = profile
        self.prefix_cache = prefix_cache  # bytes of earlier sequences' cache entries each model keeps (0: none)
        self._prefixes: dict[str, Prefixes] = {}
        self.device = pick_device(offload.device_for(device or profile.device, profile.max_memory))
        self.quantize = quantize or profile.quantize  # (a model's own `quantize` wins)
        self.oracle: Loaded = load(profile.oracle, self.device,
                                   dtype_for(profile.oracle, dtype or profile.dtype, self.device, self.quantize),
                                   quantize=self.quantize, max_memory=profile.max_memory)
        self.dtype = next(self.oracle.model.parameters()).dtype  # the oracle's own dtype may have won
        self.compile = offload.uncompiled(self.oracle.model, compiled(compile, profile.compile, self.device),
                                          asked=bool(compile) or profile.compile == "on")
        self.tokenizer = self.oracle.tokenizer
        self.vocab_size = max(self.oracle.model.config.vocab_size, len(self.tokenizer))
        self.eos = frozenset(_eos_ids(self.oracle))
        self.layers = num_layers(self.oracle.model.config)
        self.self_drafted = profile.draft is not None and profile.draft.model == "self"
        self.draft: Loaded | None = None
        self.translator = None  # a draft of another vocabulary: its guesses translated (`models.translation`)
        self._drafters: dict[tuple, Drafter | None] = {}
        self.fit_draft2 = fit_draft2  # may start fitting draft2's trigram in the background (front ends)
        self.note: str | None = None  # something the front end should tell the user
        self._runners: dict[str, tuple[Runner, Skip]] = {}
        # staged's controllers by draft (name, skip set), then by way of decoding (whether speculating pays
        # differs between them): this machine's measurements, kept across completions and runners rebuilt
        self._controllers: dict[tuple[str, Skip], dict] = {}
        self._warm: set = set()  # runners whose padded shapes have all run once (`_warm_key`)
        self._slots_warm: set = set()  # ... the slots' (`slot`): shared by them all
        self.lockstep = None  # (a slot's) the Lockstep its runners' forwards run in, with the other slots'
        self.persist = True  # whether staged's controllers keep what they learned on disk (`decoding.learned`)
        self.warm_forwards = 0
        self.warm_seconds = 0.0  # running each shape once: with --compile, building the graphs
        self.load_seconds = time.perf_counter() - start
        if need_draft and self.has_draft and not self.self_drafted:
            self.load_draft()

    def slot(self, lockstep) -> "Engine":
        """An engine for one of several sequences decoded at once (a server's slot): the same loaded models,
        drafters and prefix caches, its own runners (caches) and controllers, its forwards run in `lockstep` with
        the other slots' (`exec.lockstep`). Its controllers learn what speculating pays beside the others and
        keep it to themselves: alone, a step costs otherwise."""
        if self.has_draft and not self.self_drafted:
            self.load_draft()  # (once, here: not once a slot)
        slot = copy.copy(self)
        slot._runners, slot._warm, slot._controllers = {}, self._slots_warm, {}
        slot.lockstep, slot.persist = lockstep, False
        return slot

    def remember(self) -> None:
        """Put what each runner holds into the prefix caches (a slot, after each request: its successor in the
        conversation may go to another slot)."""
        for runner, _ in self._runners.values():
            runner.remember()

    def shares_forwards(self) -> bool:
        """Whether several slots' forwards can run as one here (`exec.lockstep`): the oracle runs eagerly on the
        lean loop at exact shapes (not compiled, not at CUDA's one shape, not spread over devices)."""
        from spec_cli.exec import backends

        model = self.oracle.model
        return (backends.lean_kind(model) is not None and not self.compile and self.device.type != "cuda"
                and not offload.spans_devices(model))

    @property
    def weights(self) -> dict:
        """The oracle's weights: {'format': e.g. 'int4+bfloat16', 'bytes': ..., 'quantized': projections}, and
        when it is offloaded its decoder layers per place ('placement': {'cpu': 3, 'disk': 5})."""
        from spec_cli.exec import quant

        return {**quant.summary(self.oracle.model), **offload.summary(self.oracle.model)}

    @property
    def draft_weights(self) -> dict | None:
        """The separate draft's weights as `weights` gives the oracle's, and its dtype (None: none loaded)."""
        from spec_cli.exec import quant

        if self.draft is None:
            return None
        dtype = str(next(self.draft.model.parameters()).dtype).removeprefix("torch.")
        return {**quant.summary(self.draft.model), "dtype": dtype}

    @property
    def has_draft(self) -> bool:
        return self.profile.draft is not None

    def load_draft(self) -> Loaded:
        """The separate draft model, loaded on first use."""
        if self.draft is None:
            if self.self_drafted or self.profile.draft is None:
                raise SpecError("this needs a separate draft model, and the profile names none")
            start = time.perf_counter()
            self.draft = load(self.draft_ref(), self.device, self.dtype, quantize=self.quantize)
            differs = translation.difference(self.oracle.tokenizer, self.draft.tokenizer)
            if differs:
                self.translator = translation.Translator(self.oracle.tokenizer, self.draft.tokenizer)
                self.note = (f"the draft speaks another vocabulary than the oracle ({differs}): its guesses are "
                             f"translated through their text (method speculative; staged needs one vocabulary)")
            drafts, oracles = layer_weights(self.draft.model.config), layer_weights(self.oracle.model.config)
            if drafts > 1.5 * oracles:
                swapped = (f"the draft is larger than the oracle (its layers' weights: {drafts / 1e6:.0f}M against "
                           f"{oracles / 1e6:.0f}M): its guesses cost more than they save; the oracle is the model "
                           "whose output you get (swap --oracle and --draft?)")
                self.note = f"{self.note}\n{swapped}" if self.note else swapped
            self.load_seconds += time.perf_counter() - start
        return self.draft

    def draft_ref(self) -> ModelRef:
        """The draft as it loads: as the profile names it, except that on a CPU where spec's int4 kernel runs a
        draft whose weights nobody chose (no `quantize` or `dtype` for it, no `quantize` for the profile) gets
        int4 ones and bfloat16 (a GGUF file: its 4-bit blocks as they are, wider ones requantized): a draft's
        precision changes no output, only its guesses, and its forward is the overhead every speculative step
        pays (benchmarks/reports: pyfam's draft, and Qwen2.5-Coder-0.5B's Q5_0 file beside the 1.5B)."""
        from spec_cli.exec import quant

        ref = self.profile.draft
        if (ref.quantize is None and ref.dtype is None and self.quantize in (None, "auto")
                and self.device.type == "cpu" and quant.native_kernel() is not None):
            return dataclasses.replace(ref, quantize="int4", dtype="bfloat16")
        return ref

    def drafter(self, flag: str | None = None, ref: Draft2Ref | None = None) -> Drafter | None:
        """The second stage `--draft2 FLAG` or the profile's `ref` names (the flag wins), loaded once. "auto":
        prompt lookup, with a trigram once one is fitted (`trigrams.ready`: a separate draft's, sampled from it;
        a model alone's, its tokenizer's on a corpus); with `fit_draft2`, a first use fits a model alone's here on
        a CPU (`trigrams.fits_here`), else starts fitting one in the background (`self.note` says so)."""
        key = ("flag", flag) if flag is not None else ("ref", ref)
        if key not in self._drafters:
            auto = draft2_kind(flag, ref)[0] == "auto"  # (only auto reads a trigram: a tokenizer's key costs ~0.1 s)
            fitted = trigrams.ready(self.profile, self.tokenizer) if auto else None
            unfitted = auto and self.fit_draft2 and fitted is None
            draft = trigrams.separate_draft(self.profile)
            if unfitted and draft is None and trigrams.fits_here(self.device.type):
                fitted = trigrams.fit_here(self.profile.oracle, self.tokenizer, say)
                unfitted = fitted is None
            self._drafters[key] = load_draft2(flag, ref, self.vocab_size, fitted)
            if unfitted:
                if (trigrams.fit_in_background(draft, self.device.type) if draft is not None else
                        trigrams.fit_in_background(self.profile.oracle, self.device.type, self.tokenizer)):
                    self.note = (f"fitting draft2's trigram from {'the draft' if draft else 'a corpus'} in the "
                                 f"background (once, cached in {trigrams.folder()}); until then draft2 is prompt "
                                 f"lookup alone")
                elif draft is None:
                    self.note = ("no trigram is fitted for this model yet: `spec fit-draft2` with the same model "
                                 "options fits one once (about 20 s); its guesses speed up code")
        return self._drafters[key]

    def skip_set(self, self_draft: SelfDraft | None) -> Skip | None:
        """A self-draft's skip lists as the runner's Skip, checked against the oracle's layers."""
        if self_draft is None:
            return None
        return Skip.of(self_draft.skip_attention, self_draft.skip_mlp).check(self.layers)

    def plan(self, settings: Decoding, draft2: str | None = None, profile: Profile | None = None,
             self_draft: SelfDraft | None = None) -> Plan:
        """A Plan for `settings`: `--draft2` else the profile's draft2; `self_draft` else the profile's."""
        profile = profile or self.profile
        auto = draft2_kind(draft2, profile.draft2)[0] == "auto"
        return Plan(self.runnable(settings), self.drafter(draft2, profile.draft2),
                    self.skip_set(self_draft or profile.self_draft), heads=auto)

    def heads(self, fitted=None):
        """The heads fitted on this oracle (`spec tune`), guessing beside the lookup and the trigram where the
        oracle runs alone (no draft model): None where none were fitted, there is a draft, or its steps run
        compiled (the state they read is kept by eager forwards only: a server's shared forwards keep it too).
        Loaded once, when a staged completion first needs them (`fitted`: heads just fitted, used from now on),
        and shared by a server's slots."""
        if self.has_draft or self.compile:
            return None
        if fitted is not None or ("heads",) not in self._drafters:
            from spec_cli.draft2 import heads

            self._drafters[("heads",)] = fitted or heads.load(self.profile.oracle, self.oracle.model)
        return self._drafters[("heads",)]

    def notes(self, plan: Plan) -> list[str]:
        """What to tell a user before a completion of `plan` starts: the engine's note, the heads' tip."""
        return [note for note in (self.note, self.heads_tip(plan)) if note]

    def heads_tip(self, plan: Plan) -> str | None:
        """What to tell a user whose model alone decodes staged without fitted heads where it could have them."""
        if (not plan.heads or plan.settings.method != "staged" or self.has_draft or self.compile
                or self.heads() is not None):
            return None
        from spec_cli.draft2 import heads

        if not heads.fits(self.oracle.model):
            return None
        return ("tip: `spec tune --only heads` (the same model options) fits this model a small head once (~7 min "
                "for a 1.5B on 2 cores) that guesses new code: the 1.5B coder alone ran 1.53x its plain decoding on "
                "code prompts with it, 1.31x without (a 2-core Xeon)")

    def runnable(self, settings: Decoding) -> Decoding:
        """`settings` as this engine's models can run them: with a draft of another vocabulary, staged (trees in
        one vocabulary) runs as speculative (its guesses translated)."""
        if self.translator is not None and settings.method == "staged":
            return settings.replace(method="speculative")
        return settings

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise SpecError("the prompt is empty and the tokenizer has no BOS token to start from")
            ids = [bos]
        return ids

    def _runner(self, name: str, model: torch.nn.Module, needed: int, skip: Skip = Skip()) -> Runner:
        """The cached runner `name`, rebuilt when it is too small or was built with another skip set."""
        runner, built_with = self._runners.get(name, (None, None))
        if runner is None or built_with != skip or runner.capacity < min(needed, runner.context):
            capacity = -(-needed // 256) * 256
            if self.device.type == "cuda" or self.compile:  # the whole capacity is attended: one size keeps
                capacity = max(capacity, 4096)              # shapes warm
            if runner is not None:  # its cache goes before the new one is allocated
                del self._runners[name]
                self._warm.discard(id(runner))  # (its own shapes; a lean loop slots share stays warm)
                runner = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if self.prefix_cache and name not in self._prefixes:
                self._prefixes[name] = Prefixes(self.prefix_cache)
            foreign = name == "draft" and self.translator is not None  # (it speaks its own words)
            runner = Runner(model, vocab_size=None if foreign else self.vocab_size, capacity=capacity, skip=skip,
                            compile=self.compile, prefixes=self._prefixes.get(name),
                            words=None if foreign else self._draft_words(name, model), lockstep=self.lockstep)
            self._runners[name] = (runner, skip)
        return runner

    def _draft_words(self, name: str, model: torch.nn.Module) -> torch.Tensor | None:
        """The part of the vocabulary a separate draft drafts from (`models.vocabulary`): SPEC_DRAFT_WORDS (else
        `DRAFT_WORDS`) most frequent words; None: all."""
        count = self._draft_word_count(model)
        if name != "draft" or not count:
            return None
        from spec_cli.models import vocabulary

        return vocabulary.frequent(self.tokenizer, count)

    @staticmethod
    def _draft_word_count(model: torch.nn.Module) -> int:
        """SPEC_DRAFT_WORDS (else `DRAFT_WORDS`) where it is fewer than the draft's words, else 0 (all)."""
        text = os.environ.get("SPEC_DRAFT_WORDS", str(DRAFT_WORDS))
        try:
            count = int(text)
        except ValueError:
            count = -1
        if count < 0:
            raise SpecError(f"SPEC_DRAFT_WORDS: a number of words (0: all of them), not {text!r}")
        return count if count < model.config.vocab_size else 0

    def prefix_caches(self) -> dict[str, Prefixes]:
        """Each model's prefix cache, by the runner's name ("oracle", "draft")."""
        return dict(self._prefixes)

    def _need_skip(self, skip: Skip | None, why: str) -> Skip:
        if skip is None:
            raise SpecError(f"{why} needs a skip set: `spec tune {profile_args(self.profile)} --only skip` "
                            f"finds one for this machine (or state [self_draft] skip_attention = [...] and "
                            f"skip_mlp = [...] in a profile, or --skip-attention/--skip-mlp)")
        return skip

    def events(self, prompt: list[int], plan: Plan | Decoding, reuse: bool = False) -> Iterator[Event]:
        """Decoding events for `prompt` as `plan` says (a bare Decoding: no draft2, no self-draft);
        `reuse` keeps the cached prefix shared with the last call (chat)."""
        if isinstance(plan, Decoding):
            plan = Plan(plan)
        settings = plan.settings
        context = self.oracle.context
        if len(prompt) >= context:
            raise SpecError(
                f"the prompt is {len(prompt)} tokens, but the oracle's context window is {context} tokens "
                f"(it must leave room for at least one new token)"
            )
        needed = len(prompt) + settings.max_new_tokens + max(settings.draft_tokens, settings.tree_budget) + 2
        if reuse:
            needed = max(needed, min(context, 4096))
        models = self._models(plan, needed)
        return _kept(decode(models, prompt, settings, reuse=reuse), models.controllers)

    def _learned_key(self, draft: str, skip: Skip) -> dict:
        """What a controller's measurements hold for: the oracle, the draft (a model, the oracle with `skip`,
        or none), the dtype, the machine and its threads."""
        from spec_cli.models.tuned import machine_key

        drafter = {"draft": draft, "skip": [list(skip.attention), list(skip.mlp)]}
        if draft == "heads":  # (the heads fitted: guesses and costs of their own)
            drafter["heads"] = self._drafters[("heads",)].key
        if draft == "draft":
            drafter["model"] = _identity(self.draft.ref, self.draft)
            words = self._draft_word_count(self.draft.model)
            if words:  # (a cut draft costs and guesses otherwise)
                drafter["words"] = words
        return {"oracle": _identity(self.profile.oracle, self.oracle), "drafter": drafter,
                "weights": self.weights["format"], "placement": self.weights.get("placement"),
                "machine": machine_key(self.device, self.dtype),
                "threads": torch.get_num_threads()}

    def warm_up(self, plan: Plan | Decoding, prompt_tokens: int = 256) -> int:
        """Build the runners `plan` needs and run each of their padded shapes once (GPUs, AMX), so that the
        loading spinner pays for kernels built per shape, not the first completion; returns the forwards run
        (0 where shapes are exact, or already warm). `events` warms a runner it had to build, too."""
        if isinstance(plan, Decoding):
            plan = Plan(plan)
        settings = plan.settings
        needed = prompt_tokens + settings.max_new_tokens + max(settings.draft_tokens, settings.tree_budget) + 2
        before = self.warm_forwards
        self._models(plan, min(needed, self.oracle.context))
        return self.warm_forwards - before

    def _models(self, plan: Plan, needed: int) -> Models:
        settings = plan.settings
        models = Models(self._runner("oracle", self.oracle.model, needed), eos=self.eos)
        if settings.method == "self":
            models.self_skip = self._need_skip(plan.skip, "method 'self'")
        elif settings.method in DRAFTED:
            if self.self_drafted:
                name, skip = "self-draft", self._need_skip(plan.skip, "draft = 'self'")
                models.draft = self._runner(name, self.oracle.model, needed, skip)
            elif self.profile.draft is not None:
                name, skip = "draft", Skip()
                models.draft = self._runner(name, self.load_draft().model, needed)
                models.translator = self.translator
            elif settings.method in NEEDS_DRAFT:
                raise SpecError(f"method '{settings.method}' needs a draft model, and the profile names none "
                                f"(staged runs without one)")
            else:  # staged with the lookup's guesses alone, or with fitted heads'
                models.heads = self.heads() if plan.heads else None
                name, skip = "heads" if models.heads is not None else "none", Skip()
            if settings.method == "staged":
                models.draft2 = plan.draft2
                if (name, skip) not in self._controllers:
                    self._controllers[(name, skip)] = learned.Controllers(self._learned_key(name, skip),
                                                                          persist=self.persist)
                models.controllers = self._controllers[(name, skip)]
        for runner in (models.oracle, models.draft):
            if runner is not None and _warm_key(runner) not in self._warm:
                start = time.perf_counter()
                self.warm_forwards += runner.warm_up()
                if models.self_skip and runner is models.oracle:
                    self.warm_forwards += runner.warm_up(skip=models.self_skip)
                runner.synchronize()
                self.warm_seconds += time.perf_counter() - start
                self._warm.add(_warm_key(runner))
        return models


def _kept(events: Iterator[Event], controllers) -> Iterator[Event]:
    """A completion's events; at its end (or when it stops early) what its controllers learned is kept."""
    try:
        yield from events
    finally:
        if isinstance(controllers, learned.Controllers):
            controllers.save()


def _identity(ref: ModelRef, loaded: Loaded) -> dict:
    """A model as a controller's measurements know it: where it came from and its configuration."""
    from spec_cli.models.firstload import key

    where = Path(ref.model).expanduser()
    model = str(where.resolve()) if where.exists() else ref.model
    return {"model": model, "revision": ref.revision, "gguf_file": ref.gguf_file, "quantize": ref.quantize,
            "config": key(loaded.model.config)["config"]}


def compiled(flag: bool | None, setting: str, device: torch.device) -> bool | str:
    """Whether runners compile their steps: the flag, else the profile's mode (auto: on CUDA only). The
    backend is SPEC_COMPILE_BACKEND's when set (inductor; cudagraphs: traced, then captured as CUDA graphs
    without inductor's kernels; eager: trace only), else on CUDA cudagraphs (a fraction of inductor's time to
    capture, for somewhat slower forwards than its fused kernels give), elsewhere inductor."""
    on = flag if flag is not None else (setting == "on" or (setting == "auto" and device.type == "cuda"))
    if not on:
        return False
    return os.environ.get("SPEC_COMPILE_BACKEND") or ("cudagraphs" if device.type == "cuda" else "inductor")


def _warm_key(runner: Runner):
    """What a warm-up warms: a runner's own shapes; in lockstep, the lean loop its model's runners share (its
    packed weights, whose kernels are built per shape for the process): a server's slot after the first runs
    none, where 16 new slots' warm-ups held up the first crowd of requests."""
    return id(runner) if runner.lockstep is None else ("lean", id(runner.lean))


LOOKUP_PLUS = "prompt-lookup+"
DRAFT_WORDS = 0  # a draft's words (FR-Spec; 0: all): off, as measured on the Qwen pair (docs/models.md)


def draft2_kind(flag: str | None, ref: Draft2Ref | None) -> tuple[str, str | None]:
    """(kind, n-gram path) of the second stage --draft2 FLAG or else the profile's `ref` names."""
    if flag is not None:
        if flag in ("auto", "none", "prompt-lookup"):
            return flag, None
        if flag.startswith(LOOKUP_PLUS):
            return "prompt-lookup+ngram", flag[len(LOOKUP_PLUS):]
        return "ngram", flag
    return (ref.kind, ref.path) if ref is not None else ("none", None)


def load_draft2(flag: str | None, ref: Draft2Ref | None, vocab_size: int, fitted: Path | None = None):
    """The second stage: --draft2 (auto, none, prompt-lookup, an n-gram file, or prompt-lookup+FILE: lookup
    where the text repeats, the n-gram elsewhere) wins over the profile's. auto: prompt-lookup+ the `fitted`
    trigram (`spec_cli.draft2.trigrams.ready`) when there is one, else prompt lookup."""
    kind, path = draft2_kind(flag, ref)
    if kind == "none":
        return None
    if kind == "auto":
        if fitted is None:
            return PromptLookup()
        kind, path = "prompt-lookup+ngram", str(fitted)
    if kind == "prompt-lookup":
        return PromptLookup()
    if not path:
        raise SpecError(f"draft2 kind '{kind}' needs a path to an n-gram file (fit one with `spec fit-draft2`)")
    if not Path(path).is_file():
        raise SpecError(f"n-gram file not found: {path} (fit one with `spec fit-draft2`)")
    model = KatzTrigram.load(path)
    if model.vocab_size > vocab_size:
        raise SpecError(f"{path}: fitted for a vocabulary of {model.vocab_size}, the oracle has {vocab_size}")
    return LookupOrTrigram(model) if kind == "prompt-lookup+ngram" else model


def _eos_ids(loaded: Loaded) -> set[int]:
    ids = set()
    for source in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return ids
