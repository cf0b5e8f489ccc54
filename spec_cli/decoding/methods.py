"""The decoding methods by name, and `decode`: the events of one completion with the method a setting names."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from spec_cli.core.errors import SpecError
from spec_cli.core.events import Event, Finished, Started
from spec_cli.core.settings import Decoding
from spec_cli.decoding import chain as decoding
from spec_cli.decoding import foreign, selfspec
from spec_cli.decoding import staged as tree
from spec_cli.decoding.chain import Models, Output
from spec_cli.decoding.coupling import Coupled, Noise
from spec_cli.decoding.sampling import Draws, make_generator

NEEDS_DRAFT = ("speculative",)  # staged runs without a draft: the lookup's guesses, copied from the text
DRAFTED = ("speculative", "staged")  # the methods that use the profile's draft when it names one


# Each method's generator function: (models, out, settings, draws) -> events.
STRATEGIES = {"baseline": decoding.baseline, "speculative": decoding.speculative, "staged": tree.staged,
              "self": selfspec.self_speculative}


def coupled(models: Models, settings: Decoding, base: int) -> Models:
    """The models whose forwards give coupled scores, when the settings sample coupled; else the models."""
    if not settings.coupled:
        return models
    noise = Noise(decoding.sampler_of(settings), make_generator(settings.seed, models.oracle.device),
                  models.oracle.vocab_size, models.oracle.device, base)
    foreign_draft = models.translator is not None  # (its guesses are its argmaxes: scored in its own words)
    return dataclasses.replace(models, oracle=Coupled(models.oracle, noise),
                               draft=models.draft if foreign_draft else models.draft and Coupled(models.draft, noise))


def decode(models: Models, prompt: list[int], settings: Decoding, reuse: bool = False,
           draws: Draws | None = None) -> Iterator[Event]:
    """The events of one completion of `prompt` (token ids) with the method in `settings`.

    With `reuse`, each model keeps the cached prefix it shares with `prompt` (a chat's earlier turns)
    and runs only the rest; otherwise every completion starts from an empty cache. Its random choices come
    from `draws` (by default seeded with `settings.seed` on the oracle's device).
    """
    if not prompt:
        raise ValueError("empty prompt")
    if settings.method == "self" and models.self_skip is None:
        raise SpecError("method 'self' needs a skip set ([self_draft] in the profile, or run `spec tune`)")
    if settings.method in NEEDS_DRAFT and models.draft is None:
        raise SpecError(f"method '{settings.method}' needs a draft model; the profile names none")
    if settings.method == "staged" and models.draft is None and not settings.lookup:
        raise SpecError("method 'staged' with no draft model guesses by lookup, which --no-lookup turns off")
    foreign_draft = models.translator is not None and settings.method in DRAFTED
    if foreign_draft and settings.method != "speculative":
        raise SpecError(f"method '{settings.method}' needs a draft of the oracle's vocabulary; this one speaks "
                        f"another (method 'speculative' translates its guesses)")
    out = Output(list(prompt), settings.max_new_tokens, models.eos, logprobs=settings.logprobs)
    for runner in (models.oracle, models.draft):
        if runner is not None and not (runner is models.draft and foreign_draft and reuse):
            runner.reuse(prompt) if reuse else runner.reset()  # (a foreign draft reuses its own words)
    if models.draft is not None and models.draft is not models.oracle and not foreign_draft:
        models.draft.window(prompt, decoding.DRAFT_READS)
    yield Started(len(prompt), min(models.oracle.committed, len(prompt)))
    try:
        draws = draws or Draws.seeded(settings.seed, models.oracle.device)
        strategy = foreign.speculative if foreign_draft else STRATEGIES[settings.method]
        yield from strategy(coupled(models, settings, len(prompt)), out, settings, draws)
    finally:
        for runner in (models.oracle, None if foreign_draft else models.draft):
            if runner is not None:
                runner.name(out.sequence)
    yield Finished(out.reason or "context")
