"""What staged's controllers learned outlives the process (spec_cli/learned.py): kept per model pair, dtype and
machine, written atomically at the end of each completion, read by the next engine; a bad file is ignored."""

from __future__ import annotations

import json
import random

import pytest

from spec_cli.completion import complete
from spec_cli.core.settings import Decoding, ModelRef, Profile
from spec_cli.decoding import adapt, learned
from spec_cli.decoding.sampling import Sampler
from spec_cli.engine import Engine

GREEDY = ("greedy", Sampler())


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def taught() -> adapt.Controller:
    """A controller that has seen a few hundred steps of every kind."""
    rng, c = random.Random(0), adapt.Controller()
    for _ in range(300):
        c.report(adapt.Step(speculated=rng.random() < 0.5, tokens=rng.randint(1, 5), verified=rng.randint(0, 6),
                            oracle_tail=1, oracle_seconds=rng.uniform(0.01, 0.02), draft_tail=1,
                            drafts=[(rng.randint(1, 8), rng.uniform(0.001, 0.003))], drafting=0.004,
                            drafter="PromptLookup", guesses=[rng.random() < 0.6],
                            nodes=[(rng.random(), rng.randint(0, 3), rng.random() < 0.5)],
                            groups=[(rng.random(), rng.random() < 0.5)],
                            lookups=[(rng.randint(1, 40), rng.random(), rng.randint(0, 2), rng.random() < 0.7)]))
    return c


def aged(state: dict) -> dict:
    """`state` as a new process keeps it: every timing older by `adapt.SPAN` forwards."""
    state = json.loads(json.dumps(state))
    for curve in ("oracle", "draft"):
        for seen in state[curve].values():
            for timing in seen:
                timing[2] += adapt.SPAN
    return state


def test_a_controllers_state_round_trips_through_json():
    c = taught()
    back = adapt.Controller()
    back.restore(json.loads(json.dumps(c.state())))
    assert back.state() == aged(c.state())
    assert back.oracle(5) == c.oracle(5) and back.draft(3) == c.draft(3)
    assert back.calibration.lookup(12, 0.9, 0) == c.calibration.lookup(12, 0.9, 0)
    assert back.calibration.node(0.7, 1) == c.calibration.node(0.7, 1)
    assert back.plain_rate == c.plain_rate and back.spec_rate == c.spec_rate
    c.begin()  # (the completion under way is not kept)
    assert back.price(1)(4) == pytest.approx(c.price(1)(4))


def test_controllers_start_from_the_file_and_keep_ways_not_used(cache):
    key = {"oracle": "o", "machine": "m"}
    first = learned.Controllers(key)
    first[GREEDY].restore(taught().state())
    sampled = ("sequoia", Sampler(1.0))
    first[sampled]  # noqa: B018 - a way used and left as new
    first.save()
    second = learned.Controllers(key)
    assert second[GREEDY].state() == aged(first[GREEDY].state())
    second.save()  # used only the greedy way: the sampled one stays in the file
    assert learned.name(sampled) in json.loads(learned.path(key).read_text())["ways"]
    assert not list(learned.folder().glob("*.tmp"))
    assert learned.Controllers({"oracle": "another"})[GREEDY].state() == adapt.Controller().state()


@pytest.mark.parametrize("bad", ["{not json", "[]", '{"format": 1, "key": {"oracle": "o", "machine": "m"}, '
                                 '"ways": {"[\\"greedy\\", 0.0, 0, 1.0, false]": {"oracle": 3}}}'])
def test_a_bad_file_is_ignored(cache, bad):
    key = {"oracle": "o", "machine": "m"}
    learned.path(key).parent.mkdir(parents=True, exist_ok=True)
    learned.path(key).write_text(bad)
    controllers = learned.Controllers(key)
    assert controllers[GREEDY].state() == adapt.Controller().state()
    controllers.save()
    assert json.loads(learned.path(key).read_text())["format"] == learned.FORMAT


def test_the_next_engine_starts_where_the_last_ended(tiny_dir, cache, monkeypatch):
    # (the next engine's first plain step never finds the machine's speed changed: on a busy machine it could, and
    # then rightly forgets the kept timings, which this test reads)
    monkeypatch.setattr(adapt, "KEPT_DRIFT", float("inf"))
    profile = Profile(name="tiny", source="", oracle=ModelRef(str(tiny_dir / "llama-oracle")),
                      draft=ModelRef(str(tiny_dir / "llama-draft")))
    settings = Decoding(method="staged", max_new_tokens=24)
    ids = [5, 17, 33, 2, 5, 17, 33]

    def controller(engine):
        return next(iter(next(iter(engine._controllers.values())).values()))

    engine = Engine(profile, dtype="float32")
    first = complete(engine, ids, settings)
    files = list(learned.folder().glob("*.json"))
    assert len(files) == 1  # written at the end of the completion
    kept = controller(engine).state()
    later = Engine(profile, dtype="float32")
    again = complete(later, ids, settings)
    assert again.tokens == first.tokens
    assert controller(later).calibration.state() != adapt.Controller().calibration.state()
    restored = adapt.Controller()
    restored.restore(json.loads(json.dumps(kept)))
    assert restored.oracle.fresh().keys() <= controller(later).oracle.fresh().keys()
    alone = Profile(name="alone", source="", oracle=profile.oracle)  # another drafter: another file
    complete(Engine(alone, dtype="float32"), ids, settings)
    assert len(list(learned.folder().glob("*.json"))) == 2


def test_timings_age_out_so_a_busy_spell_does_not_price_a_size_out_for_good():
    """A size timed while the machine was busy (here: in the last process) and never run since is forgotten
    after AGE forwards of other sizes; the curve then reads it off its neighbours' line."""
    busy = adapt.Cost()
    for _ in range(9):
        busy.add(1, 0.010)
        busy.add(8, 0.090)  # three times what it costs when the machine is quiet
    cost = adapt.Cost()
    cost.restore(json.loads(json.dumps(busy.state())))
    assert cost(8) == pytest.approx(0.090)
    for k in range(adapt.AGE):
        cost.add(1 + k % 2, 0.010 + 0.002 * (k % 2))  # only one and two tokens run now
    assert cost(8) == pytest.approx(0.010 + 0.002 * 7)  # the quiet line, extended
    assert 5 not in cost.fresh() and all(b in cost.fresh() for b in (0, 1))
