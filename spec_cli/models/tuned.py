"""What `spec tune` found, per profile and machine, and how it joins a profile's settings.

Stored in `<data dir>/tuned/<profile>.json`, one entry per machine (device name and dtype), with what was
measured. Precedence, lowest first: built-in defaults < tuned < what the profile file states < flags.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import platformdirs

from spec_cli.core.errors import SpecError
from spec_cli.core.paths import write_whole
from spec_cli.core.settings import Decoding, Draft2Ref, Profile, SelfDraft

SHAPE_KEYS = ("method", "draft_tokens", "tree_budget", "tree_depth", "tree_branching", "tree_width",
              "draft2_tokens", "tree_rule", "tree_mass", "self_threshold")


def tuned_dir() -> Path:
    return Path(platformdirs.user_data_dir("spec")) / "tuned"


def record_path(profile: Profile) -> Path:
    """Where this profile's findings are: under its name, or a name it had before where they are still there."""
    from spec_cli.models import profiles

    path = tuned_dir() / f"{profile.name}.json"
    if not path.exists():
        for former in profiles.former_names(profile):
            if (tuned_dir() / f"{former}.json").exists():
                return tuned_dir() / f"{former}.json"
    return path


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from spec_cli.core.hardware import cpu_name

        return cpu_name()
    return device.type


def machine_key(device, dtype) -> str:
    name = re.sub(r"[^A-Za-z0-9.]+", "-", device_name(device)).strip("-")
    return f"{device.type}-{name}-{str(dtype).removeprefix('torch.')}"


def resolve_key(profile: Profile, device: str | None, dtype: str | None) -> str:
    """This machine's key for the profile's oracle: its device and dtype (a per-model dtype wins), apart for an
    oracle offloaded with max_memory (its forwards cost another curve)."""
    from spec_cli.core.hardware import pick_device
    from spec_cli.exec import placement as offload
    from spec_cli.models.loading import dtype_for

    dev = pick_device(offload.device_for(device or profile.device, profile.max_memory))
    key = machine_key(dev, dtype_for(profile.oracle, profile.oracle.dtype or dtype or profile.dtype, dev,
                                     profile.quantize))
    return key + "-offloaded" if profile.max_memory else key


def load_profile(name: str | Profile, device: str | None = None, dtype: str | None = None,
                 temperature: float | None = None, use_tuned: bool = True) -> Profile:
    """A profile with this machine's tuned settings for the decoding mode it will run in."""
    from spec_cli.models import profiles

    profile = profiles.load(name) if isinstance(name, str) else name
    if not use_tuned:
        return profile
    sampling = (temperature if temperature is not None else profile.decoding.temperature) > 0
    return apply(profile, resolve_key(profile, device, dtype), sampling)


def read(profile: Profile) -> dict:
    path = record_path(profile)
    if not path.is_file():
        return {"profile": profile.name, "machines": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        from spec_cli.models.profiles import profile_args

        raise SpecError(f"{path}: unreadable tuning record ({e}); delete it or run "
                        f"`spec tune {profile_args(profile)} --reset`") from None
    data.setdefault("machines", {})
    return data


def write(profile: Profile, data: dict) -> Path:
    return write_whole(record_path(profile), json.dumps(data, indent=2))  # never half a record, even on Ctrl-C


def entry(profile: Profile, key: str) -> dict:
    return read(profile)["machines"].get(key, {})


def update(profile: Profile, key: str, **parts) -> Path:
    data = read(profile)
    machine = data["machines"].setdefault(key, {})
    machine.update(parts)
    machine["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return write(profile, data)


def mode_of(settings: Decoding) -> str:
    return "greedy" if settings.greedy else "sampling"


def apply(profile: Profile, key: str, sampling: bool = False, record: dict | None = None) -> Profile:
    """The profile with this machine's tuned settings filling in whatever the profile file does not state."""
    machine = entry(profile, key) if record is None else record
    if not machine:
        return profile
    decoding = profile.decoding
    shape = (machine.get("sampling" if sampling else "greedy") or {}).get("settings", {})
    chosen = {k: v for k, v in shape.items() if k in SHAPE_KEYS and k not in profile.explicit}
    if chosen:
        decoding = dataclasses.replace(decoding, **chosen)
    self_draft = profile.self_draft
    skip = machine.get("self_draft")
    if self_draft is None and skip:
        self_draft = SelfDraft(tuple(skip["skip_attention"]), tuple(skip["skip_mlp"]))
    draft2 = profile.draft2
    kind = shape.get("draft2")
    if kind and "draft2" not in profile.explicit:
        fitted = (machine.get("draft2") or {}).get("path")
        if kind in ("ngram", "prompt-lookup+ngram") and fitted and Path(fitted).is_file():
            draft2 = Draft2Ref(kind, fitted)
        elif kind in ("none", "prompt-lookup"):
            draft2 = Draft2Ref(kind)
    return dataclasses.replace(profile, decoding=decoding, self_draft=self_draft, draft2=draft2, tuned=key)
