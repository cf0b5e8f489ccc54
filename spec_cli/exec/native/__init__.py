"""spec's own CPU kernels, compiled on first use (torch's C++ extension loader, into the cache dir), or ahead by
`python -m spec_cli.exec.native`. Each file compiles alone (`kernels.h` says what each defines for the others);
the build puts them in one translation unit, as torch's headers are most of its time.

`int4`: int4 (and 8-bit: `mm8`, llama.cpp's Q8_0 and Q5; 6-bit: `mm6`, its Q6_K as it is) x bfloat16
products on AVX-512 VNNI, the activations quantized to int8 per group as llama.cpp does (`int4.cpp`), and the
operations between them in a Llama-family layer (`glue.cpp`: RMSNorm, rotary positions, SiLU times up,
attention), each one call; a whole layer as one call where all of it runs on these (`layer.cpp`); and bfloat16
weights x bfloat16 rows summed in float (`mm16`, `bf16.cpp`) where oneDNN has no bfloat16 (AVX2). torch's own
int4 kernel dequantizes every weight for every four rows in floating point; this one sums integer products,
several times faster for one row, and a row's bits do not depend on the rows beside it. Used where the CPU has
AVX-512 VNNI, or else AVX2 with FMA and F16C (the same sources behind `avx2.h`, which maps each AVX-512
intrinsic they use onto two AVX2 halves; no bfloat16 dot products there), and the build works (`SPEC_NATIVE=0`:
never); any failure falls back to torch's kernel, and `status()` says why. Built into `<cache dir>/native` (or
SPEC_NATIVE_DIR), per source, torch version and target.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import torch

from spec_cli.core.errors import described
from spec_cli.core.hardware import cpu_flags

HEADERS = [Path(__file__).with_name(name) for name in ("kernels.h", "simd.h", "avx2.h")]  # so that each file compiles alone
SOURCES = [Path(__file__).with_name(name) for name in ("int4.cpp", "bf16.cpp", "glue.cpp", "logits.cpp", "layer.cpp", "module.cpp")]
AVX2_FLAGS = ("avx2", "fma", "f16c")  # (the same sources on AVX2 through avx2.h, where the CPU lacks AVX-512)
FLAGS = (*AVX2_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # (bf16.cpp's AVX2 code is in both builds)
NAMES = {"avx512": "AVX-512 VNNI", "avx2": "AVX2"}  # each build as `status()` names it
_built: dict = {}


def wanted() -> bool:
    return os.environ.get("SPEC_NATIVE", "1") != "0"


def int4(say: Callable[[str], None] | None = None):
    """The compiled int4 module (its `mm(x, packed, scales_and_zeros)`), or None where it cannot run here;
    `say` hears of a first build (tens of seconds). It is also `torch.ops.spec.int4_mm`, which a compiled step
    traces (called directly it costs less: a custom op's dispatch adds to each of a forward's many calls)."""
    if "int4" not in _built:
        _built["int4"] = _build(say)
        if _built["int4"][0] is not None:
            _register(_built["int4"][0])
    return _built["int4"][0]


def loaded():
    """The compiled module if this process has loaded it already, else None: for callers that only save
    microseconds with it, which must never cost a first build."""
    built = _built.get("int4")
    return built[0] if built else None


def _register(module) -> None:
    for name, kernel in (("int4_mm", module.mm), ("int8_mm", module.mm8), ("int6_mm", module.mm6),
                         ("fp4_mm", module.mmfp4)):
        _op(name, kernel)

    @torch.library.custom_op("spec::bf16_mm", mutates_args=())
    def bf16_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return module.mm16(x, weight)

    @bf16_mm.register_fake
    def _(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])


def _op(name: str, kernel) -> None:
    """`kernel(x, packed, scales)` as the custom op `spec::<name>` (what a compiled step traces)."""
    @torch.library.custom_op(f"spec::{name}", mutates_args=())
    def op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return kernel(x, packed, scales)

    @op.register_fake
    def _(x, packed, scales):
        return x.new_empty(x.shape[0], scales.shape[1])


def status() -> str:
    int4()
    return _built["int4"][1]


def build_tag(target: str) -> str:
    """What names a build: its sources, torch's version and the target (a change to any is another build)."""
    text = b"".join(source.read_bytes() for source in [*HEADERS, *SOURCES])
    return hashlib.sha256(text + torch.__version__.encode() + target.encode()).hexdigest()[:12]


