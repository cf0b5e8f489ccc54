"""What a GPU would wait for, counted on the CPU: host reads (every tensor value read into Python) and
uploads (tensors built from Python data) per token and per forward of each method, on the trained pyfam
pair, within these budgets (issue 19): baseline <= 1 read and <= 0.1 upload per token; speculative <= 0.6
reads per token; staged <= 1 read and <= 1 upload per forward (draft and oracle), also when the tree grows."""

from pathlib import Path

import pytest
from conftest import DEVICE, PYFAM

from spec_cli.completion import complete
from spec_cli.draft2.ngram import PromptLookup
from spec_cli.engine import Engine, Plan
from spec_cli.exec import Runner
from spec_cli.exec.hostreads import counting
from spec_cli.models import profiles

pytestmark = pytest.mark.skipif(not PYFAM.is_dir(), reason="needs ../shared")

PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "pyfam.toml"
FRESH = "def f(x):"
REPEATS = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
           "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
           "    def peek(self):\n        return self.items[-1]\n\n    def size(self):\n")
TOP_K = dict(temperature=1.0, top_k=50, seed=1)


@pytest.fixture(scope="module")
def engine():
    return Engine(profiles.load(str(PROFILE)), device=str(DEVICE), dtype="float32", need_draft=True)


def counted(engine, prompt, **settings):
    plan = Plan(engine.profile.decoding.replace(max_new_tokens=48, **settings), PromptLookup())
    ids = engine.encode(prompt)
    complete(engine, ids, plan)  # builds the runners: what loading costs is not counted
    runs, real = [0], Runner._run

    def run(self, *args):  # the forwards the device runs: a compiled runner's long prompt is several
        runs[0] += 1
        return real(self, *args)

    Runner._run = run
    try:
        with counting() as counts:
            done = complete(engine, ids, plan)
    finally:
        Runner._run = real
    stats = done.stats
    return counts["reads"], counts["uploads"], stats.new_tokens, stats.oracle_forwards + stats.draft_forwards, \
        stats.oracle_forwards, runs[0]


def test_baseline_reads_each_token_once_and_uploads_nothing(engine):
    reads, uploads, tokens, *_ = counted(engine, FRESH, method="baseline")
    assert reads <= tokens and uploads <= 0.1 * tokens


def test_speculative_reads_once_per_oracle_step(engine):
    reads, uploads, tokens, *_ = counted(engine, REPEATS, method="speculative", draft_tokens=4)
    assert reads <= 0.6 * tokens and uploads <= 0.1 * tokens


@pytest.mark.parametrize("mode", [{}, TOP_K], ids=["greedy", "top-k"])
@pytest.mark.parametrize("prompt,shape", [(FRESH, dict(tree_adaptive=True)), (REPEATS, dict(tree_adaptive=False))],
                         ids=["fresh-adaptive", "repeats-fixed"])
def test_staged_reads_and_uploads_once_per_forward(engine, prompt, shape, mode):
    reads, uploads, tokens, forwards, oracle, runs = counted(engine, prompt, method="staged", **shape, **mode)
    assert reads <= forwards and uploads <= runs <= forwards + 2  # (+ the pieces of a compiled runner's prompt)
    if not shape["tree_adaptive"]:
        assert tokens >= 1.5 * oracle  # the tree grew: tokens per oracle forward


def test_compiled_runners_keep_the_budgets(monkeypatch):
    """The step a GPU captures as CUDA graphs, traced here (eager backend): its forwards send their rows in one
    upload each, a long prompt in pieces of the largest bucket (each its own forward)."""
    monkeypatch.setenv("SPEC_COMPILE_BACKEND", "eager")
    compiled = Engine(profiles.load(str(PROFILE)), device=str(DEVICE), dtype="float32", need_draft=True,
                      compile=True)
    reads, uploads, tokens, forwards, oracle, runs = counted(compiled, REPEATS, method="staged",
                                                             tree_adaptive=False)
    assert reads <= forwards and uploads <= runs and runs > forwards  # the prompt ran in pieces
    reads, uploads, tokens, *_ = counted(compiled, FRESH, method="baseline")
    assert reads <= tokens and uploads <= 0.1 * tokens
