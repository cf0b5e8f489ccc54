"""Milliseconds per forward against the memory-bandwidth floor, by rows, and the real pair's speed projected.

    python benchmarks/scripts/gpu_cost.py [--device cuda] [--models qwen-1.5b,qwen-0.5b,gpt2-large,pyfam]
        [--formats bfloat16,int4] [--rows 1,16,64] [--backends cudagraphs,inductor] [--inductor-rows 64]
        [--project SUMMARY.json] [--json OUT.json]
    python benchmarks/scripts/gpu_cost.py --from-json OUT.json --project SUMMARY.json    (no device: the projection
        again from measurements kept, with another acceptance)

Models (random weights made on the device: speed does not depend on them): `qwen-1.5b` and `qwen-0.5b` have the
shapes of Qwen2.5-Coder-1.5B and -0.5B (28 x 1536, GQA 12/2, MLP 8960; 24 x 896, GQA 14/2, MLP 4864; 151,936
words, heads untied as in their GGUF files), `gpt2-large` and `gpt2-xl` GPT-2's, `pyfam` the pyfam oracle.
Formats: `bfloat16`, and `int4` (spec's `--quantize int4`: on CUDA torch's tinygemm, groups of 32).

Each forward follows a 256-token prefix in spec's runner with one shape (`Shapes.one(rows)`, what spec runs on
a GPU: every step that many rows), compiled and captured as a CUDA graph (`--backends`: `cudagraphs` traces
torch's operations, `inductor` compiles them; `eager` for a dry run). The floor: the bytes a forward must read
(the weights but the input embedding, and the cache it attends) at the device's measured copy bandwidth.

`--project`: a `spec bench humaneval` summary.json of the pair, measured on a CPU (greedy acceptance is the
same on any device): its tokens per oracle forward and draft forwards per token, combined with the forwards
measured here into tokens per second for baseline, speculative and staged on this GPU. A projection: it
leaves out the host's time between forwards (sampling, tree building), so it is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from spec_cli.exec import Runner, Shapes

PYFAM = Path(__file__).resolve().parents[3] / "shared" / "models" / "pyfam" / "oracle"
GPT2 = {"gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
QWEN = {  # layers, width, heads, kv heads, MLP width (Qwen2.5-Coder's configs; heads untied as in the GGUF files)
    "qwen-1.5b": (28, 1536, 12, 2, 8960),
    "qwen-0.5b": (24, 896, 14, 2, 4864),
}
CAPACITY = 1024


def model_named(name: str, dtype: torch.dtype, device: torch.device):
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if name == "pyfam":
        return AutoModelForCausalLM.from_pretrained(PYFAM, dtype=dtype).to(device).eval()
    if name in QWEN:
        layers, width, heads, kv, mlp = QWEN[name]
        config = Qwen2Config(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=mlp, vocab_size=151936,
                             max_position_embeddings=32768, tie_word_embeddings=False)
        with torch.device(device):
            return Qwen2ForCausalLM(config).to(dtype).eval()
    layers, width, heads = GPT2[name]
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


def read_bytes(model, runner: Runner) -> int:
    """What a forward must read: every parameter and buffer but the input embedding (a row of it is read),
    and the cache over the attended capacity."""
    embedding = model.get_input_embeddings().weight
    tied = getattr(model.get_output_embeddings(), "weight", None) is embedding
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    if not tied:
        tensors.pop(id(embedding), None)
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    cache = sum(t.numel() * t.element_size() for t in (*runner.keys, *runner.values) if t is not None)
    return weights + cache * CAPACITY // (CAPACITY + runner.reserve)


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


def step(runner: Runner, n: int):
    def run():
        runner.forward(list(range(1, n + 1)))
        runner.keep([])
    return run


def measure(model, rows: int, backend: str, device) -> tuple[float, float, int, int]:
    """(ms per forward of `rows` rows, seconds to compile and capture, CUDA graphs captured, bytes read)."""
    compile = False if backend == "none" else backend
    runner = Runner(model, capacity=CAPACITY, shapes=Shapes.one(rows), compile=compile)
    start = time.perf_counter()
    runner.forward(list(range(1, 257)), commit=256)
    step(runner, rows)()
    sync(device)
    built = time.perf_counter() - start
    ms = timed(step(runner, rows), device)
    graphs = len(runner.graphs.captured) if runner.graphs is not None else 0
    return ms, built, graphs, read_bytes(model, runner)


def project(summary_path: str, costs: dict) -> list[str]:
    """Tokens per second on this device from a CPU bench's acceptance and the forwards measured here."""
    summary = json.loads(Path(summary_path).read_text())["summary"]
    lines = [f"projection from {Path(summary_path).name} (acceptance measured on its CPU; host time between "
             f"forwards left out: an upper bound)"]
    for fmt, per in costs.items():
        oracle, draft = per.get("qwen-1.5b"), per.get("qwen-0.5b")
        if oracle is None or draft is None:
            continue
        for mode, methods in summary.items():
            base = 1000 / oracle
            cells = [f"baseline {base:7.1f}"]
            for method in ("speculative", "staged"):
                m = methods.get(method)
                if m is None:
                    continue
                per_token = oracle / m["tokens_per_oracle_forward"] + draft * (m["draft_forwards_per_token"] or 0)
                cells.append(f"{method} {1000 / per_token:7.1f} (x{oracle / per_token:.2f}, "
                             f"{m['tokens_per_oracle_forward']:.2f} tok/fwd, {m['draft_forwards_per_token']:.2f} d/tok)")
            lines.append(f"  {fmt:9} {mode:7} tok/s: " + "  ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="qwen-1.5b,qwen-0.5b,gpt2-large,pyfam")
    parser.add_argument("--formats", default="bfloat16,int4")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--backends", default="cudagraphs,inductor")
    parser.add_argument("--inductor-rows", default="64", help="rows timed with inductor (each a compile)")
    parser.add_argument("--inductor-models", default="qwen-1.5b,gpt2-large")
    parser.add_argument("--project", help="a bench summary.json of the pair, for the projection")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--from-json", help="project from the measurements this file kept (--json), measure nothing")
    args = parser.parse_args()
    if args.from_json:
        if not args.project or not Path(args.from_json).is_file() or not Path(args.project).is_file():
            parser.error("--from-json needs a measurements file (--json's) and --project SUMMARY.json, both there")
        results = json.loads(Path(args.from_json).read_text())["results"]
        widest, at_one_shape = max(r["rows"] for r in results), {}
        for r in results:
            if r["rows"] == widest:
                best = at_one_shape.setdefault(r["format"], {})
                best[r["model"]] = min(r["ms"], best.get(r["model"], float("inf")))
        print(f"from {Path(args.from_json).name}: forwards of {widest} rows, the fastest backend's")
        print("\n".join(project(args.project, at_one_shape)))
        return
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    floor_rate = bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: copy bandwidth {floor_rate / 1e9:.0f} GB/s; one shape per runner (Shapes.one(rows)), "
          f"a {CAPACITY}-slot cache attended whole, after a 256-token prefix", flush=True)
    print(f"{'model':11} {'format':9} {'backend':10} {'rows':>4} {'ms':>7} {'floor':>7} {'x floor':>7} "
          f"{'build s':>7} graphs", flush=True)
    results, at_one_shape, projected = [], {}, set()
    for model_name in args.models.split(","):
        for fmt in args.formats.split(","):
            if fmt == "int4" and model_name == "pyfam":
                continue
            try:
                model = model_named(model_name, torch.bfloat16, device)
                if fmt != "bfloat16":
                    from spec_cli.exec.quant import quantize_model

                    quantize_model(model, fmt)
            except Exception as e:  # noqa: BLE001 - one line, then the next model
                print(f"{model_name:11} {fmt:9} failed to build: {type(e).__name__}: {e}", flush=True)
                continue
            for backend in args.backends.split(","):
                if backend == "inductor" and model_name not in args.inductor_models.split(","):
                    continue
                rows_list = args.inductor_rows if backend == "inductor" else args.rows
                for rows in (int(r) for r in rows_list.split(",")):
                    try:
                        ms, built, graphs, nbytes = measure(model, rows, backend, device)
                    except Exception as e:  # noqa: BLE001
                        print(f"{model_name:11} {fmt:9} {backend:10} {rows:4} failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                        continue
                    floor = nbytes / floor_rate * 1000
                    print(f"{model_name:11} {fmt:9} {backend:10} {rows:4} {ms:7.3f} {floor:7.3f} {ms / floor:7.2f} "
                          f"{built:7.1f} {graphs}", flush=True)
                    results.append(dict(model=model_name, format=fmt, backend=backend, rows=rows, ms=ms,
                                        floor_ms=floor, bytes=nbytes, build_s=built, graphs=graphs))
                    if rows == max(int(r) for r in args.rows.split(",")):
                        best = at_one_shape.setdefault(fmt, {})
                        best[model_name] = min(ms, best.get(model_name, float("inf")))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.project and fmt not in projected and {"qwen-1.5b", "qwen-0.5b"} <= set(at_one_shape.get(fmt, {})):
                projected.add(fmt)  # (as soon as it can: a later model may run out of time)
                for line in project(args.project, {fmt: at_one_shape[fmt]}):
                    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, bandwidth=floor_rate, results=results), indent=1))


if __name__ == "__main__":
    sys.exit(main())
