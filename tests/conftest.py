from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import platformdirs
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# the tests' models are tiny: a second thread only waits, and on a busy machine it waits long
torch.set_num_threads(1)
# tests start no background fits of draft2's trigram (the one that tests it opts in)
os.environ["SPEC_BACKGROUND_FIT"] = "0"
# and keep nothing in the user's cache dir (what staged's controllers learned, verdicts): a folder of their own
os.environ["SPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="spec-tests-")
# (but spec's compiled CPU kernels, the same for every test and run, are built once: about 25 s)
os.environ.setdefault("SPEC_NATIVE_DIR", os.path.join(platformdirs.user_cache_dir("spec"), "native"))

from tiny import make_model, make_noisy_copy, make_tokenizer  # noqa: E402

# SPEC_TEST_DEVICE=cuda runs the runner, compile, exactness-on-models and host-read tests on that device (a GPU
# machine checks what the CPU run checks); SPEC_TEST_DTYPE the pyfam identity tests' dtype (float32 by default)
DEVICE = torch.device(os.environ.get("SPEC_TEST_DEVICE", "cpu"))
DTYPE = os.environ.get("SPEC_TEST_DTYPE", "float32")
SHARED = Path(__file__).resolve().parents[2] / "shared"
PYFAM = SHARED / "models" / "pyfam"
HUMANEVAL = SHARED / "data" / "humaneval" / "HumanEval.jsonl.gz"


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Each test its own cache dir: what one test's controllers learned (spec_cli/learned.py) does not steer
    another's completions."""
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Tiny GPT-2 and Llama oracles, each with a draft that agrees often (a noisy copy), sharing a tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = make_tokenizer(root / "tokenizer")
    for arch in ("gpt2", "llama"):
        make_model(root / f"{arch}-oracle", arch, len(tokenizer), layers=3, width=64, seed=1, tokenizer=tokenizer)
        make_noisy_copy(root / f"{arch}-oracle", root / f"{arch}-draft", noise=0.1, seed=2)
    return root


@pytest.fixture(scope="module")
def profile(tiny_dir, tmp_path_factory):
    """A profile file for the tiny GPT-2 pair, speculative, 24 tokens."""
    folder = tmp_path_factory.mktemp("profiles")
    path = folder / "tiny.toml"
    path.write_text(
        f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "{tiny_dir / "gpt2-draft"}"\n'
        '[decoding]\nmethod = "speculative"\nmax_new_tokens = 24\ndraft_tokens = 3\n'
    )
    return path


def load_pair(root: Path, arch: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(root / f"{arch}-oracle", dtype=dtype).to(DEVICE).eval()
    draft = AutoModelForCausalLM.from_pretrained(root / f"{arch}-draft", dtype=dtype).to(DEVICE).eval()
    return oracle, draft


def write_profile(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(body)
    return path
