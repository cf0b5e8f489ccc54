"""Every supported architecture, in float32, against its own Hugging Face implementation.

For each family (tests/archs.py: sliding windows shorter than the contexts used here, soft-capping, partial
rotary, MQA/GQA, parallel blocks, learned positions with an offset, biases, tied and untied heads):
greedy baseline equals `generate`; each node of a random tree scored in one forward equals its path run
alone, with exact and with padded/static shapes; speculative, staged and self are token-identical to
baseline; a chat turn reusing the cache equals a fresh run; a skipped sublayer is the identity.
"""

from __future__ import annotations

import random
import time

import archs
import pytest
import torch
from tiny import make_noisy_copy

from spec_cli.core.errors import SpecError
from spec_cli.core.events import Token
from spec_cli.core.families import Skip, check_architecture
from spec_cli.core.settings import Decoding
from spec_cli.decoding.chain import Models
from spec_cli.decoding.methods import decode
from spec_cli.exec import Runner, Shapes, backends, packing, power_buckets

PADDED = Shapes(power_buckets(), 0)  # what a compiled CPU step runs: token buckets, the whole capacity attended
ONE = Shapes.one(8)  # what a GPU runs: one shape (small here, so that trees go in pieces)
SLOW = pytest.mark.slow  # the families added later run their costlier variants with -m slow


def later(name):
    return [SLOW] if name in archs.ADDED else []


def rope(name):
    """A rope scaling's default checks are where positions matter (greedy, trees); the rest with -m slow."""
    return [SLOW] if name in archs.ROPES else []


TREES = [pytest.param(n, None, id=f"{n}-exact") for n in archs.ARCHITECTURES] + [
    pytest.param(n, PADDED, id=f"{n}-padded", marks=later(n)) for n in archs.ARCHITECTURES] + [
    pytest.param(n, ONE, id=f"{n}-one", marks=later(n)) for n in archs.ARCHITECTURES]
METHODS = [pytest.param(n, (3,) if later(n) else (3, 4), id=n, marks=rope(n)) for n in archs.ARCHITECTURES] + [
    pytest.param(n, (4,), id=f"{n}-seed4", marks=SLOW) for n in archs.ADDED]


def all_but_ropes():
    return [pytest.param(n, marks=rope(n)) for n in archs.ARCHITECTURES]


