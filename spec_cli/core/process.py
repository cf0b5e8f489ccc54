"""spec's process-wide settings, each made in one place, once: nothing in the layers changes them as it goes.

- `inference()`: no autograd (spec only runs models forward), for the calling thread (torch's switch is per
  thread); the CLI and each Engine call it.
- `compiling()`: dynamo's recompile budget raised for every (runner, skip set, shape) a process compiles, each
  one entry of the same traced function; a runner that compiles calls it.
- `quiet_gguf_reads()`: transformers' GGUF reader draws its own progress bar whatever its verbosity; spec shows
  its own, so that bar is off for good (not swapped in and back, which two threads could interleave).
"""

from __future__ import annotations

import functools

import torch

RECOMPILES = 4096


def inference() -> None:
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
