"""The models of a profile, loaded once, turning text prompts into decoding events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from spec_cli.decoding import Models, decode
from spec_cli.errors import SpecError
from spec_cli.events import Event
from spec_cli.loading import Loaded, check_vocabularies, load, pick_device, pick_dtype
from spec_cli.ngram import KatzTrigram, LookupOrTrigram, PromptLookup
from spec_cli.profiles import Decoding, Draft2Ref, Profile, SelfDraft
from spec_cli.runner import Runner, Skip, num_layers


class Engine:
    """Loads the oracle at once and the draft when a method first needs it (`need_draft` loads it now)."""

    def __init__(self, profile: Profile, device: str | None = None, dtype: str | None = None,
                 need_draft: bool = True, draft2: str | None = None, self_draft: SelfDraft | None = None):
        torch.set_grad_enabled(False)
        self.profile = profile
        self.device = pick_device(device or profile.device)
        self.dtype = pick_dtype(dtype or profile.dtype, self.device)
        self.oracle: Loaded = load(profile.oracle, self.device, self.dtype)
        self.tokenizer = self.oracle.tokenizer
        self.vocab_size = max(self.oracle.model.config.vocab_size, len(self.tokenizer))
        self.eos = frozenset(_eos_ids(self.oracle))
        chosen = self_draft or profile.self_draft
        layers = num_layers(self.oracle.model.config)
        self.self_skip = Skip.of(chosen.skip_attention, chosen.skip_mlp).check(layers) if chosen else None
        self.self_drafted = profile.draft is not None and profile.draft.model == "self"
        self.draft: Loaded | None = None
        self._draft2_flag = draft2
        self._draft2 = None
        self._runners: dict[str, Runner] = {}
        if need_draft:
            if self.profile.draft is not None and not self.self_drafted:
                self.load_draft()
            _ = self.draft2

    @property
    def has_draft(self) -> bool:
        return self.profile.draft is not None

    def load_draft(self) -> Loaded:
        """The separate draft model, loaded on first use."""
        if self.draft is None:
            if self.self_drafted or self.profile.draft is None:
                raise SpecError("this needs a separate draft model, and the profile names none")
            self.draft = load(self.profile.draft, self.device, self.dtype)
            check_vocabularies(self.oracle, self.draft)
        return self.draft

    @property
    def draft2(self):
        """The second stage staged runs use: --draft2 or the profile's, loaded once (None: none)."""
        if self._draft2 is None:
            self._draft2 = load_draft2(self._draft2_flag, self.profile.draft2, self.vocab_size) or False
        return self._draft2 or None

    @draft2.setter
    def draft2(self, drafter) -> None:
        """Use this drafter (None: none) instead, as the benchmark and tuning do per settings."""
        self._draft2 = drafter or False

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise SpecError("the prompt is empty and the tokenizer has no BOS token to start from")
            ids = [bos]
        return ids

    def _runner(self, name: str, model: torch.nn.Module, needed: int, skip: Skip | None = None) -> Runner:
        runner = self._runners.get(name)
        if runner is None or runner.capacity < min(needed, runner.context):
            capacity = -(-needed // 256) * 256
            runner = Runner(model, vocab_size=self.vocab_size, capacity=capacity, skip=skip or Skip())
            self._runners[name] = runner
        return runner

    def _need_skip(self, why: str) -> Skip:
        if self.self_skip is None:
            raise SpecError(f"{why} needs a skip set: add [self_draft] skip_attention = [...] and skip_mlp = "
                            f"[...] to the profile, or run `spec tune --profile {self.profile.name}`")
        return self.self_skip

    def events(self, prompt: list[int], settings: Decoding, reuse: bool = False) -> Iterator[Event]:
        """Decoding events for `prompt`; `reuse` keeps the cached prefix shared with the last call (chat)."""
        context = self.oracle.context
        if len(prompt) >= context:
            raise SpecError(
                f"the prompt is {len(prompt)} tokens, but the oracle's context window is {context} tokens "
                f"(it must leave room for at least one new token)"
            )
        needed = len(prompt) + settings.max_new_tokens + max(settings.draft_tokens, settings.tree_budget) + 2
        if reuse:
            needed = max(needed, min(context, 4096))
        models = Models(self._runner("oracle", self.oracle.model, needed), eos=self.eos)
        if settings.method == "self":
            models.self_skip = self._need_skip("method 'self'")
        elif settings.method in ("speculative", "staged"):
            if self.self_drafted:
                models.draft = self._runner("self-draft", self.oracle.model, needed, self._need_skip("draft = 'self'"))
            elif self.profile.draft is None:
                raise SpecError(f"method '{settings.method}' needs a draft model, and the profile names none "
                                f"(or use --method self)")
            else:
                models.draft = self._runner("draft", self.load_draft().model, needed)
            if settings.method == "staged":
                models.draft2 = self.draft2
        return decode(models, prompt, settings, reuse=reuse)


LOOKUP_PLUS = "prompt-lookup+"


def load_draft2(flag: str | None, ref: Draft2Ref | None, vocab_size: int):
    """The second stage: --draft2 (none, prompt-lookup, an n-gram file, or prompt-lookup+FILE: lookup where
    the text repeats, the n-gram elsewhere) wins over the profile's."""
    if flag is not None:
        if flag in ("none", "prompt-lookup"):
            kind, path = flag, None
        elif flag.startswith(LOOKUP_PLUS):
            kind, path = "prompt-lookup+ngram", flag[len(LOOKUP_PLUS):]
        else:
            kind, path = "ngram", flag
    elif ref is not None:
        kind, path = ref.kind, ref.path
    else:
        return None
    if kind == "none":
        return None
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
