"""The runner's forward, positions, tree masks and KV bookkeeping against the Hugging Face model itself."""

import os
import random
import sys

import pytest
import torch
from conftest import load_pair

from spec_cli.exec import Runner


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_matches_hugging_face_generate(tiny_dir, arch):
    oracle, _ = load_pair(tiny_dir, arch)
    runner = Runner(oracle)
    prompt = [5, 17, 33, 2, 91]
    expected = oracle.generate(torch.tensor([prompt], device=oracle.device), max_new_tokens=30, min_new_tokens=30,
                               do_sample=False)
    tokens = list(prompt)
    logits = runner.forward(tokens, commit=len(tokens), last=1).logits
    for _ in range(30):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.forward(tokens[-1:], commit=1).logits
    assert tokens == expected[0].tolist()


def _reference_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_equals_each_path_run_alone(tiny_dir, arch, seed):
    """Every node of a random tree, scored in one forward, gets the logits of its own path run sequentially."""
    oracle, _ = load_pair(tiny_dir, arch)
    rng = random.Random(seed)
    runner = Runner(oracle)
    prefix = [rng.randrange(300) for _ in range(rng.randint(1, 12))]
    runner.forward(prefix, commit=len(prefix))
    # a random tree under the last committed token, in two forwards (like a draft growing it by depth)
    parents, tokens = [], []
    for _ in range(2):
        n = rng.randint(1, 7)
        start = runner.length
        layer_parents = [rng.choice([-1] + list(range(runner.committed, start))) for _ in range(n)]
        layer_tokens = [rng.randrange(300) for _ in range(n)]
        logits = runner.forward(layer_tokens, parents=layer_parents).logits
        for i, (p, t) in enumerate(zip(layer_parents, layer_tokens)):
            parents.append(p)
            tokens.append(t)
            path, slot = [t], p
            while slot >= 0:
                path.insert(0, tokens[slot - runner.committed])
                slot = parents[slot - runner.committed]
            expected = _reference_logits(oracle, prefix + path)[-1]
            torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_keep_gathers_the_accepted_path_and_drops_the_rest(tiny_dir, arch):
    oracle, _ = load_pair(tiny_dir, arch)
    runner = Runner(oracle)
    prefix = [3, 1, 4, 1, 5]
    runner.forward(prefix, commit=len(prefix))
    base = runner.committed
    # tree: a(-1) b(-1) c(a) d(b) e(d); keep b, d, e (slots not contiguous from the prefix)
    runner.forward([10, 20, 30, 40], parents=[-1, -1, base, base + 1])
    runner.forward([50], parents=[base + 3])
    runner.keep([base + 1, base + 3, base + 4])
    assert runner.committed == base + 3 and runner.length == base + 3
    after = runner.forward([60, 70], commit=2).logits
    expected = _reference_logits(oracle, prefix + [20, 40, 50, 60, 70])[-2:]
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)


def test_chain_of_scratch_then_partial_keep(tiny_dir):
    oracle, _ = load_pair(tiny_dir, "gpt2")
    runner = Runner(oracle)
    runner.forward([7, 8, 9], commit=3)
    runner.forward([11])
    runner.forward([12])
    runner.forward([13, 14])
    runner.keep([3, 4])  # keep 11, 12; drop 13, 14
    out = runner.forward([99], commit=1).logits
    torch.testing.assert_close(out, _reference_logits(oracle, [7, 8, 9, 11, 12, 99])[-1:], atol=1e-4, rtol=1e-4)


def test_runner_refuses_what_does_not_fit(tiny_dir):
    from spec_cli.core.errors import SpecError

    oracle, _ = load_pair(tiny_dir, "gpt2")
    runner = Runner(oracle, capacity=8)
    runner.forward(list(range(6)), commit=6)
    assert runner.room() == 2
    with pytest.raises(SpecError):
        runner.forward([1, 2, 3])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_committed_tail_and_tree_in_one_forward(tiny_dir, arch):
    """Tokens being committed stay causal among themselves while a tree hangs below them (a stale-mask bug)."""
    oracle, _ = load_pair(tiny_dir, arch)
    runner = Runner(oracle)
    runner.forward([9, 8], commit=2)
    tail = [7, 6, 5]
    logits = runner.forward(tail + [40, 41, 42], commit=3, parents=[-1, -1, 6]).logits
    full = _reference_logits(oracle, [9, 8, 7, 6, 5, 41, 42])
    torch.testing.assert_close(logits[:3], full[2:5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[3], _reference_logits(oracle, [9, 8, 7, 6, 5, 40])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[4:], full[5:], atol=1e-4, rtol=1e-4)


def test_grouped_queries_folded_into_rows_equal_repeated_keys():
    """GQA without SDPA's enable_gqa (the math kernel on CUDA): queries of a group share their keys (on a CPU
    the mask is additive, as the runner hands it)."""
    from spec_cli.exec.backends import additive, attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((8, 5), (2, 12), (2, 12)))
    mask = torch.rand(1, 1, 5, 12, generator=g) > 0.3
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(attend(q, k, v, additive(mask, q.dtype), 0.25), expected)
    torch.testing.assert_close(attend(q[:, :, :1], k, v, additive(mask[:, :, :1], q.dtype), 0.25), expected[:, :, :1])
    torch.testing.assert_close(attend(q, k, v, None, 0.25), torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), scale=0.25))