@pytest.fixture(scope="session")
def arch_dir(tmp_path_factory, tiny_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("archs")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    for name in archs.ARCHITECTURES:
        archs.make(root / f"{name}-oracle", name, len(tokenizer), tokenizer=tokenizer)
        make_noisy_copy(root / f"{name}-oracle", root / f"{name}-draft", noise=0.1, seed=2)
    return root


_loaded: dict = {}


def load(root, name, which="oracle", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    key = (str(root), name, which, dtype)
    if key not in _loaded:
        _loaded[key] = AutoModelForCausalLM.from_pretrained(root / f"{name}-{which}", dtype=dtype).eval()
    return _loaded[key]


def prompt(seed: int, length: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(length)]


def tokens_of(events) -> list[int]:
    return [e.token for e in events if isinstance(e, Token) and e.output]


def reference(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", archs.ARCHITECTURES)
def test_greedy_baseline_equals_hugging_face_generate(arch_dir, name):
    model = load(arch_dir, name)
    ids = prompt(1)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    models = Models(Runner(model), eos=frozenset([model.generation_config.eos_token_id]))
    got = tokens_of(decode(models, ids, Decoding(method="baseline", max_new_tokens=32)))
    assert got == expected
    assert len(got) > 20 and len(set(got)) > 3  # long enough to slide past the windows, not stuck repeating


@pytest.mark.parametrize("name,shapes", TREES)
def test_tree_forward_equals_each_path_run_alone(arch_dir, name, shapes):
    model = load(arch_dir, name)
    rng = random.Random(name)
    runner = Runner(model, shapes=shapes)
    prefix = prompt(2, rng.randint(14, 20))  # longer than the sliding windows
    committed = runner.forward(prefix, commit=len(prefix)).logits
    torch.testing.assert_close(committed, reference(model, prefix), atol=1e-4, rtol=1e-4)
    parents, tokens = [], []
    for _ in range(3):  # grown level by level, as a draft does
        n = rng.randint(1, 6)
        start = runner.length
        level_parents = [rng.choice([-1] + list(range(runner.committed, start))) for _ in range(n)]
        level_tokens = [rng.randrange(300) for _ in range(n)]
        logits = runner.forward(level_tokens, parents=level_parents).logits
        for i, (p, t) in enumerate(zip(level_parents, level_tokens)):
            parents.append(p)
            tokens.append(t)
            path, slot = [t], p
            while slot >= 0:
                path.insert(0, tokens[slot - runner.committed])
                slot = parents[slot - runner.committed]
            torch.testing.assert_close(logits[i], reference(model, prefix + path)[-1], atol=1e-4, rtol=1e-4)
    children = [i for i, p in enumerate(parents) if p == -1]
    kept = children[-1]  # a root child, maybe not the first slot: its entries are gathered to the prefix
    runner.keep([runner.committed + kept])
    after = runner.forward([7, 8], commit=2).logits
    torch.testing.assert_close(after, reference(model, prefix + [tokens[kept], 7, 8])[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,seeds", METHODS)
def test_every_method_is_token_identical_to_baseline(arch_dir, name, seeds):
    oracle, draft = load(arch_dir, name), load(arch_dir, name, "draft")
    models = Models(Runner(oracle), Runner(draft), self_skip=Skip.of([1], [0, 2]))
    rejected = 0
    for seed in seeds:
        ids = prompt(seed, 16)
        expected = tokens_of(decode(models, ids, Decoding(method="baseline", max_new_tokens=28)))
        for method, extra in (("speculative", dict(draft_tokens=3)), ("staged", {}), ("self", {})):
            events = list(decode(models, ids, Decoding(method=method, max_new_tokens=28, **extra)))
            assert tokens_of(events) == expected, (method, seed)
            rejected += sum(isinstance(e, Token) and not e.output for e in events)
    assert rejected > 0  # rollbacks were exercised


@pytest.mark.parametrize("name", all_but_ropes())
def test_a_chat_turn_reusing_the_cache_equals_a_fresh_run(arch_dir, name):
    oracle, draft = load(arch_dir, name), load(arch_dir, name, "draft")
    models = Models(Runner(oracle), Runner(draft))
    settings = Decoding(method="staged", max_new_tokens=12)
    first = prompt(5, 14)
    reply = tokens_of(decode(models, first, settings, reuse=True))
    second = first + reply + prompt(6, 5)
    assert models.oracle.tokens[: len(first)] == first  # the cache holds the first turn
    reused = tokens_of(decode(models, second, settings, reuse=True))
    fresh = tokens_of(decode(Models(Runner(oracle), Runner(draft)), second, settings))
    assert reused == fresh


def _zeroing_hooks(runner: Runner, skip: Skip) -> list:
    """An independent reference for skipping: run the sublayer, then replace its output with zeros."""
    from spec_cli.core.families import ATTENTION_NAMES, MLP_NAMES

    def zero(module, args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]),) + output[1:]
        return torch.zeros_like(output)

    layers = next(m for m in runner.model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == runner.layers)
    handles = []
    for i, layer in enumerate(layers):
        if i in skip.attention:
            module = next(getattr(layer, n) for n in ATTENTION_NAMES if hasattr(layer, n))
            handles.append(module.register_forward_hook(zero))
        if i in skip.mlp:
            module = next(getattr(layer, n) for n in MLP_NAMES if hasattr(layer, n))
            handles.append(module.register_forward_hook(zero))
    return handles


@pytest.mark.parametrize("name", all_but_ropes())
def test_a_skipped_sublayer_is_the_identity_on_the_residual(arch_dir, name):
    model = load(arch_dir, name)
    skip = Skip.of([0, 2], [1])
    ids = prompt(7, 10)
    got = Runner(model, skip=skip).forward(ids, commit=len(ids)).logits
    handles = _zeroing_hooks(Runner(model), skip)
    try:
        expected = reference(model, ids)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, reference(model, ids), atol=1e-3)  # skipping changed something


@pytest.mark.parametrize("dtype, native", ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)),
                         ids=("float32", "bfloat16", "bfloat16-native"))
