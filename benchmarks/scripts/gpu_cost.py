"""Milliseconds per forward against the memory-bandwidth floor, for 1..64 new tokens.

    python benchmarks/scripts/gpu_cost.py [--device cuda] [--dtype bfloat16] [--models gpt2-large,gpt2-xl,pyfam]

Models: GPT-2-L- and GPT-2-XL-shaped random models (36x1280 and 48x1600; speed does not depend on the weights)
and the pyfam oracle. Each forward follows a 256-token prefix in spec's runner; the floor is the bytes of the
weights read once at the device's measured copy bandwidth (a device-to-device copy of 1 GiB). Rows: the
runner's forward eagerly, and compiled (`--compile`: each bucket's step one graph; on CUDA captured as CUDA
graphs, `SPEC_COMPILE_BACKEND` picks the backend), with the compile time of each model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from spec_cli.exec import Runner, Shapes, power_buckets

PYFAM = Path(__file__).resolve().parents[3] / "shared" / "models" / "pyfam" / "oracle"
SHAPES = {"gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}


def model_named(name: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if name == "pyfam":
        return AutoModelForCausalLM.from_pretrained(PYFAM, dtype=dtype).to(device).eval()
    layers, width, heads = SHAPES[name]
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257, n_positions=1024)
    with torch.device(device):
        return GPT2LMHeadModel(config).to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted once each)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def timed(fn, device, repeats: int = 30) -> float:
    for _ in range(5):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def eager(runner: Runner, n: int):
    def run():
        runner.forward(list(range(1, n + 1)), last=1)
        runner.keep([])
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--models", default="gpt2-large,gpt2-xl,pyfam")
    parser.add_argument("--compile", action="store_true", help="also time the compiled step")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    floor_rate = bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {args.dtype}: copy bandwidth {floor_rate / 1e9:.0f} GB/s")
    sizes = [1, 2, 4, 8, 16, 32, 64]
    print(f"{'model':12} {'path':8} {'floor':>7} " + " ".join(f"{n:>7}" for n in sizes) + "   (ms per forward)")
    for model_name in args.models.split(","):
        model = model_named(model_name, dtype, device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        floor = weight_bytes / floor_rate * 1000
        shapes = Shapes(power_buckets(), 0) if device.type == "cuda" else None
        runner = Runner(model, capacity=1024, shapes=shapes)
        runner.forward(list(range(1, 257)), commit=256)
        rows = {"eager": [timed(eager(runner, n), device) for n in sizes]}
        if args.compile:
            import os

            compiled = Runner(model, capacity=1024, compile=os.environ.get("SPEC_COMPILE_BACKEND", "inductor"))
            start = time.perf_counter()
            compiled.warm_up()
            sync(device)
            graphs = f", {len(compiled.graphs.captured)} captured as CUDA graphs" if compiled.graphs else ""
            print(f"{model_name:12} compile  {time.perf_counter() - start:.1f} s for {len(compiled.compiled_keys)} "
                  f"buckets{graphs}")
            compiled.forward(list(range(1, 257)), commit=256)
            rows["compiled"] = [timed(eager(compiled, n), device) for n in sizes]
            del compiled
        for path, values in rows.items():
            cells = " ".join(f"{v:7.2f}" for v in values)
            print(f"{model_name:12} {path:8} {floor:7.2f} {cells}   x floor at 1: {values[0] / floor:.1f}")
        del runner, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
