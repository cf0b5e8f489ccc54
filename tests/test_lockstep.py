"""Sequences decoded together (`exec.lockstep`, a server's slots): each thread's rows run in forwards shared with the
others', and every sequence gets the bits (bfloat16) and the tokens it gets alone, whatever joins or leaves."""

from __future__ import annotations

import functools
import random
import threading

import pytest
import torch
from conftest import DEVICE, load_pair, write_profile
from helpers import os_threads, settled

from spec_cli.completion import complete
from spec_cli.engine import Engine
from spec_cli.exec import Runner, backends, native, quant
from spec_cli.exec.lockstep import Lockstep
from spec_cli.models import profiles as profile_store

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="slots share forwards on the CPU (eager lean loops)")


def together(work, count: int, cohort: bool = False, **options) -> list:
    """`work(k)` for k < count, each in its own thread taking part in one Lockstep, started at once; or (`cohort`)
    each a greenlet of one Cohort in one thread, as a server's slots are."""
    lockstep = Lockstep(**{"piece": 48, **options})
    if cohort:
        return in_cohort(work, count, lockstep), lockstep
    results, errors = [None] * count, []
    gate = threading.Barrier(count)

    def run(k):
        gate.wait()
        try:
            with lockstep.taking_part():
                results[k] = work(k, lockstep)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results, lockstep


def in_cohort(work, count: int, lockstep: Lockstep) -> list:
    from spec_cli.exec.cohort import Cohort

    results, errors, threads = [None] * count, [], set()
    cohort = Cohort(lockstep)

    def run(k):
        threads.add(threading.get_ident())
        try:
            with lockstep.taking_part():
                results[k] = work(k, lockstep)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=cohort.run, args=([functools.partial(run, k) for k in range(count)],))
    thread.start()
    thread.join(timeout=120)
    if errors:
        raise errors[0]
    assert threads == {thread.ident} and not cohort.waiting  # (one thread for all; nothing left waiting)
    return results


def steps(runner: Runner, prompt: list[int], count: int, seed: int) -> list[torch.Tensor]:
    """Every logits row of a prompt (in pieces: longer than the lockstep's), then chains, a tree and single
    tokens, some kept: what speculative decoding asks of a runner."""
    rng = random.Random(seed)
    out = [runner.forward(prompt, commit=len(prompt)).logits]
    for _ in range(count):
        top = int(out[-1][-1].argmax())
        kind = rng.randrange(3)
        if kind == 0:
            out.append(runner.forward([top], commit=1).logits)
        elif kind == 1:  # a chain, its first two kept
            out.append(runner.forward([top, rng.randrange(300), rng.randrange(300)]).logits)
            runner.keep([runner.committed, runner.committed + 1])
        else:  # a tree: two children of the last token, one child of the first
            c = runner.committed
            out.append(runner.forward([top, rng.randrange(300), rng.randrange(300)], parents=[-1, -1, c]).logits)
            runner.keep([c, c + 2])
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("cohort", [False, True], ids=["threads", "cohort"])
def test_rows_in_company_have_the_bits_they_have_alone_in_bfloat16(tiny_dir, arch, attention, cohort, monkeypatch):
    if attention == "native" and native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    if attention == "torch":
        monkeypatch.setattr(backends, "native_glue", lambda device, dtype: None)
    oracle, _ = load_pair(tiny_dir, arch, dtype=torch.bfloat16)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(2, 130))] for _ in range(5)]
    alone = [steps(Runner(oracle, capacity=512), p, 10 + 3 * k, seed=k) for k, p in enumerate(prompts)]
    found, lockstep = together(lambda k, ls: steps(Runner(oracle, capacity=512, lockstep=ls), prompts[k], 10 + 3 * k,
                                                   seed=k), len(prompts), cohort=cohort)
    assert lockstep.counts.widest >= 3 and lockstep.counts.forwards < sum(len(a) for a in alone)  # shared
    for k, (mine, theirs) in enumerate(zip(found, alone)):
        assert len(mine) == len(theirs)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert torch.equal(a, b), (k, i)  # (alone: the runner's own forward, fused layers and all)