def builds() -> Path:
    """The folder of the kernels' builds (SPEC_NATIVE_DIR, else the cache dir's native/), one `int4-TAG` each."""
    from spec_cli.core.paths import cache_dir

    return Path(os.environ.get("SPEC_NATIVE_DIR") or cache_dir() / "native")


def _build(say):
    if not wanted():
        return None, "off (SPEC_NATIVE=0)"
    target = variant()
    if target is None:
        missing = [f for f in AVX2_FLAGS if f not in cpu_flags()]
        return None, f"this CPU lacks {', '.join(missing)}"
    from spec_cli.core.paths import write_whole

    tag = build_tag(target)
    folder = builds() / f"int4-{tag}"
    name = f"spec_int4_{tag}"
    built = folder / f"{name}.so"
    if built.is_file():  # (imported as it is: torch's extension loader would import setuptools and run ninja)
        try:
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, NAMES[target]
        except ImportError:
            pass
    from torch.utils import cpp_extension

    try:
        folder.mkdir(parents=True, exist_ok=True)
        if say is not None and not any(folder.glob("*.so")):
            say("building spec's CPU kernels for this CPU (once, under a minute)")
        unity = folder / "unity.cpp"  # every file in one translation unit: torch's headers, most of a build, once
        # (whole or not at all: another process may be compiling it, and torch's lock is taken only in `load`)
        first = [Path(__file__).with_name("avx2.h")] if target == "avx2" else []
        write_whole(unity, "".join(f'#include "{source}"\n' for source in [*first, *SOURCES]))
        flags = compile_flags(target)
        module = cpp_extension.load(name=name, sources=[str(unity)], build_directory=str(folder),
                                    extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                                    verbose=False)
    except Exception as error:  # (no compiler, no ninja, a read-only cache: torch's kernel does the work)
        return None, f"not built ({described(error)[:160]})"
    return module, NAMES[target]


