"""The step CUDA graphs would capture, proved on the CPU: every forward of every method compiles whole
(`fullgraph=True` raises on a graph break), once per token bucket and skip set (never per token), and the
compiled runners decode exactly what eager ones do."""

from __future__ import annotations

import archs
import pytest
import torch
from conftest import DEVICE, load_pair

from spec_cli.core.events import Token
from spec_cli.core.families import Skip
from spec_cli.core.settings import Decoding
from spec_cli.decoding.chain import Models
from spec_cli.decoding.methods import decode
from spec_cli.draft2.ngram import PromptLookup
from spec_cli.exec import Runner

METHODS = ("baseline", "speculative", "staged", "self")
MODES = {"greedy": {}, "top-k": dict(temperature=1.0, top_k=20, seed=3),
         "top-k-rejection": dict(temperature=1.0, top_k=20, seed=3, sampling="rejection")}
SKIP = Skip.of([1], [0])


class Counting:
    """A compile backend that runs the traced graph as it is and counts the graphs it was handed."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph.forward


def tokens_of(events) -> list[int]:
    return [e.token for e in events if isinstance(e, Token) and e.output]


def models(oracle, draft, compile, self_draft=False, pack=None):
    o = Runner(oracle, capacity=256, compile=compile, pack=pack)
    d = Runner(oracle if self_draft else draft, capacity=256, compile=compile, skip=SKIP if self_draft else Skip(),
               pack=pack)
    assert bool(o.packed) == bool(pack)
    return Models(o, d, PromptLookup(), self_skip=SKIP)


def keys(*runners) -> int:
    """The distinct (skip set, token bucket) steps the runners ran: each may compile once, no more."""
    return sum(len(r.compiled_keys) for r in runners)


@pytest.fixture(scope="module")
def pairs(tiny_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("compile")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    archs.make(root / "gpt_neox", "gpt_neox", len(tokenizer), tokenizer=tokenizer)
    neox = AutoModelForCausalLM.from_pretrained(root / "gpt_neox", dtype=torch.float32).to(DEVICE).eval()
    return {"gpt2": load_pair(tiny_dir, "gpt2"), "llama": load_pair(tiny_dir, "llama"),  # llama: grouped queries
            "gpt_neox": (neox, neox)}  # the model's own Hugging Face forward


@pytest.mark.parametrize("arch, mode", [(a, m) for a in ("gpt2", "llama", "gpt_neox") for m in MODES]
                         + [(a, "greedy") for a in ("gpt2-packed", "llama-packed")])  # packed: a CPU's oneDNN products
def test_every_method_compiles_whole_once_per_bucket_and_decodes_as_eager(pairs, arch, mode):
    name, _, packed = arch.partition("-")
    if packed and DEVICE.type != "cpu":
        pytest.skip("packed products are a CPU's")
    oracle, draft = pairs[name]
    pack = True if packed else None
    prompt = [5, 17, 33, 2, 91, 5, 17, 33]
    backend = Counting()
    graphs = 0
    for method in METHODS:
        eager = models(oracle, draft, False, self_draft=method == "self", pack=pack)
        compiled = models(oracle, draft, backend, self_draft=method == "self", pack=pack)
        for n in (6, 24):
            settings = Decoding(method=method, max_new_tokens=n, tree_budget=8, tree_adaptive=False, **MODES[mode])
            got = tokens_of(decode(compiled, prompt, settings))
            assert got == tokens_of(decode(eager, prompt, settings)), (method, n)
        # at most one graph per step the runners ran, whatever the length: never one per token (fewer where
        # a graph traced for an earlier runner serves a new one: the caches are its inputs)
        assert backend.graphs - graphs <= keys(compiled.oracle, compiled.draft), method
        assert backend.graphs > 0
        graphs = backend.graphs
        tokens_of(decode(compiled, prompt, Decoding(method=method, max_new_tokens=24, tree_budget=8, tree_adaptive=False, **MODES[mode])))
        assert backend.graphs == graphs, method  # a repeat meets only compiled steps


def test_captured_steps_replay_on_their_own_buffers_and_decode_as_eager(pairs):
    """What a CUDA graph does, on the CPU: each (skip set, bucket) step captured once, then run again on the
    same input buffers into the same output, the inputs copied in and the logits copied out. A step that read
    anything but its buffers, or logits read after a later replay overwrote them, would decode differently."""
    from spec_cli.exec.graphs import Graphs, replay_capture

    prompt = [5, 17, 33, 2, 91, 5, 17, 33]
    for name in ("gpt2", "gpt_neox"):
        oracle, draft = pairs[name]
        for method in METHODS:
            for mode in ("greedy", "top-k"):
                self_draft = method == "self"
                eager = models(oracle, draft, False, self_draft=self_draft)
                graphs = Graphs(replay_capture)
                o = Runner(oracle, capacity=256, compile="eager", graphs=graphs)
                d = Runner(oracle if self_draft else draft, capacity=256, compile="eager", graphs=graphs,
                           skip=SKIP if self_draft else Skip())
                settings = Decoding(method=method, max_new_tokens=24, tree_budget=8, tree_adaptive=False,
                                    **MODES[mode])
                got = tokens_of(decode(Models(o, d, PromptLookup(), self_skip=SKIP), prompt, settings))
                assert got == tokens_of(decode(eager, prompt, settings)), (name, method, mode)
                assert not graphs.failed and len(graphs.captured) == keys(o, d), (name, method, mode)


def test_a_step_that_cannot_be_captured_runs_uncaptured_with_one_line(pairs, capsys):
    from spec_cli.exec.graphs import Graphs

    def refuse(fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    oracle, _ = pairs["gpt2"]
    eager = Runner(oracle, capacity=256, shapes=Runner(oracle, capacity=256, compile="eager").shapes)
    graphs = Graphs(refuse)
    runner = Runner(oracle, capacity=256, compile="eager", graphs=graphs)
    for r in (eager, runner):
        r.forward([5, 17, 33], commit=3)
    for step in ([2], [91, 5]):
        assert torch.equal(runner.forward(step).logits, eager.forward(step).logits)
        runner.keep([runner.committed]), eager.keep([eager.committed])
    assert graphs.failed and not graphs.captured
    err = capsys.readouterr().err
    assert err.count("capturing a CUDA graph failed") == 1 and "more detail" not in err


def test_the_backend_is_cudagraphs_on_cuda_inductor_elsewhere_and_the_environment_wins(monkeypatch):
    from spec_cli.engine import compiled

    monkeypatch.delenv("SPEC_COMPILE_BACKEND", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiled(None, "auto", cuda) == "cudagraphs" and compiled(None, "auto", cpu) is False
    assert compiled(True, "auto", cpu) == "inductor" and compiled(False, "on", cuda) is False
    monkeypatch.setenv("SPEC_COMPILE_BACKEND", "inductor")
    assert compiled(None, "auto", cuda) == "inductor"