@pytest.mark.parametrize("name", ["gemma2", "phi3-partial", "smollm3"])
@pytest.mark.parametrize("cohort", [False, True], ids=["threads", "cohort"])
def test_rows_in_company_have_the_bits_they_have_alone_in_the_later_lean_families(tiny_dir, tmp_path, name, cohort):
    """Gemma 2 (its softcap in each part's attention), Phi-4-mini's partial rope and SmolLM3's unrotated layers in
    a server's shared forwards: each sequence's rows the bits they have alone."""
    import archs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    archs.make(tmp_path / name, name, len(tokenizer), tokenizer=tokenizer)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.bfloat16).eval()
    assert Runner(oracle, capacity=64).lean is not None
    rng = random.Random(6)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(2, 60))] for _ in range(4)]
    alone = [steps(Runner(oracle, capacity=256), p, 8 + 2 * k, seed=k) for k, p in enumerate(prompts)]
    found, lockstep = together(lambda k, ls: steps(Runner(oracle, capacity=256, lockstep=ls), prompts[k], 8 + 2 * k,
                                                   seed=k), len(prompts), cohort=cohort)
    assert lockstep.counts.widest >= 2
    for k, (mine, theirs) in enumerate(zip(found, alone)):
        assert len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs)), k


@pytest.mark.parametrize("cohort", [False, True], ids=["threads", "cohort"])
def test_a_step_is_priced_for_the_sequences_in_its_company_and_no_more(tiny_dir, cohort):
    """A runner's company (what a step is priced for) counts the sequences taking part. A cohort's turn holds the
    shared forward back until its sequences have handed in, but is none: counted, a lone request in a server of
    several slots was priced as one of two and barely speculated (the Qwen pair: 1.1 tokens an oracle forward
    against 4.3-4.7 with one slot)."""
    oracle, _ = load_pair(tiny_dir, "gpt2", dtype=torch.bfloat16)

    def work(k, lockstep):
        runner, seen = Runner(oracle, capacity=128, lockstep=lockstep), []
        for n in range(6):
            seen.append(runner.company())
            runner.forward([5 + n], commit=1)
        return seen

    alone, _ = together(work, 1, cohort=cohort)
    assert alone == [[1] * 6]
    crowd, lockstep = together(work, 3, cohort=cohort)
    assert all(1 <= c <= 3 for seen in crowd for c in seen) and max(max(seen) for seen in crowd) == 3, crowd


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layers_that_are_one_call_alone_are_one_call_in_company_with_the_same_bits(tiny_dir, arch, monkeypatch):
    """Where a runner's layers run as one native call each (GPT-2's packed blocks; a Llama on spec's int4
    products), a shared forward's do too, every part attending to its own cache in the call: each row gets the
    bits it gets alone."""
    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    oracle, _ = load_pair(tiny_dir, arch, dtype=torch.bfloat16)
    if arch == "llama":
        assert quant.quantize_model(oracle, "int4") > 0  # (a Llama's layer is one call on spec's products)
    calls = []
    for kind in (backends.GPT2, backends.Llama):
        monkeypatch.setattr(kind, "run_fused_parts", lambda self, *args, _run=kind.run_fused_parts:
                            calls.append(args[0]) or _run(self, *args))
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(2, 90))] for _ in range(4)]
    alone = [steps(Runner(oracle, capacity=512), p, 8 + 2 * k, seed=k) for k, p in enumerate(prompts)]
    assert not calls
    found, lockstep = together(lambda k, ls: steps(Runner(oracle, capacity=512, lockstep=ls), prompts[k], 8 + 2 * k,
                                                   seed=k), len(prompts))
    assert lockstep.counts.widest >= 3 and set(calls) == set(range(oracle.config.num_hidden_layers))
    for k, (mine, theirs) in enumerate(zip(found, alone)):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert torch.equal(a, b), (k, i)


