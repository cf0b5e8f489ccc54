"""spec's process-wide settings, each made in one place, once: nothing in the layers changes them as it goes.

- `inference()`: no autograd (spec only runs models forward), for the calling thread (torch's switch is per
  thread); the CLI and each Engine call it.
- `compiling()`: dynamo's recompile budget raised for every (runner, skip set, shape) a process compiles, each
  one entry of the same traced function; a runner that compiles calls it.
- `quiet_gguf_reads()`: transformers' GGUF reader draws its own progress bar whatever its verbosity; spec shows
  its own, so that bar is off for good (not swapped in and back, which two threads could interleave).
- `starting()`, `settle()`: no full passes of the garbage collector while a command imports and loads (the CLI's
  `main` calls `starting()` first); what the loading made stays for the process's life, out of the collector's
  full passes (`settle()`, each command's once its models are loaded and warm); `unsettle()` at `main`'s end.
"""

from __future__ import annotations

import functools
import gc

RECOMPILES = 4096
DEFAULT_FULL = gc.get_threshold()[2]


def inference() -> None:
    import torch

    torch.set_grad_enabled(False)


@functools.cache
def compiling() -> None:
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILES)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, RECOMPILES)


@functools.cache
def quiet_gguf_reads() -> None:
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    hf_gguf.tqdm = lambda items, **kwargs: items


FULL_PASSES_OFF = 1 << 30  # gc's third threshold while a command loads: no full pass until `settle`


def starting() -> None:
    """A command's start (the CLI's `main`): no full passes of the collector until `settle`. Importing torch and
    transformers and loading a pair made ~11 full passes over a growing heap, 1.6 s of a 9.4 s start (`spec bench`,
    the Qwen pair, Zen 5); `spec generate` with the pair took 8.3-8.9 s instead of 10.1-11.1, pyfam 3.8-3.9 instead
    of 4.5-4.6, at the same peak memory. The young generations are still collected, as ever."""
    young, older, _ = gc.get_threshold()
    gc.set_threshold(young, older, FULL_PASSES_OFF)


def settle() -> None:
    """Freeze what the collector tracks now (gc.freeze), its young generations collected first: a loaded pair holds
    ~400,000 tracked objects (modules, the tokenizer, draft2's tables), and a full pass over them took ~230 ms
    with every thread stopped. One came while a crowd of requests arrived: pyfam behind `spec serve --parallel
    16`, 16 clients at once, its first text at 0.25 s where 0.03 s without it. (No full pass first: after a load
    one found 8-30 unreachable objects, for 210-230 ms of every command's start.) Objects made later are collected
    as ever."""
    gc.collect(1)
    gc.freeze()
    _full_passes_on()


def unsettle() -> None:
    """A command's end (the CLI's `main`): what `settle` froze is the collector's again, so that a process running
    commands in turn (the tests) frees what each made."""
    gc.unfreeze()
    _full_passes_on()


def _full_passes_on() -> None:
    young, older, full = gc.get_threshold()
    if full == FULL_PASSES_OFF:
        gc.set_threshold(young, older, DEFAULT_FULL)
