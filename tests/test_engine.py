"""The engine is a cache of loaded models; what to run travels with each call. One loop runs completions."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from spec_cli.completion import complete
from spec_cli.core.events import BONUS, REJECTED, Finished, Started, Token, Verified
from spec_cli.core.families import Skip
from spec_cli.core.settings import Decoding
from spec_cli.engine import Engine, Plan
from spec_cli.models import profiles

PACKAGE = Path(__file__).resolve().parents[1] / "spec_cli"


@pytest.fixture(scope="module")
def self_drafted(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "selfish.toml"
    path.write_text(f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "self"\n[self_draft]\nskip_attention = [1]\n')
    return profiles.load(str(path))


def test_a_self_draft_runner_follows_each_calls_skip_set(self_drafted):
    """The cached self-draft runner was built with the first skip set and kept it when the skip set changed
    (bench and tune change it between runs): a draft that skips nothing (the oracle itself) must then be
    accepted every time, and a later skip set must draft exactly as on a fresh engine."""
    settings = Decoding(method="speculative", max_new_tokens=30, draft_tokens=4)
    ids = [5, 17, 33, 2]
    everything = Skip.of([0, 1, 2], [0, 1, 2])

    def run(engine, skip):
        done = complete(engine, ids, Plan(settings, skip=skip))
        return done.tokens, done.stats.acceptance()

    engine = Engine(self_drafted, dtype="float32")
    first_tokens, first = run(engine, everything)
    same_tokens, same = run(engine, Skip())
    fresh_tokens, fresh = run(Engine(self_drafted, dtype="float32"), Skip())
    assert first < 1.0 and same == fresh == 1.0
    assert first_tokens == same_tokens == fresh_tokens  # exact all the same
    assert run(engine, everything)[1] == first


def test_settings_drafter_and_skip_set_are_not_assigned_onto_the_engine():
    """Front ends hand a Plan to each call; none assigns settings, a drafter or a skip set to the engine."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "engine":
                        offenders.append(f"{path.name}:{node.lineno} engine.{target.attr} = ...")
    assert not offenders


def test_every_front_end_runs_completions_through_one_function():
    """cli.generate, chat, bench and tune.measure all call completion.complete; only it iterates events."""
    callers = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "events" and path.name not in ("engine.py", "completion.py"):
                callers[path.name] = "iterates engine.events itself"
            elif name == "complete":
                callers.setdefault(path.name, "complete")
    for name in ("cli.py", "session.py", "bench.py", "tune.py"):
        assert callers.get(name) == "complete", (name, callers)
    assert all(v == "complete" for v in callers.values()), callers


class _FakeEngine:
    def __init__(self, events, delay=0.0):
        self.script, self.delay, self.closed = events, delay, False

    def events(self, prompt, plan, reuse=False):
        def stream():
            try:
                for event in self.script:
                    if event == "sleep":
                        time.sleep(self.delay)
                    elif event == "interrupt":
                        raise KeyboardInterrupt
                    else:
                        yield event
            finally:
                self.closed = True

        return stream()


def test_complete_times_the_prompt_apart_from_generation_and_stops_cleanly():
    tokens = [Token(t, BONUS, "oracle") for t in range(5)]
    engine = _FakeEngine([Started(40, 10), "sleep", Verified("oracle", 1, 0, 0), tokens[0]]
                         + [x for t in tokens[1:] for x in ("sleep", t)] + [Finished("length")], delay=0.05)
    done = complete(engine, [1] * 40, Decoding())
    assert done.tokens == list(range(5)) and done.reason == "length" and engine.closed
    assert done.stats.prompt_tokens == 30  # the 10 cached tokens were not run
    assert 0.04 < done.first_token_seconds < 0.15 and done.seconds > 0.2
    assert done.prompt_tokens_per_second == pytest.approx(30 / done.first_token_seconds)
    assert done.generation_tokens_per_second == pytest.approx(4 / (done.seconds - done.first_token_seconds))
    # a watch ends it early (a stop marker), Ctrl-C ends it keeping what came, and the stream is closed
    engine = _FakeEngine([Started(3), *tokens, Finished("length")])
    stopped = complete(engine, [1, 2, 3], Decoding(), watch=lambda e: isinstance(e, Token) and e.token == 2)
    assert stopped.tokens == [0, 1, 2] and stopped.reason == "stop" and engine.closed
    engine = _FakeEngine([Started(3), tokens[0], Token(9, REJECTED, "draft"), tokens[1], "interrupt", tokens[2]])
    cut = complete(engine, [1, 2, 3], Decoding(), trace=True)
    assert cut.interrupted and cut.tokens == [0, 1] and len(cut.events) == 4 and engine.closed