def test_float32_rows_in_company_round_as_float32_products_do(tiny_dir):
    """Float32's products round by how many rows share them (as a verified chain's do): close, not bitwise."""
    oracle, _ = load_pair(tiny_dir, "gpt2")
    prompts = [[3, 4, 5, 6] * k for k in (1, 5, 9)]
    alone = [steps(Runner(oracle, capacity=512), p, 8, seed=1) for p in prompts]
    found, _ = together(lambda k, ls: steps(Runner(oracle, capacity=512, lockstep=ls), prompts[k], 8, seed=1), 3)
    for mine, theirs in zip(found, alone):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_runners_of_one_model_share_its_packed_weights(tiny_dir):
    oracle, draft = load_pair(tiny_dir, "llama", dtype=torch.bfloat16)
    lockstep = Lockstep()
    a, b, c = (Runner(m, capacity=64, lockstep=lockstep) for m in (oracle, oracle, draft))
    assert a.lean is b.lean and a.lean is not c.lean and a.lockstep is lockstep
    assert Runner(oracle, capacity=64, compile=True, lockstep=lockstep).lockstep is None  # compiled: alone


@pytest.mark.parametrize("cohort", [False, True], ids=["threads", "cohort"])
def test_an_error_in_a_shared_forward_reaches_every_thread_and_the_next_forwards_run(tiny_dir, cohort, monkeypatch):
    oracle, _ = load_pair(tiny_dir, "gpt2", dtype=torch.bfloat16)
    real, calls = Lockstep._forward, []

    def failing_once(self, group):
        calls.append(len(group))
        if len(calls) == 2:
            raise RuntimeError("a kernel failed")
        return real(self, group)

    monkeypatch.setattr(Lockstep, "_forward", failing_once)

    def work(k, lockstep):
        runner, failed = Runner(oracle, capacity=64, lockstep=lockstep), None
        for tokens in ([1, 2, 3], [4], [5], [6]):
            try:
                runner.forward(tokens, commit=len(tokens))
            except RuntimeError as e:
                assert runner.length == 0  # its cache no longer trusted: emptied
                failed = str(e)
        return failed, runner.forward([1, 2], commit=2).logits.shape

    found, lockstep = together(work, 3, cohort=cohort)
    failed = [f for f, _ in found if f is not None]
    assert len(failed) == calls[1] and set(failed) == {"a kernel failed"}  # every sequence of that forward
    assert lockstep.busy == 0 and not lockstep.pending


@pytest.fixture(scope="module")
def bf16_profile(tiny_dir, tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("slots"), "tiny-slots",
                         f'oracle = "{tiny_dir / "llama-oracle"}"\ndraft = "{tiny_dir / "llama-draft"}"\n'
                         'dtype = "bfloat16"\n[decoding]\nmethod = "staged"\nmax_new_tokens = 40\n')


@pytest.fixture(scope="module")
def bf16_pair(bf16_profile):
    return Engine(profile_store.load(str(bf16_profile)), need_draft=True)


CASES = [  # (method, temperature, seed): greedy and coupled sampling, each method
    ("baseline", 0.0, None), ("speculative", 0.0, None), ("staged", 0.0, None), ("staged", 0.9, 11),
    ("speculative", 0.9, 12), ("baseline", 0.9, 11), ("staged", 0.0, None), ("staged", 0.9, 13),
]


@pytest.mark.parametrize("cohort", [False, True], ids=["threads", "cohort"])
def test_slots_decode_every_method_to_the_text_it_has_alone(bf16_pair, cohort):
    """Slots of one engine, each its own method, sampling and seed and prompt length (their sequences end at
    different steps, so others leave while the rest decode): each the tokens the engine gives alone."""
    engine = bf16_pair
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(1, 90))] for _ in CASES]

    def plan(k, of=engine):
        method, temperature, seed = CASES[k]
        settings = engine.profile.decoding.replace(method=method, temperature=temperature, top_k=20, seed=seed,
                                                   max_new_tokens=16 + 4 * k)
        return of.plan(settings)

    alone = [complete(engine, prompts[k], plan(k)).tokens for k in range(len(CASES))]
    assert len({tuple(a) for a in alone}) == len(CASES)  # (different texts: a mix-up would show)

    def work(k, lockstep):
        slot = engine.slot(lockstep)
        return complete(slot, prompts[k], plan(k, slot)).tokens

    found, lockstep = together(work, len(CASES), cohort=cohort)
    assert found == alone
    assert lockstep.counts.widest >= 4


