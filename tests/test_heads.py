"""Heads fitted on a model alone (`spec_cli.draft2.heads`): the state they read is the one the oracle's head read at
the row that chose the pending token, their guesses change no output, and `spec tune` fits them where staged
finds them."""

import pytest
import torch
from conftest import load_pair
from helpers import prompts, run, spec
from tiny import CORPUS

from spec_cli.core.events import Token, Verified
from spec_cli.decoding import staged as staged_module
from spec_cli.decoding.chain import Models
from spec_cli.draft2 import heads
from spec_cli.draft2.ngram import PromptLookup
from spec_cli.exec import Runner


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def oracle(request, tiny_dir):
    return load_pair(tiny_dir, request.param)[0]


def own_states(model, ids: list[int]) -> torch.Tensor:
    """[positions, width]: what the model's own head reads at each position (its base model's normed output)."""
    with torch.no_grad():
        return model.base_model(torch.tensor([ids])).last_hidden_state[0]


def test_the_runner_keeps_what_its_head_read_for_the_rows_it_returns(oracle):
    runner = Runner(oracle)
    ids = prompts(1, seed=4)[0] + [7, 8, 9]
    runner.forward(ids, commit=len(ids), last=2)
    assert runner.hidden is None  # (only when asked)
    runner.reset()
    runner.keeps_hidden = True
    result = runner.forward(ids, commit=len(ids), last=3)
    own = own_states(oracle, ids)
    assert runner.hidden.shape == (3, own.shape[-1])
    torch.testing.assert_close(runner.hidden, own[-3:], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        logits = oracle.get_output_embeddings()(runner.hidden).float()
    torch.testing.assert_close(result.logits, logits, atol=1e-4, rtol=1e-4)
    step = runner.forward([5], commit=1, last=1)  # a step's one row: the state after the pending token
    torch.testing.assert_close(runner.hidden[0], own_states(oracle, ids + [5])[-1], atol=1e-4, rtol=1e-4)
    assert step.logits.shape[0] == 1


class Spy:
    """Heads that note what they are given and guess tokens nobody writes (so every path is the lookup's)."""

    def __init__(self):
        self.given: list[tuple[torch.Tensor, int]] = []

    def guesses(self, hidden, token):
        self.given.append((hidden.clone(), token))
        return [heads.Guess(299, 0.9, [(298, 0.9)])]


def given_positions(model, prompt, out, spy):
    """For each state the heads were given: the position whose state it is (the nearest of the model's own), and
    whether it is that state and the token given with it the one the oracle chose there."""
    ids = prompt + out
    own = own_states(model, ids)
    found = []
    for hidden, token in spy.given:
        distances = (own - hidden).norm(dim=-1)
        i = int(distances.argmin())
        same = bool(distances[i] < 1e-3 * own[i].norm())  # (else a state of no position of the text: a rejected row)
        found.append((i, same and i + 1 < len(ids) and ids[i + 1] == token))
    return found


REPEATING = [5, 6, 7, 8, 9, 10, 11, 12] * 3  # (the lookup's guesses get accepted: steps of several tokens)


def test_staged_gives_the_heads_the_state_of_the_row_that_chose_the_pending_token(oracle):
    spy = Spy()
    models = Models(Runner(oracle), draft2=PromptLookup(), heads=spy)
    out, events = run(models, REPEATING, method="staged", max_new_tokens=40, tree_adaptive=False)
    assert not models.oracle.keeps_hidden  # (the completion over, nothing more kept)
    found = given_positions(oracle, REPEATING, out, spy)
    assert found and all(right for _, right in found), found
    positions = [i for i, _ in found]
    assert positions == sorted(positions) and positions[0] == len(REPEATING) - 1  # the prompt's last row first
    accepted = [e.accepted for e in events if isinstance(e, Verified) and e.verifier == "oracle"]
    assert any(accepted), "no step accepted a guess: the rows past the root went untested"
    assert any(b - a > 1 for a, b in zip(positions, positions[1:]))


def _parent_row(oracle_runner, chosen, verdict):  # a row too early: the accepted node's parent's
    row = chosen.index(verdict.path[-1]) if verdict.path else 0
    return oracle_runner.hidden[row].clone(), verdict.final


def _root_row(oracle_runner, chosen, verdict):  # always the root's row, whatever was accepted
    return oracle_runner.hidden[0].clone(), verdict.final


@pytest.mark.parametrize("bug", [_parent_row, _root_row], ids=["parent-row", "root-row"])
def test_the_state_test_catches_a_wrong_row(oracle, monkeypatch, bug):
    monkeypatch.setattr(staged_module, "_state", bug)
    spy = Spy()
    models = Models(Runner(oracle), draft2=PromptLookup(), heads=spy)
    out, _ = run(models, REPEATING, method="staged", max_new_tokens=40, tree_adaptive=False)
    found = given_positions(oracle, REPEATING, out, spy)
    assert not all(right for _, right in found)


@pytest.fixture(scope="module")
def fitted(tiny_dir):
    """Heads fitted on the tiny Llama's reads of the tiny corpus (and the reads)."""
    from transformers import AutoTokenizer

    model = load_pair(tiny_dir, "llama")[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    runner = Runner(model, capacity=128)
    reads = heads.read(runner, CORPUS * 40, tokenizer, tokens=128 * 40)
    return model, reads, heads.fit(reads, model, depth=2, epochs=20)  # (head 2 too: its guesses tested below)


def test_fitted_heads_guess_the_oracles_next_token_far_better_than_its_own_head_on_the_state(fitted):
    model, reads, saved = fitted
    train, held = reads.split(256)
    unfitted = heads.fit(train, model, epochs=0)  # (zero-initialised: the oracle's own head on the state)
    before = heads.agreement(heads.Heads(unfitted, model), held)
    after = heads.agreement(heads.Heads(saved, model), held)
    assert after > max(0.15, 5 * before), (before, after)
    assert len(saved["heads"]) == 2 and saved["tokens"] == reads.tokens.numel()


def test_heads_with_fitted_guesses_change_no_output_greedy_or_sampled(fitted):
    model, _, saved = fitted
    models = Models(Runner(model), draft2=PromptLookup(), heads=heads.Heads(saved, model))
    plain = Models(Runner(model))
    used = 0
    for prompt in prompts(4, seed=9) + [REPEATING]:
        for settings in (dict(), dict(temperature=0.9, top_k=20, seed=3, sampling="coupled")):
            want, _ = run(plain, prompt, method="baseline", max_new_tokens=32, **settings)
            got, events = run(models, prompt, method="staged", max_new_tokens=32, tree_adaptive=False, **settings)
            assert got == want
            used += sum(1 for e in events if isinstance(e, Token) and e.stage == "heads")
    assert used > 0  # (their guesses were verified, and some accepted)


class Noting:
    """Fitted heads that note each state and token they are given (one per sequence)."""

    def __init__(self, fitted):
        self.fitted, self.given = fitted, []

    def guesses(self, hidden, token):
        self.given.append((hidden.clone(), token))
        return self.fitted.guesses(hidden, token)


def test_a_servers_slots_give_the_heads_the_state_each_sequence_gives_them_alone(fitted, tiny_dir):
    """A model alone in a server's slots (`exec.lockstep`: their rows in shared forwards): each sequence's heads
    read, bit for bit in bfloat16, the states they read alone, and every text is its own (greedy and coupled)."""
    import random

    from test_lockstep import together

    from spec_cli.completion import complete
    from spec_cli.core.paths import write_whole
    from spec_cli.core.settings import Draft2Ref, ModelRef, Profile
    from spec_cli.engine import Engine

    _, _, saved = fitted
    oracle = ModelRef(str(tiny_dir / "llama-oracle"), dtype="bfloat16")
    write_whole(heads.path_for(oracle), lambda f: torch.save(saved, f))
    engine = Engine(Profile("alone", "", oracle, None, draft2=Draft2Ref("auto")))
    real = engine.heads()
    assert real is not None
    rng = random.Random(5)
    texts = [REPEATING[: rng.randint(4, 20)] + [rng.randrange(1, 300) for _ in range(rng.randint(0, 30))]
             for _ in range(5)]

    def plan(k, of):
        return of.plan(engine.profile.decoding.replace(method="staged", max_new_tokens=24, tree_adaptive=False,
                                                       temperature=0.0 if k % 2 else 0.9, top_k=20, seed=k))

    def noted(k, of):
        spy = Noting(real)
        of.heads = lambda fitted=None: spy  # (this sequence's own heads, noting what it gives them)
        return spy

    alone, spies = [], []
    for k, prompt in enumerate(texts):
        spies.append(noted(k, engine))
        alone.append(complete(engine, prompt, plan(k, engine)))
    assert sum(a.stats.by_stage.get("heads", 0) for a in alone) > 0

    together_spies = [None] * len(texts)

    def work(k, lockstep):
        slot = engine.slot(lockstep)
        together_spies[k] = noted(k, slot)
        return complete(slot, texts[k], plan(k, slot)).tokens

    found, lockstep = together(work, len(texts), cohort=True)
    assert found == [a.tokens for a in alone] and lockstep.counts.widest >= 3
    for k in range(len(texts)):
        mine, theirs = spies[k].given, together_spies[k].given
        assert [t for _, t in mine] == [t for _, t in theirs], k
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(mine, theirs)), k


def test_a_chat_begun_as_baseline_guesses_with_the_heads_once_it_turns_to_staged(fitted, tiny_dir):
    import io

    from rich.console import Console

    from spec_cli.chat import session as chat_session
    from spec_cli.chat import templates
    from spec_cli.core.paths import write_whole
    from spec_cli.core.settings import Decoding, Draft2Ref, ModelRef, Profile
    from spec_cli.engine import Engine

    _, _, saved = fitted
    oracle = ModelRef(str(tiny_dir / "llama-oracle"))
    write_whole(heads.path_for(oracle), lambda f: torch.save(saved, f))
    profile = Profile("alone", "", oracle, None, draft2=Draft2Ref("auto"))
    engine = Engine(profile, dtype="float32")
    plan = engine.plan(Decoding(method="baseline", max_new_tokens=16))
    quiet = Console(file=io.StringIO())
    chat = chat_session.Chat(engine, profile, plan.settings, templates.choose_template(profile, engine.tokenizer),
                             out=quiet, err=quiet, draft2=plan.draft2, heads=plan.heads)
    assert chat.send("def add(a, b):") is not None and ("heads",) not in engine._drafters  # (baseline: none)
    chat.command("/set method staged")
    spy = Noting(engine.heads())
    engine.heads = lambda fitted=None: spy
    assert chat.send("def sub(a, b):") is not None and spy.given  # (staged now: its steps read the heads)


def test_tune_fits_heads_for_a_model_alone_and_generate_uses_them(tiny_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from spec_cli.core.settings import ModelRef

    monkeypatch.setattr(heads, "TOKENS", 1024)
    monkeypatch.setattr(heads, "PIECE", 128)
    (tmp_path / "corpus").mkdir()
    for k in range(2):  # (the held-out part is read from a file none of whose text was fitted on)
        (tmp_path / "corpus" / f"{k}.py").write_text(f"# file {k}\n" + "".join(CORPUS[k::2]) * 30)
    held = []
    monkeypatch.setattr(heads, "agreement", lambda fitted, reads: held.append(reads) or 0.5)
    oracle = str(tiny_dir / "llama-oracle")
    result = spec("tune", "--oracle", oracle, "--only", "heads", "--corpus", str(tmp_path / "corpus"))
    assert result.returncode == 0, result.stderr
    assert "heads" in result.stderr and "held-out" in result.stderr
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    starts = [tokenizer((tmp_path / "corpus" / f"{k}.py").read_text(), add_special_tokens=False)["input_ids"][:128]
              for k in range(2)]
    fitted_on = torch.load(heads.path_for(ModelRef(oracle)), weights_only=True)
    first = held[0].tokens[0].tolist()
    assert first in starts and fitted_on["tokens"] == 1024  # (a file's start, not the rest of the file fitted on)
    assert len(fitted_on["heads"]) == heads.DEPTH
    result = spec("generate", "--oracle", oracle, "-n", "24", "--json", "def add(a, b):")
    assert result.returncode == 0, result.stderr
    result = spec("tune", "--oracle", oracle, "--draft", str(tiny_dir / "llama-draft"), "--only", "heads")
    assert result.returncode == 0 and "for a model alone" in result.stderr


def test_the_engine_gives_heads_to_a_model_alone_with_draft2_auto_only(fitted, tiny_dir, monkeypatch):
    from spec_cli.core.paths import write_whole
    from spec_cli.core.settings import Decoding, Draft2Ref, ModelRef, Profile
    from spec_cli.engine import Engine

    _, _, saved = fitted
    oracle = ModelRef(str(tiny_dir / "llama-oracle"))
    auto = Draft2Ref("auto")
    staged = Decoding(method="staged", max_new_tokens=8)
    alone = Engine(Profile("alone", "", oracle, None, draft2=auto), dtype="float32")
    assert alone._models(alone.plan(staged), 64).heads is None  # (none fitted yet)
    assert "spec tune --only heads" in alone.heads_tip(alone.plan(staged))
    assert alone.heads_tip(alone.plan(staged, "none")) is None and alone.heads_tip(alone.plan(staged.replace(
        method="baseline"))) is None
    write_whole(heads.path_for(oracle), lambda f: torch.save(saved, f))
    alone = Engine(Profile("alone", "", oracle, None, draft2=auto), dtype="float32")
    out = list(alone.events([5, 6, 7], alone.plan(Decoding(method="baseline", max_new_tokens=8))))
    assert out and ("heads",) not in alone._drafters  # (baseline never loads them)
    plan = alone.plan(staged)
    assert alone._models(plan, 64).heads is not None and alone._models(alone.plan(staged, "none"), 64).heads is None
    assert alone.heads_tip(plan) is None
    out = list(alone.events([5, 6, 7], plan))
    assert out and not alone._runners["oracle"][0].keeps_hidden
    paired = Engine(Profile("pair", "", oracle, ModelRef(str(tiny_dir / "llama-draft")), draft2=auto),
                    dtype="float32")
    assert paired._models(paired.plan(staged), 64).heads is None and paired.heads_tip(paired.plan(staged)) is None


def test_ctrl_c_while_tune_reads_fits_on_what_was_read_and_stops_there(tiny_dir, tmp_path, monkeypatch):
    def texts(files, seed=0):
        yield from CORPUS * 8
        raise KeyboardInterrupt

    monkeypatch.setattr(heads, "corpus_texts", texts)
    monkeypatch.setattr(heads, "PIECE", 128)
    oracle = str(tiny_dir / "llama-oracle")
    (tmp_path / "prompt.txt").write_text("def add(a, b):")
    result = spec("tune", "--oracle", oracle, "--only", "heads,shape", "--prompts", str(tmp_path / "prompt.txt"))
    assert result.returncode == 130 and "interrupted" in result.stderr and "partial" in result.stderr
    from spec_cli.core.settings import ModelRef

    saved = torch.load(heads.path_for(ModelRef(oracle)), weights_only=True)
    assert 0 < saved["tokens"] < heads.TOKENS


def test_tune_notes_a_model_its_heads_cannot_run_on_and_goes_on_but_fails_when_asked_for_them(tiny_dir, tmp_path,
                                                                                             monkeypatch):
    from spec_cli.exec import backends

    monkeypatch.setattr(backends, "rows_of_head", lambda *args, **kwargs: None)  # (a head it cannot cut)
    oracle = str(tiny_dir / "llama-oracle")
    (tmp_path / "prompt.txt").write_text("def add(a, b):")
    result = spec("tune", "--oracle", oracle, "--only", "heads")
    assert result.returncode == 2 and "head it can cut" in result.stderr
    monkeypatch.setattr("spec_cli.tune.STEPS", ("heads", "draft2"))  # (every step that applies, quickly)
    result = spec("tune", "--oracle", oracle, "--corpus", str(tmp_path / "prompt.txt"))
    assert result.returncode == 0, result.stderr
    assert "no heads fitted" in result.stderr and "draft2" in result.stderr