@pytest.mark.parametrize("pack", (True, False), ids=("packed", "unpacked"))
@pytest.mark.parametrize("name", tuple(backends.LEAN))
def test_the_lean_loop_equals_the_models_own_forward(arch_dir, name, pack, dtype, native, monkeypatch):
    """Bit for bit with torch's operations in bfloat16, within float32's rounding in float32 (`close`); with spec's own (bfloat16 on a CPU with AVX-512: attention, and for the Llama family
    RMSNorm and SiLU times up, summed in their own order; on a CPU without oneDNN's bfloat16, the packed products
    spec's `mm16`) to bfloat16's rounding."""
    from spec_cli.exec import native as kernels

    if native and kernels.int4() is None:
        pytest.skip(f"spec's kernels: {kernels.status()}")
    if not native:
        monkeypatch.setattr(backends, "native_glue", lambda device, dtype: None)
    if pack and not packing.available(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    needs_own = getattr(backends.LEAN[name], "needs_own_attention", False)  # (gpt-oss's sinks)
    if needs_own and native and dtype == torch.float32:  # (spec's attention in float32 too: its formula held to
        monkeypatch.setattr(backends, "own_attention",   # the model's own forward to float32's rounding)
                            lambda device, dtype, quantized: kernels.int4())
    model = load(arch_dir, name, dtype=dtype)
    ids = prompt(8, 18)
    lean, full = Runner(model, pack=pack), Runner(model, lean=False)
    if needs_own and not native:
        assert lean.lean is None  # (no attention with sinks but spec's own: its model's own forward runs)
        return
    assert isinstance(lean.lean, backends.LEAN[name]) and full.lean is None
    assert bool(lean.packed) == pack and not full.packed
    assert (lean.lean.glue is not None) == (native and dtype == torch.bfloat16 if needs_own else native)
    # float32: within its rounding where products are packed (oneDNN rounds some rows otherwise than MKL), and
    # everywhere on a Zen 4, whose CPU attention kernel sums a span padded with masked keys (the lean loop's)
    # otherwise, by an ulp, than the model's exact span; bfloat16: bit for bit
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    own = pack and dtype == torch.bfloat16 and packing.own_bfloat16() is not None  # (spec's products, AVX2)
    if needs_own and dtype == torch.bfloat16:
        # a tiny random gpt-oss in bfloat16 is chaotic (its own forward rounds its softmax to bfloat16: both are
        # several percent off float32's), so here its tree rows are held to its own one-token steps, bitwise
        lean.forward(ids, commit=len(ids))
        rows = lean.forward([11, 12, 13], parents=[-1, len(ids), len(ids) + 1]).logits
        steps = Runner(model, pack=pack)
        steps.forward(ids, commit=len(ids))
        assert torch.equal(rows[0], steps.forward([11], commit=1).logits[-1])
        assert torch.equal(rows[1], steps.forward([12], commit=1).logits[-1])
        return

    def same(got, expected):
        if (native or own) and not needs_own:  # (a few bfloat16 roundings apart; a wrong rope, mask or norm is
            assert (got - expected).norm() < 0.03 * expected.norm()  # tens of percent)
            assert (got - expected).abs().max() < 0.05 * expected.abs().max()
        else:
            torch.testing.assert_close(got, expected, **close)

    same(lean.forward(ids, commit=len(ids)).logits, full.forward(ids, commit=len(ids)).logits)
    tree = ([11, 12, 13, 14], [-1, -1, len(ids), len(ids) + 1])
    same(lean.forward(*tree[:1], parents=tree[1]).logits, full.forward(*tree[:1], parents=tree[1]).logits)
    skip = Skip.of([1], [2])
    for runner in (lean, full):
        runner.keep([])
    same(lean.forward([5, 6], skip=skip).logits, full.forward([5, 6], skip=skip).logits)


def test_gemma3_runs_its_own_forward_where_the_lean_loop_would_not_compute_it(arch_dir, monkeypatch):
    model = load(arch_dir, "gemma3_text")
    assert isinstance(Runner(model).lean, backends.Gemma3)
    dynamic = {**model.config.rope_parameters, "full_attention": dict(rope_type="dynamic", rope_theta=1e6, factor=2.0)}
    for setting, value in (("attn_logit_softcapping", 2.0), ("final_logit_softcapping", 5.0),
                           ("use_bidirectional_attention", True), ("rope_parameters", dynamic)):
        with monkeypatch.context() as patch:
            patch.setattr(model.config, setting, value)
            assert backends.lean_kind(model) is None, setting
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda *args: None)
    try:
        assert Runner(model).lean is None
    finally:
        handle.remove()