def test_a_lone_oracles_slots_with_a_trigram_give_each_request_its_text_alone(tiny_dir, tmp_path):
    """One model alone in slots, draft2 a trigram fitted on its own greedy text (so its guesses are verified and
    often taken): greedy and coupled sampling, each request the tokens it has alone."""
    from spec_cli.core.settings import ModelRef, Profile
    from spec_cli.draft2.ngram import KatzTrigram

    engine = Engine(Profile("lone", "", ModelRef(str(tiny_dir / "llama-oracle"), dtype="bfloat16"), None))
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    greedy = engine.profile.decoding.replace(method="baseline", max_new_tokens=30, temperature=0.0)
    texts = [p + complete(engine, p, engine.plan(greedy)).tokens for p in prompts]
    KatzTrigram.fit(texts, vocab_size=engine.vocab_size).save(tmp_path / "own.npz")

    def plan(k, of=engine):
        settings = engine.profile.decoding.replace(method="staged", max_new_tokens=30, tree_adaptive=False,
                                                   temperature=0.0 if k % 2 else 0.9, top_k=20, seed=k)
        return of.plan(settings, draft2=f"prompt-lookup+{tmp_path / 'own.npz'}")

    alone = [complete(engine, prompts[k], plan(k)) for k in range(len(prompts))]
    assert sum(a.stats.by_stage.get("trigram", 0) for a in alone) > 20

    def work(k, lockstep):
        slot = engine.slot(lockstep)
        return complete(slot, prompts[k], plan(k, slot)).tokens

    found, lockstep = together(work, len(prompts))
    assert found == [a.tokens for a in alone]
    assert lockstep.counts.widest >= 3


def test_the_cost_of_a_row_is_fitted_on_the_shared_forwards_and_refitted_after_each():
    import time
    from types import SimpleNamespace

    from spec_cli.exec.lockstep import Handed

    lockstep, lean, other = Lockstep(), object(), object()

    def forward(model, rows: int, seconds: float) -> None:  # one shared forward counted, as `_forward` counts it
        handed = Handed(SimpleNamespace(lean=model), [0] * rows, None, rows, False, None)
        lockstep._count([handed], time.perf_counter() - seconds)

    assert lockstep.row_seconds(lean) is None
    for rows in (8,) * 10:  # one size only: nothing to fit
        forward(lean, rows, 0.05)
    assert lockstep.row_seconds(lean) is None
    for rows in (1, 4, 8, 16, 3, 9, 2, 30) * 8:
        forward(lean, rows, 0.020 + 0.003 * rows)
        forward(other, 4, 0.5)  # (another model's forwards are its own)
    assert lockstep.row_seconds(lean) == pytest.approx(0.003, rel=1e-3)
    assert lockstep.row_seconds(other) is None
    for _ in range(64):  # the last 64 forwards count: a row costs more now
        forward(lean, 2, 0.020 + 0.010 * 2)
        forward(lean, 12, 0.020 + 0.010 * 12)
    assert lockstep.row_seconds(lean) == pytest.approx(0.010, rel=1e-3)


def test_a_slots_controllers_keep_nothing_and_measure_whether_speculating_pays_themselves(tmp_path):
    from spec_cli.decoding import adapt, learned

    key = {"oracle": "o", "drafter": "d"}
    kept = learned.Controllers(key)
    from spec_cli.decoding.sampling import Sampler

    mode = ("greedy", Sampler(0.0, 0, 1.0))
    controller = kept[mode]
    controller.oracle.add(1, 0.01)
    controller.spec_tokens, controller.spec_seconds = 30.0, 0.1
    controller.plain.extend([0.01] * 3)
    kept.save()
    slot = learned.Controllers(key, persist=False)
    theirs = slot[mode]
    assert theirs.oracle(1) == pytest.approx(0.01)  # costs kept
    assert theirs.spec_rate is None and theirs.plain_rate is None  # rates measured anew
    theirs.oracle.add(1, 0.5)
    before = learned.path(key).read_text()
    slot.save()
    assert learned.path(key).read_text() == before and isinstance(theirs, adapt.Controller)


