# call 1: correctness on CUDA first, then quick speed signals; everything to $OUT/log
set -o pipefail
L=$OUT/log
T=$(mktemp -d); P=benchmarks/pyfam.toml
sed "s#\.\./\.\./shared#$(cd ../shared && pwd)#g" $P > $T/p.toml
echo "== tests on cuda (cudagraphs backend)" | tee -a $L
SPEC_TEST_DEVICE=cuda SPEC_COMPILE_BACKEND=cudagraphs timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 \
  tests/test_runner.py tests/test_compile.py tests/test_host_reads.py tests/test_decoding.py 2>&1 | grep -v "Loading weights\|Writing model" | tail -40 | tee -a $L
echo "== gpu-check step 2" | tee -a $L
GPU_CHECK_STEPS="2" timeout 170 bash ../shared/tools/gpu-check 2>&1 | tee -a $L
echo "== generate compiled (cudagraphs), greedy and top-k" | tee -a $L
for mode in "-t 0" "-t 1 --top-k 50 --seed 1"; do for m in baseline speculative staged; do
SPEC_COMPILE_BACKEND=cudagraphs timeout 60 spec generate -p $T/p.toml --device cuda --compile -m $m -n 128 $mode --json "def merge_sort(xs):" > $T/c-$m.json 2>$T/c.err || { echo "FAIL $m: $(tail -3 $T/c.err)" | tee -a $L; continue; }
python3 -c "
import json,sys; d=json.load(open('$T/c-$m.json')); b=json.load(open('$T/c-baseline.json'))
print('compiled $m $mode', round(d['tokens_per_second'],1), 'tok/s', d['stats'].get('tokens_per_oracle_forward',1), 'same' if d['tokens']==b['tokens'] else 'DIFFERS', d.get('dtype'), 'load', d.get('load_seconds'), 'warm', d.get('warm_seconds'))" 2>&1 | tee -a $L
done; done
tail -5 $T/c.err | tee -a $L
echo "== gpu_cost cudagraphs" | tee -a $L
SPEC_COMPILE_BACKEND=cudagraphs timeout 120 python3 benchmarks/scripts/gpu_cost.py --device cuda --models pyfam,gpt2-large --compile 2>&1 | tail -8 | tee -a $L
echo "== bench 2 problems" | tee -a $L
GPU_CHECK_STEPS="3" GPU_CHECK_TASKS=0-1 timeout 150 bash ../shared/tools/gpu-check 2>&1 | tee -a $L
echo "== done" | tee -a $L
