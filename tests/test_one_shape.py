"""One shape (`Shapes.one`, what a GPU runs): every forward the same number of rows, a longer one in pieces, the
head over all rows. On CUDA the kernels (cuBLAS's products, the attention's split) are chosen by shape, so one
shape is what makes a row's logits the bits one-token steps give whatever shares its forward: a chain, a tree
with cousins between a row and its parents, a tree longer than one shape. Here every device checks that each
forward runs the very same operations on the very same shapes (what a kernel choice depends on); with
SPEC_TEST_DEVICE=cuda the bits themselves are compared, in bfloat16. (A CPU's own kernels round a row by where
it sits in the rows, so the bits are not compared there: the CPU has its own row-invariant kernels.)"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE, HUMANEVAL, PYFAM, load_pair
from torch.utils._python_dispatch import TorchDispatchMode

from spec_cli.exec import Runner, Shapes, backends, power_buckets
from spec_cli.exec.runner import trees_exact

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


TREES = ((1, 2), (1, 9), (3, 3), (4, 5))  # (width, depth): chains, and trees with cousins between a row and its parent
CHAINS = ((1, 2), (1, 9), (1, 16))


def runner(model, shapes: Shapes, compile=False, capacity=256) -> Runner:
    return Runner(model, capacity=capacity, shapes=shapes, pack=False, compile=compile)


def steps_along(model, shapes, prompt, path_tokens, compile=False, capacity=256) -> list[torch.Tensor]:
    steps = runner(model, shapes, compile, capacity)
    steps.forward(prompt, commit=len(prompt))
    return [steps.forward([t], commit=1).logits[-1] for t in path_tokens]


def tree_rows(model, shapes, prompt, tokens, parents, compile=False, capacity=256) -> torch.Tensor:
    tree = runner(model, shapes, compile, capacity)
    tree.forward(prompt, commit=len(prompt))
    return tree.forward(tokens, parents=parents).logits


def differing(model, shapes: Shapes, seed: int, compile=False, forms=TREES, lengths=(5, 37, 70), words=300,
              capacity=256) -> list:
    """(prompt length, path, row) of every row whose logits are not the one-token steps' bits along its path:
    trees of `forms` (width, depth), laid out a level at a time, after prompts of `lengths` (random words)."""
    rng = random.Random(seed)
    bad = []
    for length in lengths:
        prompt = [rng.randrange(words) for _ in range(length)]
        for width, depth in forms:
            tokens = [rng.randrange(words) for _ in range(width * depth)]
            parents = [-1] * width + [length + i for i in range(width * (depth - 1))]
            rows = tree_rows(model, shapes, prompt, tokens, parents, compile, capacity)
            for b in range(width):
                path = [b + width * d for d in range(depth)]
                ones = steps_along(model, shapes, prompt, [tokens[i] for i in path], compile, capacity)
                bad += [(length, b, i) for i, one in zip(path, ones) if not torch.equal(rows[i], one)]
    return bad


MOVES = {"slice", "select", "view", "_unsafe_view", "unsqueeze", "expand", "index_copy_", "index_copy", "copy_",
         "slice_scatter", "as_strided", "t", "transpose", "reshape", "clone", "detach", "index", "index_select",
         "alias", "lift_fresh", "_to_copy"}  # (they move values: no rounding)


class Shapes_seen(TorchDispatchMode):
    """Each floating-point operation a forward runs, with the shapes and dtypes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        name = func.__name__.split(".")[0]
        if name not in MOVES and any(t.is_floating_point() for t in tensors):  # (a chain's masks and writes
            self.ops.append((name, tuple((tuple(t.shape), t.dtype) for t in tensors)))  # take cheaper paths)
        return func(*args, **(kwargs or {}))


