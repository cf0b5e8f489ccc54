"""Counting, in this process, what a GPU would wait for: every read of a tensor's values into Python (on a GPU
each one waits for the device) and every tensor built from Python data with torch.tensor / torch.as_tensor
(on a GPU, a blocking copy). The benchmark and the tests count with it; on a CPU the counts are the
synchronisations the same code would make on CUDA."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
UPLOADS = ("tensor", "as_tensor")


@contextlib.contextmanager
def counting():
    counts: Counter = Counter()
    busy = [False]
    saved = {}

    def wrap_read(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            if not busy[0]:
                counts["reads"] += 1
            busy[0] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                busy[0] = False
        saved[(torch.Tensor, name)] = original
        setattr(torch.Tensor, name, counted)

    def wrap_upload(name):
        original = getattr(torch, name)

        def counted(data, *args, **kwargs):
            if not isinstance(data, torch.Tensor):
                counts["uploads"] += 1
            return original(data, *args, **kwargs)
        saved[(torch, name)] = original
        setattr(torch, name, counted)

    for name in READS:
        wrap_read(name)
    for name in UPLOADS:
        wrap_upload(name)
    try:
        yield counts
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
