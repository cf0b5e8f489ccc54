"""benchmarks/scripts/lookup_bound.py's walk: the most tokens a step verifying the lookup's guesses can bring."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "lookup_bound.py"
spec = importlib.util.spec_from_file_location("lookup_bound", SCRIPT)
bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bound)


def test_a_copy_of_the_prompt_goes_a_whole_trie_a_step_and_new_text_one_token():
    prompt = list(range(1, 41))
    copy = list(range(1, 41))  # the text repeats the prompt: after its first token the lookup has it all
    steps, tokens, rows = bound.walk(prompt, copy, depth=8, branches=1, nodes=8)
    assert tokens == 40 and steps == 1 + -(-39 // 9)  # one token (nothing matches "40" yet), then 9 a step
    assert rows == 8 * (steps - 1)  # a chain of 8 guesses at every step but the first
    fresh = list(range(100, 140))  # nothing the text held before: every step is the oracle's one token
    assert bound.walk(prompt, fresh, 8, 4, 16) == (40, 40, 0)
    hits, runs = bound.first_guesses(prompt, copy)
    assert hits == 39 and runs == [39]


def test_a_wider_trie_follows_where_the_text_went_another_way_than_last_time():
    prompt = [8, 5, 7, 1, 2, 3, 8, 5, 7, 1, 2, 4, 8, 5, 7]  # after "8 5 7": "1 2 3" once, then "1 2 4"
    out = [1, 2, 3, 8]
    chain = bound.walk(prompt, out, depth=4, branches=1, nodes=4)  # the latest occurrence only: 4, wrong
    tree = bound.walk(prompt, out, depth=4, branches=2, nodes=8)  # both occurrences: 3 a child of 2 too
    assert chain[:2] == (2, 4) and tree[:2] == (1, 4)


def test_with_a_trigram_a_step_also_follows_its_chain_where_the_text_is_new():
    from spec_cli.draft2.ngram import KatzTrigram

    trigram = KatzTrigram.fit([[50, 51, 52, 53, 54, 55, 56, 57] * 20], vocab_size=200)
    prompt = [1, 2, 3]
    out = [50, 51, 52, 53, 54, 55, 56, 57]  # nothing the prompt holds; the trigram knows it all
    assert bound.walk(prompt, out, 8, 4, 64) == (8, 8, 0)
    steps, tokens, rows = bound.walk(prompt, out, 8, 4, 64, trigram)
    assert tokens == 8 and steps == 2 and rows > 0  # its chain of 4 and the token after it, twice