def test_a_crowd_of_prompts_is_read_a_few_at_a_time_and_every_sequence_still_gets_its_bits(tiny_dir, monkeypatch):
    """A round reads at most `prompt_rows` of prompts (the rest wait, first come first); the steps of those
    already decoding are never held back."""
    oracle, _ = load_pair(tiny_dir, "llama", dtype=torch.bfloat16)
    real, rounds = Lockstep._forward, []

    def watched(self, group):
        rounds.append((sum(len(h.batch) for h in group if h.reading), sum(not h.reading for h in group)))
        return real(self, group)

    monkeypatch.setattr(Lockstep, "_forward", watched)
    rng = random.Random(8)
    prompts = [[rng.randrange(1, 300) for _ in range(48 + 16 * k)] for k in range(5)]  # (pieces of 16 rows)
    alone = [steps(Runner(oracle, capacity=512), p, 12, seed=k) for k, p in enumerate(prompts)]
    found, lockstep = together(lambda k, ls: steps(Runner(oracle, capacity=512, lockstep=ls), prompts[k], 12, seed=k),
                               len(prompts), piece=16, prompt_rows=16)
    assert all(torch.equal(a, b) for mine, theirs in zip(found, alone) for a, b in zip(mine, theirs))
    assert max(read for read, _ in rounds) == 16  # one prompt piece a forward
    assert any(read and stepping for read, stepping in rounds)  # beside the others' steps


def test_a_slot_keeps_its_sequence_in_the_prefix_cache_for_the_next_request_on_another_slot(bf16_profile):
    engine = Engine(profile_store.load(str(bf16_profile)), need_draft=True, prefix_cache=1 << 24)
    lockstep = Lockstep()
    first, second = engine.slot(lockstep), engine.slot(lockstep)
    prompt = [(5 * i + 1) % 290 + 1 for i in range(60)]
    settings = engine.profile.decoding.replace(method="baseline", max_new_tokens=12)
    with lockstep.taking_part():
        said = complete(first, prompt, first.plan(settings), reuse=True).tokens
    first.remember()
    store = engine.prefix_caches()["oracle"]
    hits = store.hits
    with lockstep.taking_part():
        done = complete(second, prompt + said + [7, 8], second.plan(settings), reuse=True)
    assert store.hits == hits + 1 and done.stats.prompt_tokens <= 3  # only what follows the kept sequence
    fresh = Engine(profile_store.load(str(bf16_profile)), need_draft=True)
    assert done.tokens == complete(fresh, prompt + said + [7, 8], fresh.plan(settings)).tokens


def test_a_servers_slots_warm_up_together_and_keep_nothing(bf16_profile):
    """`Worker.warm` (as serving starts): every slot decodes a few tokens at once with the others, so each
    built its runners and their forwards were shared; nothing went into the prefix caches, and a request after
    it, sharing part of the warm-up's prompt, gets the tokens it gets alone."""
    from spec_cli.serve.worker import Worker

    engine = Engine(profile_store.load(str(bf16_profile)), need_draft=True, prefix_cache=1 << 24)
    lines = []
    worker = Worker(engine, engine.plan, lines.append, parallel=4)
    ids = [(7 * i + 3) % 290 + 1 for i in range(40)]
    plan = engine.plan(engine.profile.decoding.replace(method="staged"))
    try:
        worker.warm(ids, plan, tokens=8)
        assert worker.warmed.wait(timeout=60)
        assert len(lines) == 1 and lines[0].startswith("4 slots warmed up in")
        worker.start()  # (what serving does next: it starts no thread twice)
        assert all(slot._runners for slot in worker.engines)
        assert worker.lockstep.counts.widest >= 2
        assert all(store.bytes == 0 for store in engine.prefix_caches().values())
        prompt = ids[:20] + [5, 6, 7]
        settings = engine.profile.decoding.replace(method="staged", max_new_tokens=12)
        slot = worker.engines[0]
        with worker.lockstep.taking_part():
            got = complete(slot, prompt, slot.plan(settings), reuse=True).tokens
        fresh = Engine(profile_store.load(str(bf16_profile)), need_draft=True)
        assert got == complete(fresh, prompt, fresh.plan(settings.replace(method="baseline"))).tokens
    finally:
        worker.stop()
        worker.join(timeout=10)
    assert not worker.thread.is_alive()


