"""Which device and dtype a run uses, decided in one place, and explicit synchronisation for timers."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

from spec_cli.core.errors import SpecError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError:
            raise SpecError(f"unknown device '{name}' (try auto, cpu, cuda, cuda:1, mps)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SpecError(f"device '{name}' asked for, but CUDA is not available here")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise SpecError("device 'mps' asked for, but MPS is not available here")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@lru_cache(maxsize=None)
def cpu_info(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo ("model name", "flags"); None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name; where it names no generation (a VM's "AMD EPYC"), its family and model too."""
    name = cpu_info("model name") or platform.processor() or platform.machine()
    family, model = cpu_info("cpu family"), cpu_info("model")
    if family and model and not any(ch.isdigit() for ch in name):
        return f"{name} (family {family} model {model})"
    return name


def cpu_flags() -> set[str]:
    return set((cpu_info("flags") or "").split())


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX-512 BF16: on such CPUs bfloat16 matmuls are fast, and multi-token forwards are ~free."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def alive(pid: int) -> bool:
    """Whether process `pid` runs (one that owns a folder or lock in the cache dir)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pick_dtype(name: str, device: torch.device, own_kernels: bool = False) -> torch.dtype:
    """`name` as a dtype; "auto": bfloat16 on GPUs that have it and on CPUs with AMX or AVX-512 BF16, and on any
    CPU where the model's products run on spec's kernels (`own_kernels`: its integer ones take bfloat16
    activations, its bfloat16 one half float32's bytes, and the operations between them run on spec's kernels in
    bfloat16 only), else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() or own_kernels else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a timer reads the clock after this, never after an accidental sync."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
