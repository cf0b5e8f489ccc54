"""The decoding flags, declared once: generate, chat and serve make their options from this table.

A new setting in `Decoding` gets its flag here, one line: generate takes every flag, serve all but those it
leaves out, and each gets the values given as one `Given`, whose `settings` go to `Decoding.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import typer

from spec_cli.core.settings import Decoding


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    type: type
    help: str


FLAGS = {  # in --help's order; the keys are Decoding's fields but for draft2 and the skip lists
    "method": Flag(("--method", "-m"), str, "baseline, speculative, staged or self (the oracle drafts for itself "
                                            "by skipping layers)."),
    "max_new_tokens": Flag(("--max-new-tokens", "-n"), int, "Stop after this many tokens."),
    "temperature": Flag(("--temperature", "-t"), float, "0 is greedy."),
    "top_k": Flag(("--top-k",), int, "Sample from the k most likely tokens (0: off)."),
    "top_p": Flag(("--top-p",), float, "Nucleus sampling mass (1: off)."),
    "seed": Flag(("--seed",), int, "Seed for sampling."),
    "sampling": Flag(("--sampling",), str, "coupled: every method samples the oracle alone's text for a seed "
                                           "(default); rejection: the speculative-sampling rules (each method "
                                           "its own draw)."),
    "draft_tokens": Flag(("--draft-tokens", "-k"), int, "Draft tokens per oracle forward (speculative)."),
    "tree_budget": Flag(("--tree-budget",), int, "Tree nodes the oracle scores per forward (staged)."),
    "tree_depth": Flag(("--tree-depth",), int, "Deepest level of the tree (staged)."),
    "tree_branching": Flag(("--tree-branching",), int, "Children offered per tree node (staged)."),
    "tree_width": Flag(("--tree-width",), int, "Nodes the draft expands per forward (staged)."),
    "draft2": Flag(("--draft2",), str, "Second stage: auto (prompt lookup, plus the draft's trigram once fitted "
                                       "in the background), none, prompt-lookup, an n-gram .npz file, or "
                                       "prompt-lookup+FILE.npz."),
    "draft2_tokens": Flag(("--draft2-tokens",), int, "Most tokens draft2 guesses below a node (staged)."),
    "tree_rule": Flag(("--tree-rule",), str, "Sampling: sequoia, specinfer or one-hot siblings (staged)."),
    "tree_mass": Flag(("--tree-mass",), float, "Siblings cover this much of the draft's probability (staged)."),
    "tree_adaptive": Flag(("--tree-adaptive/--fixed-tree",), bool, "Size the speculation by measured speed "
                                                                   "(staged; default) or use the tree settings "
                                                                   "as they are."),
    "lookup": Flag(("--lookup/--no-lookup",), bool, "Guesses copied from the text go to the oracle when the "
                                                    "draft does not run, or there is none (staged; default)."),
    "skip_attention": Flag(("--skip-attention",), str, "Self-draft: attention sublayers to skip, e.g. 3,5,7."),
    "skip_mlp": Flag(("--skip-mlp",), str, "Self-draft: MLP sublayers to skip, e.g. 4,6."),
    "self_threshold": Flag(("--self-threshold",), float, "Self-draft: stop drafting under this confidence "
                                                         "(adapts as it runs)."),
    "logprobs": Flag(("--logprobs",), int, "With --json: each token's log-probability under the oracle, and "
                                           "this many likeliest tokens' (0-20)."),
}
SETTINGS = {f.name for f in dataclasses.fields(Decoding)}


def option(name: str, help: str | None = None):
    """The typer option of flag `name` (None when not given), with the table's help unless `help` rewords it."""
    flag = FLAGS[name]
    return typer.Option(None, *flag.names, help=help or flag.help)


@dataclass(frozen=True)
class Group:
    """A command's decoding flags, standing as a parameter's default until `expand` puts the flags there."""

    names: tuple[str, ...]
    helps: dict[str, str]


def group(*names: str, without: tuple[str, ...] = (), **helps: str) -> Group:
    """The flags named (every flag when none is) but those `without`; `helps` rewords some for the command."""
    return Group(tuple(name for name in names or FLAGS if name not in without), helps)


@dataclass(frozen=True)
class Given:
    """The decoding flags a command was given: the Decoding settings, and the flags that are not settings."""

    settings: dict[str, Any]
    draft2: str | None = None
    skip_attention: str | None = None
    skip_mlp: str | None = None


def expand(command):
    """The typer command with its Group parameter turned into that group's flags (in its place in --help);
    the command gets their values in that parameter as a Given."""
    signature = inspect.signature(command, eval_str=True)
    name, chosen = next((p.name, p.default) for p in signature.parameters.values() if isinstance(p.default, Group))
    params = []
    for param in signature.parameters.values():
        if param.name == name:
            params += [_parameter(flag, chosen.helps.get(flag)) for flag in chosen.names]
        else:
            params.append(param)

    @functools.wraps(command)
    def run(**values):
        given = {flag: values.pop(flag) for flag in chosen.names}
        settings = {key: value for key, value in given.items() if key in SETTINGS and value is not None}
        values[name] = Given(settings, **{key: value for key, value in given.items() if key not in SETTINGS})
        return command(**values)

    run.__signature__ = signature.replace(parameters=params)
    run.__annotations__ = {p.name: p.annotation for p in params}  # typer reads both
    return run


def _parameter(name: str, help: str | None) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option(name, help),
                             annotation=Optional[FLAGS[name].type])