def test_gemma3_with_linear_rope_scaling_runs_the_lean_loop_exactly():
    """As Gemma 3 4B and up have it on their global layers."""
    import transformers

    cls, kwargs = archs.configs(300)["gemma3_text"]
    ropes = {"full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0),
             "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs, rope_parameters=ropes))
    ids = prompt(11, 20)
    lean, full = Runner(model.eval()), Runner(model, lean=False)
    assert isinstance(lean.lean, backends.Gemma3)
    assert torch.equal(lean.forward(ids, commit=len(ids)).logits, full.forward(ids, commit=len(ids)).logits)


def test_gemma2s_lean_loop_softcaps_as_its_own_forward(monkeypatch):
    """Gemma 2 on the lean loop (spec's attention, here in float32 as a quantized model's): its own forward's
    logits to float32's rounding, its attention's softcap and its logits' both biting (scores of tens, logits
    past the cap), and a head cut to part of the vocabulary keeps the other words at -inf."""
    import transformers

    from spec_cli.exec import native

    if native.int4() is None:
        pytest.skip(f"spec's kernels: {native.status()}")
    monkeypatch.setattr(backends, "own_attention", lambda device, dtype, quantized: native.int4())
    cls, kwargs = archs.configs(300)["gemma2"]
    torch.manual_seed(5)
    config = getattr(transformers, cls)(**{**kwargs, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.weight.mul_(20)
        model.lm_head.weight.mul_(20)
    ids = prompt(13, 20)
    lean = Runner(model)
    assert isinstance(lean.lean, backends.Gemma2)
    with torch.no_grad():
        own = model(torch.tensor([ids])).logits[0]
    assert own.abs().max() > 1.0  # (past the cap's linear part)
    torch.testing.assert_close(lean.forward(ids, commit=len(ids)).logits, own, atol=1e-4, rtol=1e-4)
    words = torch.tensor([3, 7, 11])
    part = Runner(model, words=words)
    logits = part.forward(ids, commit=len(ids)).logits
    torch.testing.assert_close(logits[:, words], own[:, words], atol=1e-4, rtol=1e-4)
    assert torch.isinf(logits[:, 0]).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def test_phi4_minis_partial_rope_runs_the_lean_loop_exactly(arch_dir, dtype):
    """Three quarters of each head rotated, the rest passed through: bit for bit its own forward's arithmetic
    (spec's attention on both where it runs: `backends.model_attention`)."""
    model = load(arch_dir, "phi3-partial", dtype=dtype)
    assert model.config.partial_rotary_factor == 0.75
    ids = prompt(12, 20)
    lean, full = Runner(model), Runner(model, lean=False)
    assert isinstance(lean.lean, backends.Phi3) and lean.lean.partial and full.lean is None
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(lean.forward(ids, commit=len(ids)).logits, full.forward(ids, commit=len(ids)).logits,
                               **close)
    tree = ([11, 12, 13, 14], [-1, -1, len(ids), len(ids) + 1])
    torch.testing.assert_close(lean.forward(tree[0], parents=tree[1]).logits,
                               full.forward(tree[0], parents=tree[1]).logits, **close)


@pytest.mark.parametrize("name", ("gpt2", "qwen2"))
def test_a_cpu_runner_packs_the_projections_that_pay_but_no_hooked_one_and_only_when_the_copy_fits(
        arch_dir, name, monkeypatch):
    model = load(arch_dir, name)
    lean = Runner(model, pack=True).lean
    layers = [[layer.qkv, layer.out] + ([layer.up, layer.down] if name == "gpt2" else [layer.mlp])
              for layer in lean.layers]
    assert all(hasattr(f, "packed") for f in sum(layers, [lean.head]))
    if name == "gpt2":  # (one module per product)
        head = model.lm_head.weight.numel()
        assert all(f.weight.numel() < head for f in model.modules() if type(f).__name__ in packing.PACKABLE
                   and f is not model.lm_head)
        monkeypatch.setattr(packing, "SMALLEST", head)  # automatic: only what is large enough (here the head)
        auto = Runner(model)
        assert auto.packed == 1 and hasattr(auto.lean.head, "packed")
    seen = []
    first = model.transformer.h[0].attn.c_attn if name == "gpt2" else model.model.layers[0].self_attn.q_proj
    handle = first.register_forward_hook(lambda *args: seen.append(1))
    try:
        hooked = Runner(model, pack=True)
        hooked.forward(prompt(4, 5), commit=4)
    finally:
        handle.remove()
    assert seen and not hasattr(hooked.lean.layers[0].qkv, "packed") and hasattr(hooked.lean.layers[1].qkv, "packed")
    monkeypatch.setattr(packing, "SMALLEST", 0)  # the copies may take half the memory available: the first
    attn = model.transformer.h[0].attn if name == "gpt2" else model.model.layers[0].self_attn
    qkv = [attn.c_attn] if name == "gpt2" else [attn.q_proj, attn.k_proj, attn.v_proj]
    size = sum(m.weight.numel() * m.weight.element_size() for m in qkv)
    monkeypatch.setattr(packing, "memory_available", lambda: 2 * size + 16)  # layer's q, k, v, then no more
    partly = Runner(model)
    assert partly.packed == 1 and hasattr(partly.lean.layers[0].qkv, "packed")
    monkeypatch.setattr(packing, "memory_available", lambda: 1000)
    assert not Runner(model).packed and Runner(model, pack=True).packed


def test_architectures_without_a_kv_cache_are_refused_in_one_line():
    from transformers import MambaConfig

    with pytest.raises(SpecError, match="recurrent/state-space.*supported: gpt2, llama"):
        check_architecture(MambaConfig(), "model 'state-spaces/mamba-130m'")
    odd = archs_config("qwen2")
    odd.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(SpecError, match="linear_attention layers, which spec does not model"):
        check_architecture(odd)


def test_an_untested_architecture_says_how_to_check_it():
    from transformers import BloomConfig

    with pytest.raises(SpecError, match=r"'bloom' model, which spec is not tested on .*spec check MODEL"):
        check_architecture(BloomConfig())


def archs_config(name):
    import transformers

    cls, kwargs = archs.configs(300)[name]
    return getattr(transformers, cls)(**kwargs)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "gemma2"])
@pytest.mark.parametrize("shapes", [PADDED, ONE], ids=["buckets", "one"])
def test_padded_static_shapes_decode_exactly_as_exact_ones(arch_dir, name, shapes):
    """Static shapes (token buckets, or one shape as a GPU runs, its trees in pieces; the whole capacity
    attended) give the same tokens as exact shapes."""
    oracle, draft = load(arch_dir, name), load(arch_dir, name, "draft")
    exact = Models(Runner(oracle, capacity=128), Runner(draft, capacity=128), self_skip=Skip.of([1], [0]))
    padded = Models(Runner(oracle, capacity=128, shapes=shapes), Runner(draft, capacity=128, shapes=shapes),
                    self_skip=Skip.of([1], [0]))
    ids = prompt(9, 15)
    for method in ("baseline", "speculative", "staged", "self"):
        settings = Decoding(method=method, max_new_tokens=24, tree_budget=10)
        assert tokens_of(decode(padded, ids, settings)) == tokens_of(decode(exact, ids, settings)), method


def test_warm_up_runs_each_bucket_once_and_leaves_the_cache_empty(arch_dir, monkeypatch):
    runner = Runner(load(arch_dir, "llama"), capacity=128, shapes=PADDED)
    seen = []
    real = runner._run
    monkeypatch.setattr(runner, "_run", lambda ids, host, *a: seen.append(len(host)) or real(ids, host, *a))
    assert runner.warm_up(16) == 5
    assert seen == [1, 2, 4, 8, 16] and runner.length == 0 and runner.tokens == []
    assert Runner(load(arch_dir, "llama"), shapes=Shapes()).warm_up() == 0  # exact shapes: nothing to warm


def test_exact_shapes_are_warmed_size_by_size_only_where_onednn_builds_per_size(arch_dir, monkeypatch):
    """Float products packed for oneDNN build a kernel per row count: exact shapes run each size 1..16 once,
    every row's logits (the head's kernel too), and leave the cache empty; spec's integer kernels and unpacked
    products build nothing per shape: no forward."""
    from spec_cli.exec import quant
    from spec_cli.exec import runner as runner_module

    def warmed(model, pack):
        runner = Runner(model, capacity=128, shapes=Shapes(), pack=pack)
        seen = []
        real = runner._run
        monkeypatch.setattr(runner, "_run", lambda ids, host, start, layout, last, *a:
                            seen.append((len(host), last)) or real(ids, host, start, layout, last, *a))
        return runner, runner.warm_up(), seen

    fast = runner_module.WARM_SLOW
    monkeypatch.setattr(runner_module, "WARM_SLOW", 60.0)  # (a busy machine's forwards are not a big model's)
    runner, count, seen = warmed(load(arch_dir, "llama"), True)
    assert count == runner_module.WARM_EXACT == 16
    assert seen == [(n, n) for n in range(1, 17)] and runner.length == 0 and runner.tokens == []
    assert warmed(load(arch_dir, "llama"), False)[1:] == (0, [])
    monkeypatch.setattr(runner_module, "WARM_SLOW", fast)
    slow = Runner(load(arch_dir, "llama"), capacity=128, shapes=Shapes(), pack=True)
    real = slow._run
    monkeypatch.setattr(slow, "_run", lambda *a: time.sleep(runner_module.WARM_SLOW) or real(*a))
    assert slow.warm_up() == 2 and slow.length == 0  # a slow model's warm-up stops after its second forward
    if quant.native_kernel() is not None:
        from transformers import AutoModelForCausalLM

        quantized = AutoModelForCausalLM.from_pretrained(arch_dir / "llama-oracle", dtype=torch.bfloat16).eval()
        assert quant.quantize_model(quantized, "int4")  # (a copy of its own: `load` shares its models)
        assert warmed(quantized, None)[1:] == (0, [])


def test_out_of_gpu_memory_is_one_line_and_leaves_a_clean_cache(arch_dir, monkeypatch):
    runner = Runner(load(arch_dir, "llama"), capacity=64)
    runner.forward([1, 2, 3], commit=3)

    def exhausted(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(runner, "_run", exhausted)
    with pytest.raises(SpecError, match=r"out of cpu memory running the llama model with a 64-token cache: try a "
                                        r"shorter prompt or --max-new-tokens, a smaller --dtype"):
        runner.forward([4])
    assert runner.length == 0  # nothing half-written is trusted


def test_out_of_gpu_memory_while_loading_names_the_model(arch_dir, monkeypatch):
    import transformers

    from spec_cli.core.settings import ModelRef
    from spec_cli.models.loading import load as load_model

    def exhausted(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", exhausted)
    folder = str(arch_dir / "llama-oracle")
    with pytest.raises(SpecError, match=rf"out of cpu memory loading {folder} in float32: try --dtype bfloat16"):
        load_model(ModelRef(folder), torch.device("cpu"), torch.float32)


def test_longrope_stays_within_its_original_context_where_its_factors_are_fixed(arch_dir):
    from spec_cli.core.families import context_length

    config = archs_config("phi3-rope-longrope")
    assert context_length(config) == 64 < config.max_position_embeddings
    assert context_length(archs_config("llama-rope-dynamic")) == 256  # rescales only past its 256 positions
    # why: one forward reaching past position 64 gives every token the long factors, a one-token step does not
    model = load(arch_dir, "phi3-rope-longrope")
    ids = prompt(10, 70)
    assert not torch.allclose(reference(model, ids)[60], reference(model, ids[:61])[-1], atol=1e-3)
