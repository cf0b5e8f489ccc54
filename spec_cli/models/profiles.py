"""Profiles: TOML files naming the oracle, the draft models and the decoding settings.

Built-ins ship in `profiles/`; a user's own live in `<config dir>/profiles/*.toml` and override built-ins
of the same name; `--profile` also takes a path to a .toml file. A profile may `extends = "other"` and then
only states what differs. Relative model paths resolve against the profile file's folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import sys
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

import platformdirs

from spec_cli.core.errors import SpecError
from spec_cli.core.settings import (  # noqa: F401
    DEFAULT_DRAFT2,
    DRAFT2_KINDS,
    DTYPES,
    METHODS,
    QUANTIZE,
    SAMPLINGS,
    TREE_RULES,
    Decoding,
    Draft2Ref,
    ModelRef,
    Profile,
    SelfDraft,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

def config_dir() -> Path:
    return Path(platformdirs.user_config_dir("spec")) / "profiles"


def builtin_dir() -> Path:
    checkout = Path(__file__).resolve().parents[2] / "profiles"
    if checkout.is_dir():
        return checkout
    return Path(str(resources.files("spec_cli.profiles")))


def available() -> dict[str, Path]:
    """Every named profile, user ones overriding built-ins of the same name."""
    found: dict[str, Path] = {}
    for folder in (builtin_dir(), config_dir()):
        if folder.is_dir():
            for path in sorted(folder.glob("*.toml")):
                found[path.stem] = path
    return found


def origin(path: Path) -> str:
    return "built-in" if path.parent.resolve() == builtin_dir().resolve() else "user"


def load(name_or_path: str) -> Profile:
    """A profile by name (user, then built-in) or by the path of a .toml file."""
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise SpecError(f"profile file not found: {name_or_path}")
        return dataclasses.replace(_load_file(path.resolve(), seen=()), selector=("--profile", name_or_path))
    profiles = available()
    if name_or_path not in profiles:
        hint = difflib.get_close_matches(name_or_path, profiles, n=1)
        names = ", ".join(sorted(profiles)) or "none"
        suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise SpecError(f"no profile named '{name_or_path}'{suggestion}; known profiles: {names}")
    return dataclasses.replace(_load_file(profiles[name_or_path], seen=()), selector=("--profile", name_or_path))


def select(name_or_path: str | None, oracle: str | None = None, draft: str | None = None,
           default: str = "gpt2l") -> Profile:
    """The profile the command line chooses: --profile NAME|PATH, or --oracle MODEL [--draft MODEL] (alone
    or over a profile's settings)."""
    if oracle is None and draft is None:
        return load(name_or_path or default)
    if oracle is None and name_or_path is None:
        raise SpecError("--draft needs --oracle MODEL (or a --profile whose oracle it drafts for)")
    base = load(name_or_path) if name_or_path else Profile(name="", source="", oracle=ModelRef(""))
    oracle_ref = ModelRef(_command_line_model(oracle)) if oracle else base.oracle
    draft_ref = base.draft if draft is None else None if draft == "none" else ModelRef(_command_line_model(draft))
    name = _command_line_name(oracle_ref, draft_ref)
    selector = base.selector + (("--oracle", oracle) if oracle else ()) + (("--draft", draft) if draft else ())
    return dataclasses.replace(base, name=name, source=base.source or "the command line", oracle=oracle_ref,
                               draft=draft_ref, selector=selector)


def profile_args(profile: Profile, durable: bool = False) -> str:
    """The options that choose `profile` on a command line: as typed, or (`durable`) with absolute paths,
    to work from any folder later."""
    args = list(profile.selector) or ["--profile", profile.name]
    if durable:
        for i in range(1, len(args)):
            if args[i - 1] == "--profile" and (args[i].endswith(".toml") or Path(args[i]).is_file()):
                args[i] = str(Path(args[i]).expanduser().resolve())
            elif args[i - 1] in ("--oracle", "--draft"):
                args[i] = _command_line_model(args[i])
    return shlex.join(args)


def parse_profile_args(text: str) -> tuple[str | None, str | None, str | None]:
    """(profile, oracle, draft) from options written by profile_args."""
    found: dict[str, str] = {}
    args = shlex.split(text)
    for flag, value in zip(args[::2], args[1::2]):
        found[flag] = value
    return found.get("--profile"), found.get("--oracle"), found.get("--draft")


def _command_line_model(text: str) -> str:
    """A model named on the command line: a folder (made absolute) or a hub id."""
    path = Path(text).expanduser()
    if text != "self" and (text.startswith((".", "/", "~")) or path.exists() or text.lower().endswith(".gguf")):
        return str(path.resolve())
    return text


def former_names(profile: Profile) -> list[str]:
    """What a profile chosen by --oracle/--draft was named before (a GGUF file with its folder and `.gguf`), where
    that differs: `spec tune` saved its findings under that name."""
    if profile.name != _command_line_name(profile.oracle, profile.draft):
        return []
    former = _command_line_name(profile.oracle, profile.draft, former=True)
    return [former] if former != profile.name else []


def _command_line_name(oracle: ModelRef, draft: ModelRef | None, former: bool = False) -> str:
    return _slug(oracle.model, former) + (f"+{_slug(draft.model, former)}" if draft else "")


def _slug(model: str, former: bool = False) -> str:
    """A model's part of a profile's name: a GGUF file's name without `.gguf`, else a path's or hub id's last two
    parts (`pyfam-oracle`, `Qwen-Qwen2.5-Coder-1.5B`)."""
    parts = [p for p in Path(model).parts if p not in ("/", "")]
    if parts and not former and parts[-1].lower().endswith(".gguf"):
        parts = [parts[-1][: -len(".gguf")]]
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", "-".join(parts[-2:])).strip("-") or "model"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: malformed TOML: {e}") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None


