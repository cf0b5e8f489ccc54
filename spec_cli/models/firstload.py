"""A family spec has no test for is checked on the user's own model the first time it loads.

The check is spec_cli/check.py's (greedy decoding against the model's own `generate`, a random tree against
each of its paths): in float32 when a float32 copy fits in memory, else in the model's dtype within that
dtype's tolerance. Its verdict is cached in the cache dir, keyed by the model type, a hash of the config and
the spec and transformers versions, so the next load of the same architecture runs at once; a failing verdict
refuses in one line with what differed. SPEC_ALLOW_UNTESTED=1 skips the check.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from spec_cli import __version__
from spec_cli.core.errors import SpecError
from spec_cli.core.families import FAMILIES
from spec_cli.core.paths import cache_dir, write_whole
from spec_cli.models.conformance import Result, conformance

TOKENS = 16  # greedy tokens compared: seconds on a small model
LEVELS = 2  # tree levels


def allowed_untested() -> bool:
    return os.environ.get("SPEC_ALLOW_UNTESTED") == "1"


def key(config) -> dict:
    """What a verdict is about: the architecture as configured, and the code that ran it."""
    import transformers

    settings = {k: v for k, v in config.to_dict().items()
                if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures")}
    text = json.dumps(settings, sort_keys=True, default=str)
    return {"model_type": config.model_type, "config": hashlib.sha256(text.encode()).hexdigest()[:16],
            "spec": __version__, "transformers": transformers.__version__}


def verdict_path(config) -> Path:
    k = key(config)
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "checks" / f"{k['model_type']}-{digest}.json"


def cached(config) -> dict | None:
    path = verdict_path(config)
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if verdict.get("key") == key(config) else None


def record(config, results: list[Result], dtype: torch.dtype, seconds: float) -> dict:
    verdict = {"key": key(config), "ok": all(r.ok for r in results), "dtype": str(dtype).removeprefix("torch."),
               "seconds": round(seconds, 1), "checks": [{"name": r.name, "ok": r.ok, "detail": r.detail}
                                                         for r in results]}
    path = verdict_path(config)
    try:
        write_whole(path, json.dumps(verdict, indent=1))
    except OSError:  # a read-only cache only costs a check next time
        pass
    return verdict


def _float32_fits(model) -> bool:
    need = sum(p.numel() for p in model.parameters()) * 4 * 1.2
    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] > need
    try:
        import psutil

        return psutil.virtual_memory().available > 2 * need
    except ImportError:  # pragma: no cover
        return False


def check_model(model, tokenizer) -> tuple[list[Result], torch.dtype, float]:
    """The conformance checks, in float32 when a copy fits, else in the model's own dtype."""
    start = time.perf_counter()
    subject = model
    if next(model.parameters()).dtype != torch.float32 and _float32_fits(model):
        subject = copy.deepcopy(model).float()
    dtype = next(subject.parameters()).dtype
    results = list(conformance(subject, tokenizer, TOKENS, levels=LEVELS))
    return results, dtype, time.perf_counter() - start


def summary(verdict: dict) -> str:
    return "; ".join(f"{c['name']}: {c['detail']}" for c in verdict["checks"] if c["ok"] == verdict["ok"])


def ensure(model, tokenizer, name: str, say: Callable[[str], None]) -> None:
    """Check a model of a family spec has no test for, once per architecture; refuse it if spec cannot run
    it exactly."""
    config = model.config
    if config.model_type in FAMILIES or allowed_untested():
        return
    verdict = cached(config)
    if verdict is None:
        results, dtype, seconds = check_model(model, tokenizer)
        verdict = record(config, results, dtype, seconds)
        if verdict["ok"]:
            say(f"{name}: spec is not tested on '{config.model_type}', so it checked this model on first load: "
                f"it runs exactly ({summary(verdict)}; {verdict['dtype']}, {seconds:.1f} s; verdict cached)")
    if not verdict["ok"]:
        raise SpecError(f"{name} is a '{config.model_type}' model, which spec is not tested on, and the check on "
                        f"first load failed ({summary(verdict)}; {verdict['dtype']}): spec cannot run it exactly "
                        f"(`spec check` shows the check; SPEC_ALLOW_UNTESTED=1 runs it anyway)")
