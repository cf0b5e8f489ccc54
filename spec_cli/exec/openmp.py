"""OpenMP (torch's CPU runtime, libgomp) thread teams: a thread's own count, and a thread giving its team back.

libgomp lets a team's waiting threads spin 300,000 times before sleeping, but only ~100 while it manages more
threads than there are CPUs (every thread that ran a parallel region keeps a team): past that, every parallel
region of a forward wakes its threads through the kernel. So where several threads use torch (a server's slots),
one of them computes and the others run in one thread.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _libgomp():
    """libgomp as torch loaded it (None: another OpenMP runtime, or none)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = list(dict.fromkeys(line.split()[-1] for line in maps if "libgomp" in line))
        path = torch_libgomp(paths, os.path.dirname(torch.__file__))
        return None if path is None else ctypes.CDLL(path)
    except OSError:
        return None


def torch_libgomp(paths: list[str], torch_folder: str) -> str | None:
    """torch's libgomp among those the process has loaded (a wheel may bring its own, which another import loads
    beside torch's: sentencepiece's, through transformers' tokenizers; its teams are not torch's): the one in
    torch's folder, else the first no other wheel vendored (in a `*.libs` folder), else the first."""
    inside = [p for p in paths if p.startswith(torch_folder.rstrip(os.sep) + os.sep)]
    elsewhere = [p for p in paths if ".libs" + os.sep not in p]
    return next(iter(inside or elsewhere or paths), None)


def threads_here(count: int) -> int:
    """Set the calling thread's OpenMP thread count (torch's per-thread setup done first: it would reset the
    count at the thread's first parallel region); returns the count it had. Does nothing without libgomp."""
    before = torch.get_num_threads()
    gomp = _libgomp()
    if gomp is not None and count != before:
        gomp.omp_set_num_threads(count)
    return before


def give_back_team() -> None:
    """End the calling thread's OpenMP team (its threads exit; a later parallel region makes it anew), leaving
    the compute to another thread's (omp_pause_resource_all, OpenMP 5: libgomp of GCC 9 on)."""
    gomp = _libgomp()
    if gomp is not None and hasattr(gomp, "omp_pause_resource_all"):
        gomp.omp_pause_resource_all(2)  # (omp_pause_hard)