def _raw(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The file's table with `extends` resolved, model paths made absolute."""
    if path in seen:
        raise SpecError(f"{path}: 'extends' forms a cycle")
    data = _read_toml(path)
    for key in ("oracle", "draft"):
        if key in data:
            data[key] = _absolute_model(data[key], path)
    if "draft2" in data and isinstance(data["draft2"], dict) and isinstance(data["draft2"].get("path"), str):
        data["draft2"]["path"] = str((path.parent / Path(data["draft2"]["path"]).expanduser()).resolve())
    base_name = data.pop("extends", None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise SpecError(_where(path, "extends") + "'extends' must be a profile name or path")
    base_path = (path.parent / base_name) if base_name.endswith(".toml") else available().get(base_name)
    if base_path is None or not base_path.is_file():
        raise SpecError(_where(path, "extends") + f"'extends' names an unknown profile '{base_name}'")
    merged = _raw(base_path.resolve(), seen + (path,))
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _absolute_model(value: Any, path: Path) -> Any:
    def fix(model: Any) -> Any:
        if not isinstance(model, str) or model == "self":
            return model
        local = path.parent / Path(model).expanduser()
        looks_like_path = model.startswith((".", "/", "~")) or local.exists() or model.lower().endswith(".gguf")
        return str(local.resolve()) if looks_like_path else model

    if isinstance(value, dict) and "model" in value:
        return {**value, "model": fix(value["model"])}
    return fix(value)


def _load_file(path: Path, seen: tuple[Path, ...]) -> Profile:
    data = _raw(path, seen)
    known = {f.name for f in fields(Profile)} - {"name", "source", "explicit", "tuned"}
    _check_keys(path, data, known, table=None)
    if "oracle" not in data:
        raise SpecError(f"{path}: the profile names no oracle (add: oracle = \"<hub id or folder>\")")
    decoding_table = data.get("decoding", {})
    if not isinstance(decoding_table, dict):
        raise SpecError(_where(path, "decoding") + "[decoding] must be a table")
    _check_keys(path, decoding_table, {f.name for f in fields(Decoding)}, table="decoding")
    try:
        decoding = Decoding(**_typed(path, Decoding, decoding_table, "decoding"))
        return Profile(
            name=path.stem,
            source=str(path),
            oracle=_model_ref(path, "oracle", data["oracle"]),
            draft=_model_ref(path, "draft", data["draft"]) if "draft" in data else None,
            draft2=_draft2_ref(path, data["draft2"]) if "draft2" in data else DEFAULT_DRAFT2,
            description=_expect(path, "description", data.get("description", ""), str),
            device=_expect(path, "device", data.get("device", "auto"), str),
            dtype=_choice(path, "dtype", data.get("dtype", "auto"), DTYPES),
            quantize=_choice(path, "quantize", data.get("quantize", "auto"), QUANTIZE),
            compile=_compile_mode(path, data.get("compile", "auto")),
            max_memory=_max_memory(path, data["max_memory"]) if "max_memory" in data else (),
            decoding=decoding,
            self_draft=_self_draft(path, data["self_draft"]) if "self_draft" in data else None,
            chat_template=_expect(path, "chat_template", data["chat_template"], str) if "chat_template" in data else None,
            explicit=frozenset(decoding_table) | ({"draft2"} if "draft2" in data else set()),
        )
    except SpecError as e:
        message = str(e)
        raise SpecError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def _compile_mode(path: Path, value: Any) -> str:
    if value is True or value is False:
        return "on" if value else "off"
    if value != "auto":
        raise SpecError(f"{_where(path, 'compile')}compile must be true, false or \"auto\", not {value!r}")
    return value


def _max_memory(path: Path, value: Any) -> tuple[tuple[str, int], ...]:
    from spec_cli.exec import placement as offload

    where = _where(path, "max_memory")
    if not isinstance(value, (str, dict)):
        raise SpecError(where + "'max_memory' must be a table such as { cuda = \"20GiB\", cpu = \"48GiB\" }")
    try:
        return offload.parse(value) or () if isinstance(value, str) else offload.from_table(value)
    except SpecError as e:
        raise SpecError(where + str(e).replace("--max-memory", "max_memory", 1)) from None


def _model_ref(path: Path, key: str, value: Any) -> ModelRef:
    if isinstance(value, str):
        return ModelRef(model=value)
    if not isinstance(value, dict):
        raise SpecError(_where(path, key) + f"'{key}' must be a model id/path or a table with 'model'")
    _check_keys(path, value, {f.name for f in fields(ModelRef)}, table=key)
    if "model" not in value:
        raise SpecError(_where(path, key) + f"[{key}] needs 'model' (a hub id, a local folder or a .gguf file)")
    ref = ModelRef(**_typed(path, ModelRef, value, key))
    if ref.dtype is not None:
        _choice(path, "dtype", ref.dtype, DTYPES)
    if ref.quantize is not None:
        _choice(path, "quantize", ref.quantize, QUANTIZE)
    return ref


def _draft2_ref(path: Path, value: Any) -> Draft2Ref:
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise SpecError(_where(path, "draft2") + "'draft2' must be a kind or a table with 'kind'")
    _check_keys(path, value, {f.name for f in fields(Draft2Ref)}, table="draft2")
    ref = Draft2Ref(**_typed(path, Draft2Ref, value, "draft2"))
    _choice(path, "kind", ref.kind, DRAFT2_KINDS)
    return ref


def _self_draft(path: Path, value: Any) -> SelfDraft:
    if not isinstance(value, dict):
        raise SpecError(_where(path, "self_draft") + "[self_draft] must be a table with skip_attention and skip_mlp")
    _check_keys(path, value, {f.name for f in fields(SelfDraft)}, table="self_draft")
    lists = {}
    for key in ("skip_attention", "skip_mlp"):
        layers = value.get(key, [])
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in layers):
            raise SpecError(_where(path, key) + f"'{key}' in [self_draft] must be a list of layer numbers (from 0)")
        lists[key] = tuple(sorted(set(layers)))
    return SelfDraft(**lists)


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool}