def test_a_request_that_comes_while_the_slots_warm_up_ends_the_warm_up(bf16_profile):
    from spec_cli.serve.worker import Worker

    class Gone:  # (a request whose client left: the slot that takes it drops it)
        cancelled = threading.Event()

    Gone.cancelled.set()
    engine = Engine(profile_store.load(str(bf16_profile)), need_draft=True)
    worker = Worker(engine, engine.plan, [].append, parallel=4)
    worker.submit(Gone())
    try:
        worker.warm([(7 * i + 3) % 290 + 1 for i in range(40)], engine.plan(engine.profile.decoding), tokens=500)
        assert worker.warmed.wait(timeout=60)
        held = [slot._runners["oracle"][0].committed for slot in worker.engines]
        assert all(n <= 40 + 8 for n in held), held  # (its first step or two, not 500 tokens)
    finally:
        worker.stop()
        worker.join(timeout=10)


def test_requests_one_after_another_go_to_the_slot_that_served_the_last(bf16_profile, monkeypatch):
    """A free slot that served last takes the next request: its controllers are priced for the company it is in
    and its cache holds the last text (handed round every slot in turn, the Qwen pair's lone requests behind a
    server read 23 tok/s against 42: each slot's controllers priced for the crowd of its warm-up)."""
    from spec_cli.serve.worker import Worker

    class Request:
        def __init__(self):
            self.cancelled, self.done, self.held = threading.Event(), threading.Event(), None

    engine = Engine(profile_store.load(str(bf16_profile)), need_draft=True)
    served = []
    monkeypatch.setattr(Worker, "_run", lambda self, job, slot: served.append(slot) or job.done.set())
    worker = Worker(engine, engine.plan, [].append, parallel=3)
    worker.start()
    try:
        for _ in range(4):
            request = Request()
            worker.submit(request)
            assert request.done.wait(timeout=10)
    finally:
        worker.stop()
        worker.join(timeout=10)
    assert len(served) == 4 and all(slot is served[0] for slot in served)


def test_requests_that_come_together_are_read_in_one_forward(bf16_profile, monkeypatch):
    """Requests waiting as the slots' thread turns to them start together: their prompts are read in one shared
    forward, not one forward each (each would wait for the ones before), and each gets its text alone."""
    from spec_cli.serve.worker import Worker

    engine = Engine(profile_store.load(str(bf16_profile)), need_draft=True)
    settings = engine.profile.decoding.replace(method="baseline", max_new_tokens=6)
    prompts = [[(5 * i + k) % 290 + 1 for i in range(20 + 7 * k)] for k in range(3)]

    class Request:
        endpoint, stops, strip, stop_ids = "test", [], False, frozenset()

        def __init__(self, ids):
            self.encode, self.settings, self.held = (lambda: ids), settings, None
            self.cancelled, self.messages = threading.Event(), []

        def post(self, message):
            self.messages.append(message)

    real, widths = Lockstep._count, []
    monkeypatch.setattr(Lockstep, "_count", lambda self, group, started: widths.append(len(group))
                        or real(self, group, started))
    worker = Worker(engine, engine.plan, [].append, parallel=3)
    requests = [Request(ids) for ids in prompts]
    for request in requests:
        worker.submit(request)
    worker.start()
    try:
        assert settled(lambda: sum(type(m).__name__ == "Done" for r in requests for m in r.messages), 3, 60) == 3
    finally:
        worker.stop()
        worker.join(timeout=10)
    assert widths[0] == 3  # (the three prompts in the first forward)
    for ids, request in zip(prompts, requests):
        done = request.messages[-1].result
        assert done.text == engine.tokenizer.decode(complete(engine, ids, engine.plan(settings)).tokens)


