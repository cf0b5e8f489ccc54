"""A draft of another vocabulary (`models.translation`, `decoding.foreign`): its guesses translated through their
text; the output the oracle alone's, greedy, coupled and sampled (enumerated exactly)."""

import copy
import json

import pytest
import torch
from conftest import load_pair
from exact import (
    StandIn,
    exhaust,
    extended,
    first_tokens,
    max_difference,
    oracle_distribution,
    table,
)
from helpers import assert_clean_error, run, spec
from tiny import CORPUS, make_model, make_permuted_copy, make_tokenizer

from spec_cli.core.events import ACCEPTED, REJECTED, Token
from spec_cli.core.settings import Decoding
from spec_cli.decoding import chain
from spec_cli.decoding.chain import Models
from spec_cli.decoding.foreign import Pace
from spec_cli.decoding.methods import decode
from spec_cli.decoding.sampling import Sampler
from spec_cli.exec import Runner
from spec_cli.models.translation import Translator, difference

V = 4
PROMPT = [1, 2]


class Shuffled:
    """A translator between a vocabulary and the same one under shuffled ids, by id (no text): the foreign
    strategy then proposes exactly what speculative proposes with the unshuffled draft."""

    def __init__(self, new: list[int], extra: list[int] = ()):
        self.new, self.old = new, {n: o for o, n in enumerate(new)}
        self.extra = list(extra)  # guesses past the draft's (a translation may give more tokens than proposed)

    def draft_ids(self, oracle_ids, known=()):
        return [self.new[t] for t in oracle_ids]

    def guesses(self, oracle_ids, draft_ids, proposed):
        assert draft_ids == self.draft_ids(oracle_ids[len(oracle_ids) - len(draft_ids):]), \
            "the draft's words must spell the oracle's text (its end, where the draft reads a long prompt's end)"
        return [self.old[t] for t in proposed] + self.extra


def _stand_ins(kind):
    scale, noise = {"spread": (0.8, 1.0), "peaked": (2.5, 1.5)}[kind]
    oracle = table(V, scale, seed=1)
    return oracle, table(V, scale, seed=2, like=oracle, noise=noise)


WARPS = {"t1": dict(temperature=1.0), "top-k-top-p": dict(temperature=0.8, top_k=3, top_p=0.8)}


@pytest.mark.parametrize("kind", ["spread", "peaked"])
@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("k,extra,lookup", [(1, [], False), (3, [], False), (2, [3, 0], False), (2, [], True)])
def test_translated_guesses_give_the_oracle_distribution_exactly(kind, warp, k, extra, lookup):
    """Sampling by the one-hot rule: the first three tokens, over as many steps as they take, enumerated (the
    draft's guesses, more than it proposed, and the lookup's where the text repeats)."""
    oracle, draft = _stand_ins(kind)
    new = [2, 0, 3, 1]
    by_old = torch.tensor([new.index(i) for i in range(V)])  # the old id of each new one
    shuffled = draft[by_old][:, by_old][:, :, by_old]  # the draft's table in its own ids
    models = Models(StandIn(oracle), StandIn(shuffled), translator=Shuffled(new, extra))
    settings = dict(method="speculative", draft_tokens=k, max_new_tokens=4, seed=0, tree_adaptive=False,
                    lookup=lookup, **WARPS[warp])
    sampler = Sampler(settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0))
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2] if lookup else PROMPT  # (one that repeats: the lookup guesses 3, 0, ...)
    got = exhaust(lambda draws: first_tokens(models, prompt, 3, False, draws, **settings))
    expected = oracle_distribution(oracle, prompt, 3, sampler)
    assert max_difference(extended(got, oracle, prompt, 3, sampler), expected) < 1e-9


