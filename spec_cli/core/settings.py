"""The settings a completion is decoded with, and what a profile names: models, draft2, a self-draft. Plain
values, checked when made; `spec_cli.models.profiles` reads them from TOML files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from spec_cli.core.errors import SpecError

METHODS = ("baseline", "speculative", "staged", "self")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE = ("auto", "none", "int8", "int4")
DRAFT2_KINDS = ("auto", "none", "ngram", "prompt-lookup", "prompt-lookup+ngram")
TREE_RULES = ("one-hot", "sequoia", "specinfer")
SAMPLINGS = ("coupled", "rejection")
MAX_LOGPROBS = 20  # likeliest tokens a completion may ask about at each output token (as OpenAI's API)


@dataclass(frozen=True)
class ModelRef:
    model: str
    revision: str | None = None
    dtype: str | None = None
    gguf_file: str | None = None  # a GGUF file in the `model` repository or folder
    quantize: str | None = None  # this model's projections: auto (as stored), none, int8, int4 (else the profile's)


@dataclass(frozen=True)
class Draft2Ref:
    kind: str = "ngram"
    path: str | None = None


DEFAULT_DRAFT2 = Draft2Ref("auto")  # prompt lookup, plus the draft's trigram once fitted (spec_cli/trigrams.py)


@dataclass(frozen=True)
class SelfDraft:
    """The oracle as its own draft (Draft & Verify): these sublayers (0-based layer indices) are skipped."""

    skip_attention: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decoding:
    method: str = "staged"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    sampling: str = "coupled"
    draft_tokens: int = 4
    tree_budget: int = 16
    tree_depth: int = 8
    tree_branching: int = 4
    tree_width: int = 3
    draft2_tokens: int = 6
    tree_rule: str = "sequoia"
    tree_mass: float = 0.9
    tree_adaptive: bool = True
    lookup: bool = True  # staged: guesses copied from the text go to the oracle when the draft does not run
    self_threshold: float = 0.8
    self_adaptive: bool = True
    logprobs: int | None = None  # each output token's log-probability, and that many likeliest tokens' (None: off)

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"method must be one of {', '.join(METHODS)}"),
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0 (0 means greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 means off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.draft_tokens >= 1, "draft_tokens must be at least 1"),
            (self.tree_budget >= 1, "tree_budget must be at least 1"),
            (self.tree_depth >= 1, "tree_depth must be at least 1"),
            (self.tree_branching >= 1, "tree_branching must be at least 1"),
            (self.tree_width >= 1, "tree_width must be at least 1"),
            (self.draft2_tokens >= 1, "draft2_tokens must be at least 1"),
            (self.sampling in SAMPLINGS, f"sampling must be one of {', '.join(SAMPLINGS)}"),
            (self.tree_rule in TREE_RULES, f"tree_rule must be one of {', '.join(TREE_RULES)}"),
            (0 < self.tree_mass <= 1, "tree_mass must be in (0, 1]"),
            (0 <= self.self_threshold <= 1, "self_threshold must be in [0, 1]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SpecError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        """Sampling where every method draws the oracle alone's text for a seed (`spec_cli.decoding.coupling`)."""
        return self.sampling == "coupled" and not self.greedy

    def replace(self, **overrides: Any) -> "Decoding":
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    oracle: ModelRef
    draft: ModelRef | None = None
    draft2: Draft2Ref | None = DEFAULT_DRAFT2
    description: str = ""
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "auto"  # the models' projections: auto (as stored; a GGUF file at its own), none, int8, int4
    compile: str = "auto"  # auto (on for CUDA), on, off: each token bucket's forward as one compiled graph
    max_memory: tuple[tuple[str, int], ...] = ()  # the oracle's (device, bytes) in order, the rest on disk; () whole
    decoding: Decoding = field(default_factory=Decoding)
    self_draft: SelfDraft | None = None
    chat_template: str | None = None  # "plain" (a User:/Assistant: transcript) or a Jinja chat template
    explicit: frozenset[str] = frozenset()  # [decoding] keys (and draft2) the file states: they win over tuning
    tuned: str | None = None  # the machine whose `spec tune` results were applied
    selector: tuple[str, ...] = ()  # the command-line options that chose it, as typed (for hints)