def test_a_long_prompt_runs_in_pieces_with_the_logits_of_one_forward(tmp_path):
    """A prompt longer than a piece is prefilled in pieces (no prompt x capacity mask), exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from spec_cli.exec import runner as runner_module

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=160, n_embd=32, n_layer=2, n_head=2)).eval()
    prompt = [random.Random(1).randrange(300) for _ in range(130)]
    runner = Runner(model)
    pieces = []
    real = Runner._run
    original, runner_module.CHUNK = runner_module.CHUNK, 48
    try:
        runner._run = lambda ids, host, *a: pieces.append(len(host)) or real(runner, ids, host, *a)
        logits = runner.forward(prompt, commit=len(prompt), last=2).logits
    finally:
        runner_module.CHUNK = original
    assert pieces == [48, 48, 34] and runner.committed == 130
    torch.testing.assert_close(logits, _reference_logits(model, prompt)[-2:], atol=1e-4, rtol=1e-4)
    after = runner.forward([7], commit=1).logits
    torch.testing.assert_close(after, _reference_logits(model, prompt + [7])[-1:], atol=1e-4, rtol=1e-4)


def test_a_refused_forward_changes_nothing(tiny_dir):
    """Checks come before any state changes (no assert that `python -O` would drop)."""
    oracle, _ = load_pair(tiny_dir, "gpt2")
    runner = Runner(oracle)
    runner.forward([1, 2, 3], commit=3)
    runner.forward([4, 5])
    state = (runner.committed, list(runner.tokens), list(runner.parents), list(runner.depths))
    for bad in (dict(tokens=[6], commit=1), dict(tokens=[6], parents=[0]), dict(tokens=[6], parents=[9])):
        with pytest.raises(ValueError):
            runner.forward(**bad)
        assert (runner.committed, runner.tokens, runner.parents, runner.depths) == state
    with pytest.raises(ValueError):
        runner.keep([4])  # not a path from the prefix
    assert (runner.committed, runner.tokens, runner.parents, runner.depths) == state


@pytest.mark.parametrize("seed", range(3))
def test_eager_masks_equal_the_traced_steps_masks(tiny_dir, seed):
    """What an eager step builds from what the host knows (a chain's start, where the scratch starts) is the
    mask the traced step builds from limits and ancestry alone: trees past one 32-bit word, committed rows
    before them, padding rows, chains."""
    from spec_cli.exec.batch import allowed, chain, packed

    oracle, _ = load_pair(tiny_dir, "gpt2")
    rng = random.Random(seed)
    runner = Runner(oracle)
    runner.forward([rng.randrange(300) for _ in range(rng.randint(1, 9))], commit=2 if seed else 1)
    cols = torch.arange(runner.capacity + 64, device=runner.device)
    for _ in range(4):  # a tree grown in forwards, then one with rows being committed before it
        n = rng.randint(5, 30)
        parents = [rng.choice([-1] + list(range(runner.committed, runner.length + i))) for i in range(n)]
        runner.forward([rng.randrange(300) for _ in range(n)], parents=parents)
    runner.keep([])
    tail, n = rng.randint(1, 3), rng.randint(40, 60)
    start = runner.length
    parents = [rng.choice([-1] + list(range(start + tail, start + tail + i))) for i in range(n)]
    layout = runner._layout(start, tail + n, runner.committed + tail, parents)
    for pad in (0, 3):
        rows = runner._rows([1] * (tail + n), start, pad, layout)
        span = start + tail + n + rng.randint(0, 40)
        traced, _ = packed(rows, None, [], runner.device)
        eager, _ = packed(rows, None, [], runner.device, scratch=runner.committed + tail)
        expected = allowed(traced, span, runner.slot_positions, [None, 8], cols)
        got = allowed(eager, span, runner.slot_positions, [None, 8], cols)
        assert any(bits >> 32 for *_, bits in layout) and expected[None][:, start + tail:].any()
        assert all(torch.equal(got[w], expected[w]) for w in expected)
    ids = torch.tensor([5, 6, 7, 8], device=runner.device)
    got = allowed(chain(ids, 11, 0, runner.capacity, eager=True), 20, runner.slot_positions, [None], cols)
    expected = allowed(chain(ids, 11, 0, runner.capacity), 20, runner.slot_positions, [None], cols)
    assert torch.equal(got[None], expected[None])


def test_the_lean_loop_runs_a_hooked_module_through_its_hooks(tiny_dir):
    """The lean loop calls modules' own forward directly, except where something hooks into them."""
    oracle, _ = load_pair(tiny_dir, "gpt2")
    calls = []
    handle = oracle.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *args: calls.append(1))
    try:
        Runner(oracle).forward([1, 2, 3], commit=3)
    finally:
        handle.remove()
    assert calls == [1]
    Runner(oracle).forward([1, 2, 3], commit=3)
    assert calls == [1]