def _typed(path: Path, cls: type, table: dict[str, Any], table_name: str) -> dict[str, Any]:
    out = {}
    for f in fields(cls):
        if f.name not in table:
            continue
        value = table[f.name]
        base = str(f.type).split("|")[0].strip()
        expected = _TYPES.get(base, object)
        if isinstance(value, bool) and base != "bool" or not isinstance(value, expected):
            raise SpecError(
                _where(path, f.name) + f"'{f.name}' in [{table_name}] must be {base}, not {type(value).__name__}"
            )
        out[f.name] = float(value) if base == "float" else value
    return out


def _expect(path: Path, key: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise SpecError(_where(path, key) + f"'{key}' must be {kind.__name__}, not {type(value).__name__}")
    return value


def _choice(path: Path, key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecError(_where(path, key) + f"'{key}' must be one of {', '.join(choices)}, not {value!r}")
    return value


def _check_keys(path: Path, data: dict[str, Any], known: set[str], table: str | None) -> None:
    for key in data:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
            place = f" in [{table}]" if table else ""
            raise SpecError(_where(path, key) + f"unknown key '{key}'{place}{suggestion}")


def _where(path: Path, key: str) -> str:
    """'file:line: ' for the first line that sets `key`, or 'file: '."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return f"{path}: "
    pattern = re.compile(rf"^\s*(\[\s*{re.escape(key)}\s*\]|{re.escape(key)}\s*=)")
    for number, line in enumerate(lines, 1):
        if pattern.match(line):
            return f"{path}:{number}: "
    return f"{path}: "