def test_padded_shapes_are_warmed_once_before_anything_is_timed(self_drafted, monkeypatch):
    """Where shapes are padded (GPUs, AMX), the spinner runs each bucket once; completions then build nothing
    new, and an engine that skipped the spinner warms a runner before its first completion."""
    from spec_cli.exec import shapes

    monkeypatch.setattr(shapes.Shapes, "for_device",
                        classmethod(lambda cls, device, dtype, compiled=False, per_shape=True, aligned=True:
                                    cls(shapes.power_buckets(16), 0)))
    engine = Engine(self_drafted, dtype="float32")
    plan = Plan(Decoding(method="speculative", max_new_tokens=20), skip=Skip.of([1], []))
    assert engine.warm_up(plan, prompt_tokens=4) == 2 * 5  # oracle and self-draft, buckets 1..16
    assert engine.warm_up(plan, prompt_tokens=4) == 0
    complete(engine, [5, 17, 33, 2], plan)
    assert engine.warm_forwards == 10
    fresh = Engine(self_drafted, dtype="float32")  # no spinner: the first completion warms its runners itself
    complete(fresh, [5, 17, 33, 2], plan)
    assert fresh.warm_forwards == 10


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_draft_whose_weights_nobody_chose_runs_int4_on_spec_kernel_and_changes_no_output(tiny_dir, tmp_path, arch):
    """On a CPU where spec's int4 kernel runs, a draft named with no dtype or quantize loads as int4 and
    bfloat16 (its forward is what every speculative step pays), and the output is still the oracle's alone;
    a draft's own dtype or quantize, or the profile's quantize, is kept as written."""
    import torch

    from spec_cli.exec import quant

    if quant.native_kernel() is None:
        pytest.skip("spec's int4 kernel does not run here: drafts keep their weights")
    oracle, draft = tiny_dir / f"{arch}-oracle", tiny_dir / f"{arch}-draft"

    def engine(extra: str = "", draft_ref: str = f'"{draft}"') -> Engine:
        path = tmp_path / "p.toml"
        path.write_text(f'oracle = "{oracle}"\ndraft = {draft_ref}\n{extra}')
        return Engine(profiles.load(str(path)), dtype="float32")

    chosen = engine()
    loaded = chosen.load_draft()
    assert loaded.ref.quantize == "int4"
    assert quant.summary(loaded.model)["format"].startswith("int4") and loaded.model.dtype == torch.bfloat16
    assert chosen.draft_weights["format"].startswith("int4") and chosen.draft_weights["dtype"] == "bfloat16"
    assert chosen.oracle.model.dtype == torch.float32  # the oracle as asked
    ids = [5, 17, 33, 2, 9]
    base = complete(chosen, ids, Plan(Decoding(method="baseline", max_new_tokens=40))).tokens
    for method in ("speculative", "staged"):
        done = complete(chosen, ids, Plan(Decoding(method=method, max_new_tokens=40)))
        assert done.tokens == base, method
        assert done.stats.forwards.get("draft"), method  # (the int4 draft ran)

    for extra, ref in [("", f'{{ model = "{draft}", dtype = "float32" }}'),
                       ("", f'{{ model = "{draft}", quantize = "none" }}'),
                       ('quantize = "none"\n', f'"{draft}"')]:
        kept = engine(extra, ref).load_draft()
        assert quant.summary(kept.model)["quantized"] == 0 and kept.model.dtype == torch.float32, (extra, ref)


def test_a_draft_larger_than_its_oracle_is_told_and_a_smaller_one_is_not(tiny_dir, tmp_path):
    """--oracle and --draft swapped (the big model drafting for the small one) decodes exactly, slowly: the
    engine's note says so, once the draft is loaded; a draft of the oracle's size or smaller gets no note."""
    from tiny import make_model, make_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    make_model(tmp_path / "wide", "llama", len(tokenizer), layers=3, width=128, seed=3, tokenizer=tokenizer)
    small = str(tiny_dir / "llama-oracle")
    swapped = Engine(profiles.select(None, small, str(tmp_path / "wide")), dtype="float32")
    swapped.load_draft()
    assert "the draft is larger than the oracle" in swapped.note and "swap --oracle and --draft" in swapped.note
    right = Engine(profiles.select(None, str(tmp_path / "wide"), small), dtype="float32")
    right.load_draft()
    assert right.note is None or "larger" not in right.note
    same = Engine(profiles.select(None, small, str(tiny_dir / "llama-draft")), dtype="float32")
    same.load_draft()
    assert same.note is None or "larger" not in same.note
