#!/usr/bin/env bash
# Issue 49's GPU checks in one device call (after `source .device/setup.sh`), each step under its own limit:
#   1 the CUDA tests: one shape's bits (SPEC_TEST_DEVICE=cuda tests/test_one_shape.py), host reads and queued
#     plain steps, sampling on CUDA
#   2 `spec generate` eager, every method x greedy/top-k, text equal to baseline's (fresh processes side by side:
#     their speeds are not comparable, their tokens are)
#   3 `spec bench humaneval` compiled (CUDA graphs) on pyfam, 8 problems: identity and speed against baseline
#   4 benchmarks/scripts/gpu_cost.py: forwards of the real pair's shapes and GPT-2-L's against their floors,
#     and the pair's speed projected from its CPU acceptance
#   5 benchmarks/scripts/controller_trace.py: top-k staged step by step, compiled (why 0.66x baseline there)
#   6 the model families' one-shape tests on CUDA (tests/test_architectures.py, about a minute)
#   7 benchmarks/scripts/gpu_identity.py: where a method's text leaves baseline's (the first decision whose
#     logits are not baseline's bits), compiled and eager, and whether baseline repeats its own bits
# Writes $OUT/gpu-report.txt (and the bench's summary, gpu_cost's json).
# On an H200 (2026-11-27): steps 1 7 3 5 took 163 s, 7 (both backends) and 4 (three models) 213 s; all seven
# run near 9 minutes, so a 15-minute session runs them in two calls (STEPS="1 7 3 5", then STEPS="6 2 4").
set -u
OUT=${OUT:-$(mktemp -d)}; R=$OUT/gpu-report.txt; : > "$R"
STEPS=${STEPS:-1 2 3 4 5 6}
P=benchmarks/pyfam.toml; DATA=../shared/data/humaneval/HumanEval.jsonl.gz
export HF_HUB_OFFLINE=1 NO_COLOR=1 PYTHONUNBUFFERED=1
say() { echo "$*" | tee -a "$R"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
T=$(mktemp -d)
sed 's/^\[decoding\]/compile = false\n[decoding]/' $P > $T/eager.toml
sed 's/^\[decoding\]/compile = true\n[decoding]/' $P > $T/graphs.toml
for f in $T/eager.toml $T/graphs.toml; do sed -i "s#\.\./\.\./shared#$(cd ../shared && pwd)#g" $f; done
say "gpu issue 49 · head $(git rev-parse --short HEAD 2>/dev/null) · $(date -u +%FT%TZ)"
nvidia-smi -L 2>/dev/null | tee -a "$R"
python3 -c "import torch, transformers; print('torch', torch.__version__, '· transformers', transformers.__version__)" | tee -a "$R"
if has 1; then
  SPEC_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_one_shape.py 2>&1 \
    | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -12 | sed 's/^/tests one shape (cuda): /' | tee -a "$R"
  SPEC_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_host_reads.py \
    tests/test_decoding.py -k "queued or host or reads" 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" \
    | head -12 | sed 's/^/tests host reads, queued steps (cuda): /' | tee -a "$R"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_decoding.py tests/test_compile.py -k cuda 2>&1 \
    | tail -1 | sed 's/^/tests -k cuda: /' | tee -a "$R"
fi
if has 6; then
  SPEC_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_architectures.py \
    -k "padded_static and one" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | head -6 \
    | sed 's/^/tests families, one shape (cuda): /' | tee -a "$R"
fi
if has 7; then
  timeout ${IDENTITY_S:-150} python3 benchmarks/scripts/gpu_identity.py -p $T/graphs.toml --tasks 0-7 \
    --backends ${IDENTITY_BACKENDS:-graphs,eager} 2>&1 \
    | grep -v Warn | tee -a "$R"
fi
if has 2; then
  for mode in g t; do
    flags="-t 0"; [ $mode = t ] && flags="-t 1 --top-k 50 --seed 1"
    for m in baseline speculative staged self; do
      extra=""; [ $m = self ] && extra="--skip-attention 3,5 --skip-mlp 4"
      timeout 120 spec generate -p $T/eager.toml -m $m -n 96 $flags $extra --json "def merge_sort(xs):" \
        > $T/g-$mode-$m.json 2>$T/g-$mode-$m.err &
    done
  done
  wait
  for mode in g t; do
    for m in baseline speculative staged self; do
      python3 - $T/g-$mode-$m.json $T/g-$mode-baseline.json "$m $mode" $T/g-$mode-$m.err <<'PY' | tee -a "$R"
import json, sys
try:
    d, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
except Exception:
    print(f"generate {sys.argv[3]}: failed: {open(sys.argv[4]).read().strip().splitlines()[-1:]}"); sys.exit()
same = "same as baseline" if d["tokens"] == b["tokens"] else "DIFFERS from baseline"
print(f"generate {sys.argv[3]:16s} {d['stats'].get('tokens_per_oracle_forward', 1):.2f} tok/fwd  {same}  ({d['dtype']})")
PY
    done
  done
fi
if has 3; then
  timeout ${BENCH_S:-170} spec bench humaneval -p $T/graphs.toml --dataset $DATA --tasks 0-7 -n 128 \
    --methods baseline,speculative,staged --modes greedy,topk --out $T/b > $T/b.txt 2>&1 \
    || say "bench: failed or timed out: $(tail -2 $T/b.txt | tr '\n' ' ')"
  sed -n '/method/,$p' $T/b.txt | head -24 | sed "s/^/bench graphs: /" | tee -a "$R"
  [ -f $T/b/summary.json ] && cp $T/b/summary.json $OUT/bench-graphs-summary.json
fi
if has 4; then
  timeout ${COST_S:-170} python3 benchmarks/scripts/gpu_cost.py ${COST_ARGS:-} --json $OUT/gpu-cost.json \
    --project ${PROJECT:-benchmarks/reports/qwen-pair-code24-f3b6869-zen4.summary.json} 2>&1 | tee -a "$R"
fi
if has 5; then
  timeout ${TRACE_S:-90} python3 benchmarks/scripts/controller_trace.py -p $T/graphs.toml --tasks 0-3 --mode topk 2>&1 \
    | grep -v Warn | tee -a "$R"
fi
say "done $(date -u +%FT%TZ)"