def ops_of(run, forward) -> list:
    """The operations of the model's forwards (`Runner._step`: not the rows' upload, built on the host's
    counts, nor the float32 copy of the logits asked for)."""
    seen, step = Shapes_seen(), run._step

    def watched(*args, **kwargs):
        with seen:
            return step(*args, **kwargs)

    run._step = watched
    try:
        forward(run)
    finally:
        del run._step
    return seen.ops


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_forward_runs_the_same_operations_on_the_same_shapes(tiny_dir, arch, monkeypatch):
    monkeypatch.setattr(backends, "native_blocks", lambda device, dtype: None)  # (torch's operations, seen)
    oracle, _ = load_pair(tiny_dir, arch, dtype=DTYPE)
    run = runner(oracle, Shapes.one(8))
    run.forward(list(range(1, 30)), commit=29)
    one = ops_of(run, lambda r: r.forward([7], commit=1))
    chain = ops_of(run, lambda r: (r.forward([3, 4, 5]), r.keep([30, 31])))
    tree = ops_of(run, lambda r: r.forward([1, 2, 3, 4, 5], parents=[-1, -1, 32, 33, 34]))
    run.keep([32, 34])
    pieces = ops_of(run, lambda r: r.forward(list(range(10, 22)), parents=[-1] + list(range(34, 45))))
    assert len(one) > 10 * oracle.config.num_hidden_layers if arch == "llama" else len(one) > 30
    assert chain == one and tree == one
    assert pieces == one + one  # (12 rows: two forwards of 8)
    buckets = runner(oracle, Shapes(power_buckets(), 0))
    buckets.forward(list(range(1, 30)), commit=29)
    assert ops_of(buckets, lambda r: r.forward([7], commit=1)) != ops_of(buckets, lambda r: r.forward([3, 4, 5]))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the bits of CUDA's kernels (SPEC_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # llama: grouped queries folded into rows, rotary positions
def test_one_shape_gives_every_row_its_own_bits(tiny_dir, arch):
    oracle, _ = load_pair(tiny_dir, arch, dtype=DTYPE)
    assert differing(oracle, Shapes.one(), seed=3) == []


@pytest.mark.skipif(DEVICE.type != "cuda" or not PYFAM.is_dir() or not HUMANEVAL.is_file(),
                    reason="the bits of CUDA's kernels on pyfam's weights (SPEC_TEST_DEVICE=cuda, ../shared)")
def test_on_cuda_a_chain_s_rows_get_one_token_steps_bits_and_a_tree_s_need_not():
    """Real weights, a 1024-slot cache, prompts of 100 to 300 words: every row of a chain (where staged puts
    one on CUDA: `Runner.exact_trees`) is its one-token steps' bits; rows of trees of 16 with cousins between a
    row and its ancestors are not all (CUDA's attention sums a row's keys by slot, the masked ones among them),
    which is why staged verifies chains there. The tiny models' trees above happen to keep their bits."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(PYFAM / "oracle", dtype=torch.bfloat16).to(DEVICE).eval()
    kwargs = dict(lengths=(100, 190, 300), words=oracle.config.vocab_size, capacity=1024)
    assert not Runner(oracle, capacity=1024).exact_trees
    assert differing(oracle, Shapes.one(), seed=7, forms=CHAINS, **kwargs) == []
    assert differing(oracle, Shapes.one(), seed=7, forms=((2, 8), (4, 4), (3, 5)), **kwargs) != []


def test_a_gpu_runs_one_shape_of_fewer_rows_for_quantized_products():
    """tinygemm's int4 costs by the row (3.6 ms a forward of 1 row, 5.6 of 16, 11.1 of 64 at Qwen-1.5B's shape on
    an H200): quantized products run at one shape of 16 rows there, floating-point ones at 64."""
    from spec_cli.exec.shapes import QUANTIZED_ROWS, ROWS

    cuda = torch.device("cuda")
    assert Shapes.for_device(cuda, torch.bfloat16) == Shapes.one(ROWS) and ROWS == 64
    assert Shapes.for_device(cuda, torch.bfloat16, per_shape=False) == Shapes.one(QUANTIZED_ROWS) and QUANTIZED_ROWS == 16


def test_trees_branch_only_where_their_rows_get_one_token_steps_bits():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not trees_exact(cuda, torch.bfloat16, False, False) and not trees_exact(cuda, torch.float32, False, False)
    assert trees_exact(cpu, torch.float32, False, False) and not trees_exact(cpu, torch.float32, True, False)
    assert not trees_exact(cpu, torch.bfloat16, False, False) and trees_exact(cpu, torch.bfloat16, True, True)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the bits of CUDA's kernels (SPEC_TEST_DEVICE=cuda)")
def test_a_tree_longer_than_the_shape_runs_in_pieces_with_the_same_bits(tiny_dir):
    """Shapes of 4 rows: the trees of 6 to 20 rows go in pieces, a row's parent in an earlier piece."""
    oracle, _ = load_pair(tiny_dir, "llama", dtype=DTYPE)
    assert differing(oracle, Shapes.one(4), seed=5) == []