@pytest.fixture(scope="module")
def shuffled_pair(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shuffled")
    new = make_permuted_copy(tiny_dir / "gpt2-draft", folder / "draft", seed=3)
    oracle, draft = load_pair(tiny_dir, "gpt2")
    from transformers import AutoModelForCausalLM

    foreign = AutoModelForCausalLM.from_pretrained(folder / "draft", dtype=torch.float32).eval()
    return oracle, draft, foreign, new, folder / "draft"


def _kinds(events):
    return [(e.token, e.kind) for e in events if isinstance(e, Token)]


def test_a_shuffled_draft_proposes_what_the_draft_does(shuffled_pair, monkeypatch):
    """Event for event what speculative gives with the unshuffled draft: the foreign draft's cache (what it
    keeps of its proposals, what it reads next) holds what the draft's would, and it reads no more again."""
    oracle, draft, foreign, new, _ = shuffled_pair
    plain = Models(Runner(oracle), Runner(draft))
    translated = Models(Runner(oracle), Runner(foreign), translator=Shuffled(new))
    reread = {draft: 0, foreign: 0}  # rows beyond one a forward: text read again, or read late
    real = Runner.forward

    def forward(self, tokens, *args, **kwargs):
        if self.model in reread:
            reread[self.model] += (tokens.numel() if isinstance(tokens, torch.Tensor) else len(tokens)) - 1
        return real(self, tokens, *args, **kwargs)

    monkeypatch.setattr(Runner, "forward", forward)
    accepted = rejected = 0
    for prompt in ([5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [7]):
        for k in (1, 3, 5):
            expected, events = run(plain, prompt, method="speculative", max_new_tokens=40, draft_tokens=k)
            got, mine = run(translated, prompt, method="speculative", max_new_tokens=40, draft_tokens=k,
                            tree_adaptive=False, lookup=False)
            assert got == expected and _kinds(mine) == _kinds(events), (prompt, k)
            accepted += sum(kind == ACCEPTED for _, kind in _kinds(mine))
            rejected += sum(kind == REJECTED for _, kind in _kinds(mine))
    assert accepted > 100 and rejected > 10
    assert reread[foreign] <= reread[draft]


def test_a_shuffled_draft_reads_a_long_prompts_end_as_the_draft_does(shuffled_pair, monkeypatch):
    """Both drafts read only the prompt's last 6 tokens (`chain.DRAFT_READS`), from the same place of the text:
    event for event the same, and the text is the oracle's."""
    oracle, draft, foreign, new, _ = shuffled_pair
    monkeypatch.setattr(chain, "DRAFT_READS", 6)
    plain = Models(Runner(oracle), Runner(draft))
    translated = Models(Runner(oracle), Runner(foreign), translator=Shuffled(new))
    accepted = rejected = 0
    for prompt in ([5, 17, 33, 9, 12, 40, 41, 42, 43, 44, 45, 46, 7], list(range(60, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 3):
        expected, events = run(plain, prompt, method="speculative", max_new_tokens=40, draft_tokens=3)
        got, mine = run(translated, prompt, method="speculative", max_new_tokens=40, draft_tokens=3,
                        tree_adaptive=False, lookup=False)
        baseline, _ = run(plain, prompt, method="baseline", max_new_tokens=40)
        assert got == expected == baseline and _kinds(mine) == _kinds(events), prompt
        assert plain.draft.base == len(prompt) - 6 and translated.draft.tokens[:6] == [new[t] for t in prompt[-6:]]
        accepted += sum(kind == ACCEPTED for _, kind in _kinds(mine))
        rejected += sum(kind == REJECTED for _, kind in _kinds(mine))
    assert accepted > 10 and rejected > 10


@pytest.fixture(scope="module")
def text_pair(shuffled_pair, tiny_dir):
    from transformers import AutoTokenizer

    oracle, _, foreign, _, folder = shuffled_pair
    words = Translator(AutoTokenizer.from_pretrained(tiny_dir / "gpt2-oracle"), AutoTokenizer.from_pretrained(folder))
    return words, Models(Runner(oracle), Runner(foreign), translator=words)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_k=5, sampling="coupled", seed=4)])
def test_guesses_translated_through_text_give_the_oracles_tokens(text_pair, sampling):
    words, models = text_pair
    accepted = 0
    for text in CORPUS:
        prompt = words.oracle.encode(text[:25])
        expected, _ = run(models, prompt, method="baseline", max_new_tokens=40, **sampling)
        got, events = run(models, prompt, method="speculative", max_new_tokens=40, draft_tokens=4, **sampling)
        assert got == expected, text
        accepted += sum(kind == ACCEPTED for _, kind in _kinds(events))
    assert accepted > 0  # (random models write words in other tokens than their tokenizer would: few match)


def test_in_bfloat16_the_translated_guesses_give_the_oracles_tokens(shuffled_pair, tiny_dir):
    """The dtype a CPU with fast bfloat16 runs by default: greedy output identical to baseline's in it too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, _, _, folder = shuffled_pair
    oracle = AutoModelForCausalLM.from_pretrained(tiny_dir / "gpt2-oracle", dtype=torch.bfloat16).eval()
    foreign = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    words = Translator(AutoTokenizer.from_pretrained(tiny_dir / "gpt2-oracle"), AutoTokenizer.from_pretrained(folder))
    models = Models(Runner(oracle), Runner(foreign), translator=words)
    accepted = 0
    for text in CORPUS:
        prompt = words.oracle.encode(text[:25])
        expected, _ = run(models, prompt, method="baseline", max_new_tokens=40)
        got, events = run(models, prompt, method="speculative", max_new_tokens=40, draft_tokens=4)
        assert got == expected, text
        accepted += sum(kind == ACCEPTED for _, kind in _kinds(events))
    assert accepted > 0


def test_a_conversation_reuses_the_foreign_drafts_cache(text_pair):
    """A chat's next turn: the draft keeps what it read of the earlier text, and the text is baseline's."""
    words, models = text_pair
    first = words.oracle.encode("def fib(n):\n")
    reply, _ = run(models, first, method="speculative", max_new_tokens=20)
    kept = models.draft.committed
    follow = first + reply + words.oracle.encode("\nclass Stack:\n")
    events = list(decode(models, follow, Decoding(method="speculative", max_new_tokens=20), reuse=True))
    got = [e.token for e in events if isinstance(e, Token) and e.output]
    fresh = copy.copy(models)
    fresh.oracle, fresh.draft = Runner(models.oracle.model), Runner(models.draft.model)
    expected, _ = run(fresh, follow, method="baseline", max_new_tokens=20)
    assert got == expected and kept > 5


def test_translation_keeps_a_word_cut_at_the_boundary_whole(tmp_path):
    oracle = make_tokenizer(tmp_path / "a")
    draft = make_tokenizer(tmp_path / "b", vocab_size=270)
    words = Translator(oracle, draft)
    assert difference(oracle, draft) and difference(oracle, oracle) is None
    text = "def fib(n):\n    if n < 2:\n        return n\n"
    ids = oracle.encode(text)
    assert draft.decode(words.draft_ids(ids)) == text  # the draft reads the same text
    for cut in range(1, len(ids)):  # ... from its tokens of an earlier text, encoding only what follows them
        known = words.draft_ids(ids[:cut])
        again = words.draft_ids(ids, known)
        assert draft.decode(again) == text and again[: max(0, len(known) - 8)] == known[: max(0, len(known) - 8)]
    assert draft.decode(words.draft_ids(ids, draft.encode("something else entirely"))) == text
    cut = 13  # "def fib(n):\n " then the rest
    head = oracle.encode(text[:cut])
    proposed = draft.encode(text[cut:])  # what the draft would propose after the boundary
    guesses = words.guesses(head, words.draft_ids(head), proposed)
    assert oracle.decode(head + guesses) == text
    # the draft's guess of an unfinished character: left out, not guessed as a replacement character
    assert "\ufffd" not in oracle.decode(words.guesses(head, words.draft_ids(head), draft.encode("é")[:1]))


def _mismatched(tiny_dir, tmp_path):
    other = make_tokenizer(tmp_path / "other-tok", vocab_size=280)
    make_model(tmp_path / "other", "gpt2", len(other), layers=1, width=32, seed=5, tokenizer=other)
    path = tmp_path / "mismatch.toml"
    path.write_text(f'oracle = "{tiny_dir / "gpt2-oracle"}"\ndraft = "{tmp_path / "other"}"\n')
    return path


def test_a_draft_of_another_vocabulary_runs_from_the_command_line(tiny_dir, tmp_path):
    path = _mismatched(tiny_dir, tmp_path)
    ran = spec("generate", "-p", str(path), "def fib(n):", "-n", "24", "--json")
    alone = spec("generate", "-p", str(path), "def fib(n):", "-n", "24", "--json", "-m", "baseline")
    assert ran.returncode == 0 and "another vocabulary" in ran.stderr
    record = json.loads(ran.stdout)
    assert record["method"] == "speculative" and record["tokens"] == json.loads(alone.stdout)["tokens"]
    assert_clean_error(spec("generate", "-p", str(tmp_path / "none.toml"), "x"), "profile file not found")


def test_the_pace_follows_what_the_drafts_guesses_and_forwards_are_worth():
    pace = Pace(6)
    for _ in range(20):  # every guess kept, a draft forward a tenth of the oracle's
        pace.judge(6, 6)
        pace.timed(6, 0.06, 0.1)
    assert pace.length() == 6
    for _ in range(100):  # nothing kept: plain steps, a probe of 2 every PROBE of them
        pace.judge(2, 0)
    lengths = [pace.length() for _ in range(3 * Pace.PROBE)]
    assert lengths.count(2) == 3 and lengths.count(0) == 3 * Pace.PROBE - 3
    probes = []  # probes that keep nothing come twice as seldom each time, up to every SELDOM steps
    for step in range(1, 400):
        if pace.length():
            probes.append(step)
            pace.judge(2, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [2 * Pace.PROBE, 4 * Pace.PROBE, Pace.SELDOM] and set(gaps[3:]) == {Pace.SELDOM}
    costly = Pace(6)  # half kept, but a draft forward costs what the oracle's does: never worth it
    for _ in range(20):
        costly.judge(2, 1)
        costly.timed(1, 0.1, 0.1)
    assert costly.length() == 0


def test_tuning_with_a_draft_of_another_vocabulary_races_speculative_alone(tiny_dir, tmp_path):
    path = _mismatched(tiny_dir, tmp_path)
    prompt = tmp_path / "p.txt"
    prompt.write_text("def fib(n):")
    home = {"XDG_DATA_HOME": str(tmp_path / "data")}
    run = spec("tune", "-p", str(path), "--count", "1", "-n", "6", "--iterations", "1", "--prompts", str(prompt),
               "--json", env=home)
    assert run.returncode == 0, run.stderr
    assert "no draft2 to fit" in run.stderr
    record = json.loads(run.stdout)["record"]
    assert "draft2" not in record
    raced = {c["method"] for c in record["greedy"]["raced"] + record["greedy"]["final"]}
    assert "staged" not in raced and "speculative" in raced
