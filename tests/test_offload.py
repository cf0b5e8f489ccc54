"""Oracles bigger than memory (--max-memory): tiny models split between CPU memory and disk decode exactly as
in memory, through accelerate's hooks, with the placement reported and mistakes one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEVICE
from helpers import assert_clean_error, spec

from spec_cli.core.errors import SpecError
from spec_cli.core.settings import ModelRef
from spec_cli.exec import Runner, backends, packing
from spec_cli.exec import placement as offload
from spec_cli.models.loading import load

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU memory and disk (CUDA offloading is untested)")
CPU = torch.device("cpu")
METHODS = ("baseline", "speculative", "staged")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """The tiny GPT-2 and Llama pairs (the lean loop), and a GPT-NeoX pair (the model's own forward)."""
    from archs import make
    from tiny import make_noisy_copy
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    root = tmp_path_factory.mktemp("neox")
    make(root / "gpt_neox-oracle", "gpt_neox", len(tokenizer), tokenizer=tokenizer)
    make_noisy_copy(root / "gpt_neox-oracle", root / "gpt_neox-draft", noise=0.1, seed=2)
    return {"gpt2": tiny_dir, "llama": tiny_dir, "gpt_neox": root}


def split(folder) -> str:
    """A --max-memory that keeps some of the model's decoder layers in CPU memory and puts the rest on disk."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    for kb in range(200, 2000, 50):
        planned = offload.place(config, torch.float32, (("cpu", kb * 1000),))
        layers = [key for key in planned.device_map if key.split(".")[-1].isdigit()]
        if {planned.device_map[key] for key in layers} == {"cpu", "disk"}:
            return f"cpu={kb}KB"
    raise AssertionError("no budget splits the model")


def generate(folder, arch, method, *extra):
    args = ("generate", "--oracle", str(folder / f"{arch}-oracle"), "--draft", str(folder / f"{arch}-draft"),
            "def fib(n):", "-n", "24", "--dtype", "float32", "-m", method, "--json", *extra)
    result = spec(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_an_oracle_split_between_memory_and_disk_decodes_as_in_memory(models, arch):
    folder = models[arch]
    budget = split(folder / f"{arch}-oracle")
    whole = generate(folder, arch, "baseline")
    assert "placement" not in whole["weights"]
    for method in METHODS:
        offloaded = generate(folder, arch, method, "--max-memory", budget)
        assert offloaded["tokens"] == whole["tokens"], (method, budget)
        placement = offloaded["weights"]["placement"]
        assert set(placement) == {"cpu", "disk"} and sum(placement.values()) == 3, placement
        assert offloaded["weights"]["bytes"] == whole["weights"]["bytes"]


def test_a_model_all_on_disk_and_the_statistics_line(models):
    folder = models["gpt2"]
    whole = generate(folder, "gpt2", "baseline")
    result = spec("generate", "--oracle", str(folder / "gpt2-oracle"), "--draft", str(folder / "gpt2-draft"),
                  "def fib(n):", "-n", "24", "--dtype", "float32", "--max-memory", "cpu=1KB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "(layers: 3 disk)" in result.stderr.splitlines()[-1]
    assert result.stderr.count("\n") == 1, result.stderr  # accelerate's warnings are not shown
    disk = generate(folder, "gpt2", "staged", "--max-memory", "cpu=1KB")
    assert disk["tokens"] == whole["tokens"] and disk["weights"]["placement"] == {"disk": 3}


def test_a_budget_the_model_fits_in_loads_it_whole(models):
    record = generate(models["gpt2"], "gpt2", "staged", "--max-memory", "cpu=1GiB")
    assert "placement" not in record["weights"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_runner_computes_where_the_hooks_bring_the_weights(models, arch):
    """The runner's device is the embedding's execution device, not `meta`; the lean loop calls the offloaded
    modules through accelerate's hooks (so their weights come in and go back out), and packs only the layers
    that stay in memory."""
    from accelerate.hooks import AlignDevicesHook

    folder = models[arch] / f"{arch}-oracle"
    budget = offload.parse(split(folder))
    whole = load(ModelRef(str(folder)), CPU, torch.float32).model
    spread = load(ModelRef(str(folder)), CPU, torch.float32, max_memory=budget).model
    assert offload.is_offloaded(spread) and any(p.device.type == "meta" for p in spread.parameters())
    runner, reference = Runner(spread, pack=True), Runner(whole, pack=True)
    assert runner.device == CPU and runner.dtype == torch.float32
    assert runner.keys[0].device == CPU
    assert 0 < packing.packs(runner.lean) < packing.packs(reference.lean)

    calls = []
    original = AlignDevicesHook.pre_forward

    def counted(self, module, *args, **kwargs):
        calls.append(module)
        return original(self, module, *args, **kwargs)

    AlignDevicesHook.pre_forward = counted
    try:
        prompt = [5, 17, 42, 9, 100, 7]
        got = runner.forward(prompt, commit=len(prompt)).logits
        tree = runner.forward([3, 4, 8], parents=[-1, -1, len(prompt) + 1]).logits
    finally:
        AlignDevicesHook.pre_forward = original
    expected = reference.forward(prompt, commit=len(prompt)).logits
    expected_tree = reference.forward([3, 4, 8], parents=[-1, -1, len(prompt) + 1]).logits
    assert torch.allclose(got, expected, atol=1e-5) and torch.allclose(tree, expected_tree, atol=1e-5)
    assert {id(m) for m in calls} == {id(m) for m in spread.modules() if getattr(m, "_hf_hook", None)}
    assert all(p.device.type == "meta" for m in calls for p in m.parameters(recurse=False))  # back out


def test_hooked_modules_are_called_not_fused():
    linear = torch.nn.Linear(4, 4)
    assert backends.direct(linear) == linear.forward
    linear._hf_hook = object()
    assert backends.hooked(linear) and backends.direct(linear) is linear


@pytest.mark.parametrize("command", [["generate", "x"], ["chat"], ["serve"], ["bench", "humaneval"]])
@pytest.mark.parametrize("value, message", [
    ("cpu=lots", "--max-memory: 'lots' is not a size"),
    ("gpu=1GiB", "--max-memory: unknown device 'gpu'"),
    ("cpu", "--max-memory takes DEVICE=SIZE pairs"),
    ("cpu=1GiB,cpu=2GiB", "--max-memory: cpu is given twice"),
])
def test_a_bad_max_memory_is_one_line(command, value, message):
    result = spec(*command, "--max-memory", value)
    assert result.returncode == 2
    assert_clean_error(result, message)


def test_sizes_and_devices():
    assert offload.parse("cpu=30MiB") == (("cpu", 30 * 2**20),)
    assert offload.parse("cuda=20GiB, cpu=1.5GB") == (("cuda:0", 20 * 2**30), ("cpu", 1_500_000_000))
    assert offload.parse("none") == ()
    assert offload.for_accelerate(offload.parse("cuda:1=1GiB,cpu=2GiB")) == {1: 2**30, "cpu": 2 * 2**30}
    assert offload.device_for("auto", offload.parse("cuda=1GiB,cpu=2GiB")) == "cuda:0"
    assert offload.device_for("auto", offload.parse("cpu=2GiB")) == "cpu"
    with pytest.raises(SpecError, match="runs the oracle on cpu, but the device is cuda"):
        offload.device_for("cuda", offload.parse("cpu=2GiB"))


def test_a_profile_states_max_memory(models, tmp_path):
    folder = models["gpt2"]
    body = f'oracle = "{folder / "gpt2-oracle"}"\ndraft = "{folder / "gpt2-draft"}"\n'
    good = tmp_path / "good.toml"
    good.write_text(body + 'max_memory = { cpu = "1KB" }\n')
    result = spec("generate", "-p", str(good), "def fib(n):", "-n", "8", "--dtype", "float32", "--json")
    assert json.loads(result.stdout)["weights"]["placement"] == {"disk": 3}
    flag = spec("generate", "-p", str(good), "def fib(n):", "-n", "8", "--dtype", "float32", "--json",
                "--max-memory", "none")
    assert "placement" not in json.loads(flag.stdout)["weights"]  # the flag wins
    bad = tmp_path / "bad.toml"
    bad.write_text(body + 'max_memory = { cpu = "30 parsecs" }\n')
    result = spec("generate", "-p", str(bad), "x")
    assert_clean_error(result, f"{bad}:3: max_memory: '30 parsecs' is not a size")
    bad.write_text(body + "max_memory = 30\n")
    assert_clean_error(spec("generate", "-p", str(bad), "x"), "'max_memory' must be a table")


def test_compiling_an_offloaded_oracle_is_refused(models):
    folder = models["gpt2"]
    result = spec("generate", "--oracle", str(folder / "gpt2-oracle"), "x", "-n", "4", "--max-memory", "cpu=1KB",
                  "--compile")
    assert_clean_error(result, "--compile: an offloaded oracle (--max-memory) runs eagerly")


def test_what_fits_nowhere_is_one_line(models, monkeypatch):
    import shutil
    from collections import namedtuple

    from spec_cli.models import loading

    monkeypatch.setattr(loading, "_safetensors", lambda source: False)  # weights that must be written
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    result = spec("generate", "--oracle", str(models["gpt2"] / "gpt2-oracle"), "x", "--max-memory", "cpu=1KB",
                  "--dtype", "float32")
    assert_clean_error(result, "fits nowhere: it needs 725.2 KiB in float32, 0 B within --max-memory cpu=1000 B "
                               "and 725.2 KiB on disk under")


def test_quantized_or_gguf_oracles_are_not_offloaded(models):
    result = spec("generate", "--oracle", str(models["llama"] / "llama-oracle"), "x", "--max-memory", "cpu=1KB",
                  "--quantize", "int8")
    assert_clean_error(result, "--max-memory: weights quantized at load (quantize = int8) are not offloaded")