def test_a_tree_in_pieces_keeps_its_layout(tiny_dir):
    oracle, _ = load_pair(tiny_dir, "llama", dtype=DTYPE)
    tree = runner(oracle, Shapes.one(4))
    tree.forward(list(range(1, 11)), commit=10)
    out = tree.forward([5, 6, 7, 8, 9, 10], parents=[-1, -1, 10, 11, 12, 13])
    assert out.logits.shape[0] == 6 and out.positions.tolist() == [10, 10, 11, 11, 12, 12]
    assert tree.parents == [-1, -1, 10, 11, 12, 13] and tree.depths == [1, 1, 2, 2, 3, 3]


def test_a_forward_that_commits_and_speculates_in_pieces(tiny_dir):
    """Rows committed and rows speculated in one forward longer than the shape: the same logits and cache as
    one forward of a roomier shape would leave."""
    oracle, _ = load_pair(tiny_dir, "llama", dtype=DTYPE)
    prompt, more, tokens = list(range(1, 9)), [20, 21, 22], [30, 31, 32, 33]
    small, large = runner(oracle, Shapes.one(2)), runner(oracle, Shapes.one(16))
    for r in (small, large):
        r.forward(prompt, commit=len(prompt))
    a = small.forward(more + tokens, commit=3, parents=[-1, -1, 11, 12])
    b = large.forward(more + tokens, commit=3, parents=[-1, -1, 11, 12])
    assert small.committed == large.committed == 11 and small.parents == large.parents
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    assert a.positions.tolist() == b.positions.tolist() == [8, 9, 10, 11, 11, 12, 12]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the bits of CUDA's kernels (SPEC_TEST_DEVICE=cuda)")
def test_buckets_are_not_enough(tiny_dir):
    """The bits test fails where rows are padded to buckets: a row's bits then depend on its forward's size."""
    oracle, _ = load_pair(tiny_dir, "llama", dtype=DTYPE)
    assert differing(oracle, Shapes(power_buckets(), 0), seed=3) != []


def test_projections_of_one_input_run_side_by_side_on_a_gpu(tiny_dir, monkeypatch):
    """On a GPU q, k and v (gate and up) are one product, their weights held once: here the same code on the
    CPU's tensors (`packing.on_gpu` told the CPU is one), against each projection on its own."""
    from spec_cli.exec import packing

    oracle, _ = load_pair(tiny_dir, "llama", dtype=torch.float32)
    ids = list(range(3, 40))
    alone = Runner(oracle, capacity=128, pack=False).forward(ids, commit=len(ids), last=None).logits
    several = lambda modules: len(modules) > 1 and all(type(m).__name__ == "Linear" for m in modules)  # noqa: E731
    monkeypatch.setattr(packing, "on_gpu", several)
    monkeypatch.setattr(packing, "chooser", lambda device, dtype, pack: several)
    fused = Runner(oracle, capacity=128)
    attn, mlp = oracle.model.layers[0].self_attn, oracle.model.layers[0].mlp
    qkv, gate_up = fused.lean.layers[0].qkv, fused.lean.layers[0].mlp
    assert qkv.packed.shape[0] == sum(m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.k_proj.weight.data_ptr() == qkv.packed[attn.q_proj.weight.shape[0]:].data_ptr()  # (held once)
    assert gate_up.packed.shape[0] == 2 * mlp.gate_proj.weight.shape[0]
    assert mlp.up_proj.weight.data_ptr() == gate_up.packed[mlp.gate_proj.weight.shape[0]:].data_ptr()
    torch.testing.assert_close(fused.forward(ids, commit=len(ids), last=None).logits, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_chains_get_one_token_steps_bits_at_one_shape(tiny_dir, kind):
    """Quantized products at one shape (16 rows: what CUDA runs them at, tinygemm's int4 and int8's kernel there;
    spec's own kernels on a CPU): a chain's rows are its one-token steps' bits."""
    from spec_cli.exec.quant import quantize_model
    from spec_cli.exec.shapes import QUANTIZED_ROWS

    oracle, _ = load_pair(tiny_dir, "llama", dtype=torch.bfloat16)
    quantize_model(oracle, kind)
    assert differing(oracle, Shapes.one(QUANTIZED_ROWS), seed=11, forms=CHAINS) == []
