"""Models bigger than memory: `--max-memory DEVICE=SIZE,...` fills the devices in order (GPUs, then the CPU),
and what is left stays on disk, read again at every forward (accelerate's offloading, as Hugging Face's
`device_map` does). Here: the option parsed, the device map planned, and what a runner needs to know about a
model spread that way (where it computes, where its layers are)."""

from __future__ import annotations

import atexit
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.core.errors import SpecError
from spec_cli.core.hardware import alive

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")
EXAMPLE = "e.g. cpu=30MiB or cuda=20GiB,cpu=48GiB"

MaxMemory = tuple[tuple[str, int], ...]  # (device, bytes) in the order given; () is no limit


def parse_size(text: str, where: str = "--max-memory") -> int:
    """Bytes in '30MiB', '1.5GB', '4096' (binary units KiB..TiB, decimal KB..TB)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if unit not in UNITS:
        example = EXAMPLE if "memory" in where else "e.g. 512MiB or 1.5GB"
        raise SpecError(f"{where}: '{text}' is not a size ({example}; units B, KB, MB, GB, KiB, MiB, GiB)")
    return int(float(found.group(1)) * UNITS[unit])


def device_name(text: str, where: str = "--max-memory") -> str:
    name = text.strip().lower()
    if name == "disk":
        raise SpecError(f"{where}: disk takes no size: what the devices named do not hold goes to disk")
    if not DEVICE.fullmatch(name):
        raise SpecError(f"{where}: unknown device '{text.strip()}' (cpu, cuda, cuda:N or mps; {EXAMPLE})")
    return "cuda:0" if name == "cuda" else name


def parse(text: str | None) -> MaxMemory | None:
    """--max-memory DEVICE=SIZE[,DEVICE=SIZE...] ('none': no limit, over a profile's); None when not given."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    pairs = []
    for part in text.split(","):
        device, equals, size = part.partition("=")
        if not equals:
            raise SpecError(f"--max-memory takes DEVICE=SIZE pairs separated by commas ({EXAMPLE}), not '{text}'")
        pairs.append((device_name(device), parse_size(size)))
    return checked(pairs, "--max-memory")


def from_table(table: dict) -> MaxMemory:
    """A profile's `max_memory = { cuda = "20GiB", cpu = "48GiB" }` (sizes as strings or bytes)."""
    pairs = []
    for device, size in table.items():
        if isinstance(size, bool) or not isinstance(size, (str, int)):
            raise SpecError(f"max_memory: sizes are strings like \"30MiB\" or bytes, not {size!r}")
        pairs.append((device_name(device, "max_memory"), size if isinstance(size, int) else
                       parse_size(size, "max_memory")))
    return checked(pairs, "max_memory")


def checked(pairs: list[tuple[str, int]], where: str) -> MaxMemory:
    devices = [device for device, _ in pairs]
    twice = next((d for d in devices if devices.count(d) > 1), None)
    if twice:
        raise SpecError(f"{where}: {twice} is given twice")
    if not pairs:
        raise SpecError(f"{where}: name at least one device ({EXAMPLE})")
    return tuple(pairs)


def text(limits: MaxMemory) -> str:
    return ",".join(f"{device}={size_text(size)}" for device, size in limits)


def size_text(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def for_accelerate(limits: MaxMemory) -> dict:
    """As accelerate's max_memory: GPU indices as ints."""
    return {int(device.split(":")[1]) if device.startswith("cuda") else device: size for device, size in limits}


def device_for(device: str, limits: MaxMemory | None) -> str:
    """The device a model limited by `limits` computes on: with device auto, the first GPU named, else the
    CPU (accelerate runs offloaded layers on the first GPU in the map); a device the limits leave out is refused."""
    if not limits:
        return device
    gpus = [d for d, _ in limits if d != "cpu"]
    if device == "auto":
        return gpus[0] if gpus else "cpu"
    wanted = "cuda:0" if device == "cuda" else device
    if (gpus[0] if gpus else "cpu") != wanted:
        first = gpus[0] if gpus else "cpu"
        raise SpecError(f"--max-memory ({text(limits)}) runs the oracle on {first}, but the device is {device}: "
                        f"name {device}=SIZE first, or leave --device out")
    return device


def folder(model: str) -> Path:
    """Where this process offloads weights that must be written (a checkpoint that is not safetensors); removed
    at exit, and what dead processes left is removed now."""
    from spec_cli.core.paths import cache_dir

    root = cache_dir() / "offload"
    for stale in root.glob("*-pid*"):
        pid = stale.name.rpartition("-pid")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(Path(model).parts[-2:])).strip("-") or "model"
    path = root / f"{slug}-pid{os.getpid()}"
    atexit.register(shutil.rmtree, path, True)
    return path


@dataclass
class Placement:
    device_map: dict[str, str | int]  # module name -> GPU index, 'cpu', 'mps' or 'disk'
    bytes: dict[str, int]  # place -> bytes of weights there

    @property
    def disk(self) -> int:
        return self.bytes.get("disk", 0)


def place(config, dtype: torch.dtype, limits: MaxMemory) -> Placement:
    """Accelerate's device map for a model of `config` in `dtype` under `limits`: the devices filled in order,
    the rest 'disk' (a decoder layer is never split)."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
    empty.tie_weights()
    device_map = infer_auto_device_map(empty, max_memory=for_accelerate(limits), dtype=dtype,
                                       no_split_module_classes=list(empty._no_split_modules or ()))
    sizes = compute_module_sizes(empty, dtype=dtype)
    places = Counter()
    for name, device in device_map.items():
        places[_place({name: device}, name)] += sizes.get(name, 0)
    return Placement(device_map, dict(places))


def check_disk(planned: Placement, folder: Path, name: str, dtype: torch.dtype, limits: MaxMemory) -> None:
    """A model whose offloaded part does not fit on the disk where it would be written: one line saying what
    it needs."""
    place = folder
    while not place.exists():
        place = place.parent
    free = shutil.disk_usage(place).free
    if planned.disk > free:
        memory = sum(size for where, size in planned.bytes.items() if where != "disk")
        raise SpecError(f"{name} fits nowhere: it needs {size_text(memory + planned.disk)} in "
                        f"{str(dtype).removeprefix('torch.')}, {size_text(memory)} within --max-memory "
                        f"{text(limits)} and {size_text(planned.disk)} on disk under {folder.parent}, which has "
                        f"{size_text(free)} free: allow more memory, or free disk space")


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether accelerate spread the model over devices or onto disk."""
    return len(set(getattr(model, "hf_device_map", {}).values())) > 1 or "disk" in _devices(model)


def _devices(model) -> set:
    return set(getattr(model, "hf_device_map", {}).values())


def placement(model: torch.nn.Module) -> dict[str, int] | None:
    """Decoder layers per place ('cuda:0', 'cpu', 'disk'), in the order filled; None when the model is whole on
    one device."""
    if not is_offloaded(model):
        return None
    from spec_cli.core.families import num_layers

    device_map = model.hf_device_map
    count = num_layers(model.config)
    names = next((name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count),
                 None)
    if names is None:
        return None
    places = Counter(_place(device_map, f"{names}.{i}") for i in range(count))
    order = ["cuda:" + str(i) for i in range(16)] + ["mps", "cpu", "disk"]
    return {place: places[place] for place in sorted(places, key=lambda p: order.index(p) if p in order else 99)}


def _place(device_map: dict, name: str) -> str:
    """Where module `name` lives: the entry of the device map that holds it (or the first inside it)."""
    holders = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
    inside = [key for key in device_map if key.startswith(name + ".")]
    device = device_map[max(holders, key=len)] if holders else device_map[inside[0]]
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def execution_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes: its embedding's execution device when accelerate spread it (an offloaded
    parameter's own device is `meta`), else its parameters' device."""
    hook = getattr(model.get_input_embeddings(), "_hf_hook", None) if hasattr(model, "hf_device_map") else None
    device = getattr(hook, "execution_device", None)
    if device is None:
        return next(model.parameters()).device
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def drop_idle_hooks(model: torch.nn.Module) -> None:
    """Where every layer computes on one device, the hooks of the modules whose weights stay there only move
    inputs that are already there: removed, so those modules run (and pack) as a model in memory does. The
    hooks that bring offloaded weights in and out stay."""
    from accelerate.hooks import AlignDevicesHook, remove_hook_from_module

    hooks = [(m, m._hf_hook) for m in model.modules() if getattr(m, "_hf_hook", None) is not None]
    if len({str(getattr(h, "execution_device", None)) for _, h in hooks}) > 1:
        return
    for module, hook in hooks:
        if isinstance(hook, AlignDevicesHook) and not hook.offload:
            remove_hook_from_module(module)


def spans_devices(model: torch.nn.Module) -> bool:
    """Whether the model's layers compute on more than one device (several GPUs)."""
    devices = {str(getattr(m._hf_hook, "execution_device", None)) for m in model.modules()
               if getattr(m, "_hf_hook", None) is not None}
    return len(devices) > 1


def summary(model: torch.nn.Module) -> dict:
    """What the statistics say of an offloaded model: its decoder layers per place, and its weights' bytes
    (offloaded parameters are `meta`, all at one address)."""
    places = placement(model)
    if places is None:
        return {}
    sizes = {name: p.numel() * p.element_size() for name, p in model.state_dict(keep_vars=True).items()
             if name not in _tied(model)}
    return {"placement": places, "bytes": sum(sizes.values())}


def _tied(model) -> set:
    return set(getattr(model, "all_tied_weights_keys", None) or {})


def uncompiled(model: torch.nn.Module, compile, asked: bool):
    """Compiled steps are not for offloaded models (accelerate's hooks move weights in Python at every call):
    off when on by default, one line when asked for."""
    if not compile or not is_offloaded(model):
        return compile
    if asked:
        raise SpecError("--compile: an offloaded oracle (--max-memory) runs eagerly; leave --compile out")
    return False