@pytest.mark.slow
def test_the_real_qwen_pair_in_slots_gives_every_request_the_oracle_alones_text(tmp_path):
    """Qwen2.5-Coder-1.5B and its 0.5B draft from their GGUF files (../shared/tools/fetch-models): four slots, staged
    with the draft, greedy and coupled sampling with a seed, each the text of the oracle alone (baseline)."""
    import os
    from pathlib import Path

    cache = Path.home() / ".cache" / "spec-models"
    oracle = os.environ.get("QWEN_1_5B") or str(cache / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    draft = os.environ.get("QWEN_0_5B") or str(cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    if not (Path(oracle).is_file() and Path(draft).is_file()):
        pytest.skip("the Qwen pair is not fetched (../shared/tools/fetch-models)")
    path = write_profile(tmp_path, "qwen", f'oracle = "{oracle}"\ndraft = "{draft}"\n[decoding]\nmax_new_tokens = 24\n')
    engine = Engine(profile_store.load(str(path)), need_draft=True)
    texts = ["def quicksort(xs):", "import json\n\ndef load(path):", "class Stack:\n    def __init__(self):",
             "def is_prime(n: int) -> bool:"]
    prompts = [engine.encode(t) for t in texts]
    samplings = [dict(temperature=0.0), dict(temperature=0.8, top_k=40, seed=3)] * 2

    def settings(k, method):
        return engine.profile.decoding.replace(method=method, max_new_tokens=24, **samplings[k])

    alone = [complete(engine, prompts[k], engine.plan(settings(k, "baseline"))).tokens for k in range(len(texts))]

    def work(k, lockstep):
        slot = engine.slot(lockstep)
        return complete(slot, prompts[k], slot.plan(settings(k, "staged"))).tokens

    found, lockstep = together(work, len(texts))
    assert found == alone and lockstep.counts.widest >= 2


def test_the_first_slot_warms_its_models_shapes_for_every_slot(bf16_profile, monkeypatch):
    """A warm-up builds the kernels a model's shapes need (oneDNN's, per row count) for the process, over the
    lean loop every slot's runner shares: the first slot to run a model warms it, the others do not (16 new
    slots' warm-ups held up a server's first crowd of requests). Each slot's text is still the engine's alone."""
    engine = Engine(profile_store.load(str(bf16_profile)), need_draft=True)
    warmed = []
    real = Runner.warm_up
    monkeypatch.setattr(Runner, "warm_up", lambda self, *a, **k: warmed.append(self) or real(self, *a, **k))
    lockstep = Lockstep()
    slots = [engine.slot(lockstep) for _ in range(3)]
    prompt = [(7 * i + 3) % 290 + 1 for i in range(40)]
    settings = engine.profile.decoding.replace(method="staged", max_new_tokens=12)
    alone = complete(engine, prompt, engine.plan(settings)).tokens
    warmed.clear()
    for k, slot in enumerate(slots):
        with lockstep.taking_part():
            assert complete(slot, prompt, slot.plan(settings)).tokens == alone
        assert len(warmed) == 2  # the first slot's oracle and draft, once
    assert {id(r.model) for r in warmed} == {id(engine.oracle.model), id(engine.load_draft().model)}


def test_a_slots_runner_rebuilt_larger_runs_no_second_warm_up(tmp_path, monkeypatch):
    """A slot's runner is rebuilt with a larger cache for a longer request; the lean loop all slots share is the
    same, its shapes warm: no slot warms again (a discarded shared key made every model warm once more)."""
    from tiny import make_model, make_noisy_copy, make_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    make_model(tmp_path / "oracle", "llama", len(tokenizer), layers=2, width=64, seed=1, context=1024,
               tokenizer=tokenizer)
    make_noisy_copy(tmp_path / "oracle", tmp_path / "draft", noise=0.1, seed=2)
    profile = write_profile(tmp_path, "long", f'oracle = "{tmp_path / "oracle"}"\ndraft = "{tmp_path / "draft"}"\n'
                                              'dtype = "bfloat16"\n[decoding]\nmethod = "staged"\n')
    engine = Engine(profile_store.load(str(profile)), need_draft=True)
    warmed = []
    real = Runner.warm_up
    monkeypatch.setattr(Runner, "warm_up", lambda self, *a, **k: warmed.append(self) or real(self, *a, **k))
    lockstep = Lockstep()
    slot = engine.slot(lockstep)
    settings = engine.profile.decoding.replace(max_new_tokens=12)
    short, long = ([(7 * i + 3) % 290 + 1 for i in range(n)] for n in (40, 400))
    with lockstep.taking_part():
        complete(slot, short, slot.plan(settings))
    assert len(warmed) == 2 and slot._runners["oracle"][0].capacity == 256
    with lockstep.taking_part():
        done = complete(slot, long, slot.plan(settings)).tokens
    assert slot._runners["oracle"][0].capacity == 512 and len(warmed) == 2  # (rebuilt; not warmed again)
    assert done == complete(engine, long, engine.plan(settings)).tokens


def test_one_openmp_team_computes_the_shared_forwards():
    """libgomp lets a waiting team spin only while it manages no more threads than the CPUs; past that its threads
    sleep and every parallel region wakes them through the kernel (pyfam's 16 slots: shared forwards twice as long).
    So the thread making a Lockstep gives back the team the models' loading made, and a thread taking part makes
    none: its own torch work runs in one thread, its count restored after."""
    from spec_cli.exec import openmp

    if openmp._libgomp() is None:
        pytest.skip("needs torch on libgomp")
    kept, threads = torch.get_num_threads(), 2
    torch.set_num_threads(threads)  # (the suite runs in one thread)
    try:
        teams(threads)
    finally:
        torch.set_num_threads(kept)


def test_the_team_given_back_is_torch_s_own_whatever_other_libgomp_a_wheel_brought():
    """sentencepiece's wheel vendors its own libgomp, which transformers' tokenizers load beside torch's, first in
    the process's maps: the teams given back must be torch's (taking the first, a server's slots computed with their
    loading thread's team kept: this file's team tests failed once a tokenizer had loaded sentencepiece)."""
    from spec_cli.exec import openmp

    theirs = "/site-packages/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"
    ours = "/site-packages/torch/lib/libgomp.so.1"
    assert openmp.torch_libgomp([theirs, ours], "/site-packages/torch") == ours
    assert openmp.torch_libgomp([theirs, "/usr/lib/libgomp.so.1"], "/site-packages/torch") == "/usr/lib/libgomp.so.1"
    assert openmp.torch_libgomp([theirs], "/site-packages/torch") == theirs
    assert openmp.torch_libgomp([], "/site-packages/torch") is None


def teams(threads: int) -> None:
    torch.ones(1 << 22).sum()  # (a parallel region: this thread's team exists)
    before = os_threads()
    lockstep = Lockstep()
    assert settled(os_threads, before - (threads - 1)) == before - (threads - 1)  # (its team's threads ended)
    seen = {}

    def slot():
        with lockstep.taking_part():
            started = os_threads()
            seen["inside"] = torch.get_num_threads()
            torch.ones(1 << 22).sum()
            seen["made"] = os_threads() - started
        seen["after"] = torch.get_num_threads()

    worker = threading.Thread(target=slot)
    worker.start()
    worker.join()
    assert seen == {"inside": 1, "made": 0, "after": threads}
    torch.ones(1 << 22).sum()  # (this thread's team, made anew when asked for)
    assert settled(os_threads, before) == before
