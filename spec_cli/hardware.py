"""Which device and dtype a run uses, decided in one place, and explicit synchronisation for timers."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

import torch

from spec_cli.errors import SpecError

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


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX-512 BF16: on such CPUs bfloat16 matmuls are fast, and multi-token forwards are ~free."""
    if platform.system() != "Linux":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a timer reads the clock after this, never after an accidental sync."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