def test_a_quantized_lean_loop_runs_exact_token_counts(tmp_path):
    """Where every layer's product is quantized (torch's integer kernels build nothing per shape, and cost by
    blocks of 4 rows), a bfloat16 forward is not padded to a bucket; a float one is, where oneDNN builds per
    shape (AMX or AVX-512 BF16)."""
    from tiny import make_model
    from transformers import AutoModelForCausalLM

    from spec_cli.core.hardware import cpu_has_fast_bf16
    from spec_cli.exec import quant
    from spec_cli.exec.shapes import power_buckets

    make_model(tmp_path / "llama", "llama", 300, layers=2, width=256, seed=1, init=0.1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()
    floating = Runner(model, capacity=64)
    assert floating.shapes.tokens == (power_buckets() if cpu_has_fast_bf16() else ())
    quant.quantize_model(model, "int4")
    assert Runner(model, capacity=64).shapes.tokens == ()


def test_a_cpu_is_named_with_its_family_where_its_name_gives_no_generation(monkeypatch):
    """Two VMs both called "AMD EPYC" (a Zen 4 and a Zen 5) are told apart, in reports and in tuned profiles' keys."""
    from spec_cli.core import hardware

    def info(fields):
        monkeypatch.setattr(hardware, "cpu_info", lambda field: fields.get(field))
        return hardware.cpu_name()

    assert info({"model name": "AMD EPYC", "cpu family": "26", "model": "2"}) == "AMD EPYC (family 26 model 2)"
    assert info({"model name": "AMD EPYC", "cpu family": "25", "model": "17"}) == "AMD EPYC (family 25 model 17)"
    xeon = "Intel(R) Xeon(R) Platinum 8488C"
    assert info({"model name": xeon, "cpu family": "6", "model": "143"}) == xeon


def _resident(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's memory the OS holds in RAM (mincore: pages never touched are not)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    first = tensor.data_ptr() - tensor.data_ptr() % page
    pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - first) // page)
    held = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), held) == 0
    return sum(b & 1 for b in held) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore as Linux has it")
def test_a_cache_is_resident_only_where_it_is_written(tmp_path):
    """An 8,192-slot cache (135 MB) costs time and resident memory only for the slots a sequence writes: its
    pages zeroed as they are first touched, not all written at once (a server slot's first request waited ~70 ms
    for the Qwen pair's 4,096-slot caches). The slots never written read as zeros all the same."""
    from tiny import make_model
    from transformers import AutoModelForCausalLM

    make_model(tmp_path / "llama", "llama", 300, layers=32, width=256, seed=1, context=8192)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()
    runner = Runner(model, capacity=8192)
    layers = [*runner.keys, *runner.values]
    cache = sum(t.numel() * t.element_size() for t in layers)
    assert cache >= 128 << 20 and sum(map(_resident, layers)) < cache / 64
    prompt = [5, 17, 33, 2, 91] * 8
    logits = runner.forward(prompt, commit=len(prompt)).logits
    assert torch.equal(logits, Runner(model, capacity=256).forward(prompt, commit=len(prompt)).logits)
    assert sum(map(_resident, layers)) < cache / 8
    assert all(bool((keys[..., len(prompt):8192, :] == 0).all()) for keys in runner.keys)  # (past: padding rows)


def test_the_model_s_own_modules_take_the_cache_by_the_keyword_their_forward_names(tiny_dir):
    """Through transformers' own modules (families without spec's layer loop) the runner hands its KV cache under
    the name the model's forward takes (transformers 5.x: `cache`; it warns on `past_key_values` and drops it in
    5.40), and reads back the logits the model gives itself."""
    import warnings

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "llama-oracle", dtype=torch.float32).eval()
    runner = Runner(model, lean=False)
    tokens = [5, 17, 3, 99, 42, 7]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        first = runner.forward(tokens[:4], commit=4, last=4).logits
        second = runner.forward(tokens[4:], commit=2, last=2).logits
    with torch.no_grad():
        own = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat([first, second]), own, rtol=1e-4, atol=1e-4)