def compile_flags(target: str) -> list[str]:
    """The compiler's target flags for a build ("avx512" or "avx2"): AVX2's in both, as `FLAGS` asks of the CPU
    (GCC's -mavx512f implies neither FMA nor F16C, which bf16.cpp's AVX2 code needs)."""
    base = ["-mavx2", "-mfma", "-mf16c"]
    return [*base, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"] if target == "avx512" else base


def variant() -> str | None:
    """Which build of the kernels this CPU runs: "avx512" (AVX-512 VNNI), "avx2" (AVX2 with FMA and F16C: the
    same sources through avx2.h; `SPEC_NATIVE=avx2` picks it on an AVX-512 CPU too), or None."""
    flags = cpu_flags()
    if os.environ.get("SPEC_NATIVE") != "avx2" and all(f in flags for f in FLAGS):
        return "avx512"
    return "avx2" if all(f in flags for f in AVX2_FLAGS) else None


def pack(nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in / 2] (two a byte, the even input high; out in 16s) in `int4.cpp`'s layout: by the
    compiled module where it is loaded (its `pack4`: a load of the Qwen pair spent ~3 s in these packers' torch
    forms), else by torch (`torch_pack`, the same bytes)."""
    module = loaded()
    if module is not None and nibbles.dtype == torch.uint8 and nibbles.is_contiguous():
        return module.pack4(nibbles)
    return torch_pack(nibbles)


def torch_pack(nibbles: torch.Tensor) -> torch.Tensor:
    out, half = nibbles.shape
    groups = half * 2 // 32
    q = torch.stack([nibbles >> 4, nibbles & 15], -1).reshape(out // 16, 16, groups, 2, 4, 4)
    q = q.permute(0, 2, 4, 1, 5, 3)  # [blocks, groups, p, lane, byte, half]
    return (q[..., 0] | (q[..., 1] << 4)).contiguous().reshape(out, half)


def pack8(values: torch.Tensor, group: int = 32) -> torch.Tensor:
    """8-bit signed values [out, in] (out in 16s, in in groups of 32 or 16) in `int4.cpp`'s 8-bit layout: for 16
    outputs and a group, group / 4 vectors of [16 outputs][4 inputs], each value + 128 (unsigned, as vpdpbusd
    takes it). By the compiled module where loaded, else by torch (`torch_pack8`), as `pack`."""
    module = loaded()
    if module is not None and values.dtype == torch.int8 and values.is_contiguous():
        return module.pack8(values, group)
    return torch_pack8(values, group)


def torch_pack8(values: torch.Tensor, group: int = 32) -> torch.Tensor:
    out, inputs = values.shape
    q = (values.to(torch.int16) + 128).to(torch.uint8).reshape(out // 16, 16, inputs // group, group // 4, 4)
    return q.permute(0, 2, 3, 1, 4).contiguous().reshape(out, inputs)


def unpack8(packed: torch.Tensor, group: int = 32) -> torch.Tensor:
    """`pack8`'s inverse: the 8-bit signed values [out, in]."""
    out, inputs = packed.shape
    q = packed.reshape(out // 16, inputs // group, group // 4, 16, 4).permute(0, 3, 1, 2, 4)
    return (q.reshape(out, inputs).to(torch.int16) - 128).to(torch.int8)


def pack6(values: torch.Tensor) -> torch.Tensor:
    """6-bit signed values [out, in] (-32..31; out in 16s, in in 256s) in `int4.cpp`'s 6-bit layout: for 16 outputs
    and a group of 16 inputs, three vectors of [16 outputs][4 inputs]: the low four bits of the group's inputs 0-3
    and 8-11 (low and high nibbles), of 4-7 and 12-15, then the top two bits of all four quarters. By the compiled
    module where loaded, else by torch (`torch_pack6`), as `pack`."""
    module = loaded()
    if module is not None and values.dtype == torch.int8 and values.is_contiguous():
        return module.pack6(values)
    return torch_pack6(values)


def torch_pack6(values: torch.Tensor) -> torch.Tensor:
    out, inputs = values.shape
    q = (values.to(torch.int16) + 32).to(torch.uint8).reshape(out // 16, 16, inputs // 16, 4, 4)
    q = q.permute(0, 2, 3, 1, 4)  # [blocks, groups, quarter, lane, byte]
    low, top = q & 15, q >> 4
    planes = [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4),
              top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)]
    return torch.stack(planes, 2).contiguous().reshape(out, inputs * 3 // 4)


def unpack6(packed: torch.Tensor) -> torch.Tensor:
    """`pack6`'s inverse: the 6-bit signed values [out, in]."""
    out, inputs = packed.shape[0], packed.shape[1] * 4 // 3
    b = packed.reshape(out // 16, inputs // 16, 3, 16, 4)
    low = torch.stack([b[:, :, 0] & 15, b[:, :, 1] & 15, b[:, :, 0] >> 4, b[:, :, 1] >> 4], 2)
    top = torch.stack([(b[:, :, 2] >> shift) & 3 for shift in (0, 2, 4, 6)], 2)
    q = (low | (top << 4)).permute(0, 3, 1, 2, 4).reshape(out, inputs)  # [blocks, lane, groups, quarter, byte]
    return (q.to(torch.int16) - 32).to(torch.int8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse: the 4-bit values [out, in] (0..15)."""
    out, half = packed.shape
    groups = half * 2 // 32
    b = packed.reshape(out // 16, groups, 4, 16, 4)
    q = torch.stack([b & 15, b >> 4], -1)  # [blocks, groups, p, lane, byte, half]
    return q.permute(0, 3, 1, 5, 2, 4).reshape(out, groups * 32)
