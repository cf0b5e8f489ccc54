"""spec beside llama.cpp on the same GGUF file, prompts and threads, greedy, in one process.

    pip install 'spec-cli[peer]'   # llama-cpp-python, built from source (~10 minutes on 2 cores)
    python benchmarks/scripts/vs_llamacpp.py FILE.gguf [--prompts benchmarks/prompts/code-8.jsonl] [-n 128]
        [--threads 2] [--methods baseline] [--quantize auto]

Both get the same token ids (spec's tokenizer; llama.cpp is handed ids, not text) and run each prompt to
`-n` tokens or an end token, timed end to end (prompt and generation, as a user waits). The sides alternate
which goes first; each prompt runs once untimed on each side first. Prints tokens/s per prompt and in all
(total new tokens over total seconds), the ratio, and whether spec's methods agree with its own baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spec_cli.core.hardware import cpu_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts" / "code-8.jsonl"))
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="baseline")
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--skip", default="20,22,24,26,28;21,23,25,27,29",
                        help="the self-draft's skipped attention;MLP sublayers (methods self and staged)")
    parser.add_argument("--no-peer", action="store_true", help="spec only")
    parser.add_argument("--peer-no-repack", action="store_true",
                        help="llama.cpp without its extra buffer types (weight repacking, AMX): its AMX path "
                             "crashed on a Xeon with AMX here (llama-cpp-python 0.3.36)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from spec_cli.completion import complete
    from spec_cli.core.settings import Decoding, ModelRef, Profile, SelfDraft
    from spec_cli.engine import Engine

    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    attention, mlp = ([int(i) for i in part.split(",") if i] for part in args.skip.split(";"))
    profile = Profile(name=Path(args.gguf).stem, source="vs_llamacpp", oracle=ModelRef(str(Path(args.gguf).resolve())),
                      draft=ModelRef("self"), self_draft=SelfDraft(tuple(attention), tuple(mlp)))
    engine = Engine(profile, dtype=args.dtype, quantize=args.quantize, compile=args.compile)
    weights = engine.weights
    print(f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}; spec dtype "
          f"{str(engine.dtype).removeprefix('torch.')}, weights {weights['format']} "
          f"({weights['bytes'] / 2**20:.0f} MiB), compiled {bool(engine.compile)}, load {engine.load_seconds:.1f} s")

    def spec_run(ids, method):
        plan = engine.plan(Decoding(method=method, max_new_tokens=args.n))
        engine.warm_up(plan, len(ids))
        start = time.perf_counter()
        done = complete(engine, ids, plan)
        return list(done.tokens), time.perf_counter() - start

    peer = None
    if not args.no_peer:
        import llama_cpp
        from llama_cpp import Llama

        if args.peer_no_repack:
            defaults = llama_cpp.llama_model_default_params

            def no_repack():
                params = defaults()
                params.use_extra_bufts = False
                return params

            llama_cpp.llama.llama_cpp.llama_model_default_params = no_repack

        peer = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048,
                     n_batch=512, verbose=False)
        eos = engine.eos

        def peer_run(ids, method=None):
            peer.reset()
            out = []
            start = time.perf_counter()
            for token in peer.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                if token in eos:
                    break
                out.append(token)
                if len(out) == args.n:
                    break
            return out, time.perf_counter() - start

    methods = args.methods.split(",")
    sides = {m: (lambda ids, m=m: spec_run(ids, m)) for m in methods}
    if peer is not None:
        sides["llama.cpp"] = peer_run
    totals = {name: [0, 0.0] for name in sides}
    agree = {m: 0 for m in methods}
    peer_agree = 0
    print(f"{'prompt':>6} " + " ".join(f"{name:>12}" for name in sides))
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt)
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        outputs, rates = {}, {}
        for name in order:
            sides[name](ids)  # untimed: each side's shapes and caches warm
            tokens, seconds = sides[name](ids)
            outputs[name] = tokens
            rates[name] = len(tokens) / seconds
            totals[name][0] += len(tokens)
            totals[name][1] += seconds
        for m in methods:
            agree[m] += outputs[m] == outputs[methods[0]]
        if peer is not None:
            peer_agree += outputs["llama.cpp"] == outputs[methods[0]]
        print(f"{i:>6} " + " ".join(f"{rates[name]:>12.1f}" for name in sides))
    rate = {name: n / s for name, (n, s) in totals.items()}
    print("tok/s  " + " ".join(f"{rate[name]:>12.1f}" for name in sides))
    if peer is not None:
        for m in methods:
            print(f"spec {m} / llama.cpp: {rate[m] / rate['llama.cpp']:.2f}x")
        print(f"llama.cpp's text equal to spec's {methods[0]} on {peer_agree}/{len(prompts)} prompts "
              f"(different arithmetic: not expected to be equal)")
    for m in methods[1:]:
        print(f"spec {m}: {rate[m] / rate[methods[0]]:.2f}x {methods[0]}, identical on {agree[m]}/{len(prompts)}")


if __name__ == "__main__":
    main()
