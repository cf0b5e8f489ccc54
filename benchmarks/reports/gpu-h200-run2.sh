# call 2: the fixed tests, inductor-compiled steps captured as graphs (ms per forward), the 8-problem graphs bench
set -o pipefail
L=$OUT/log; T=$(mktemp -d); P=benchmarks/pyfam.toml; DATA=../shared/data/humaneval/HumanEval.jsonl.gz
sed 's/^\[decoding\]/compile = true\n[decoding]/' $P > $T/graphs.toml; sed -i "s#\.\./\.\./shared#$(cd ../shared && pwd)#g" $T/graphs.toml
echo "== tests on cuda (cudagraphs backend)" | tee -a $L
SPEC_TEST_DEVICE=cuda SPEC_COMPILE_BACKEND=cudagraphs timeout 60 python3 -m pytest -q -p no:cacheprovider -n 6 \
  tests/test_runner.py tests/test_host_reads.py 2>&1 | grep -E "^(FAILED|E )|passed|failed" | tail -12 | tee -a $L
echo "== gpu_cost inductor" | tee -a $L
timeout 125 python3 benchmarks/scripts/gpu_cost.py --device cuda --models pyfam,gpt2-large --compile 2>&1 | grep -v Loading | tail -8 | tee -a $L
echo "== bench graphs (cudagraphs backend), 8 problems" | tee -a $L
SPEC_COMPILE_BACKEND=cudagraphs timeout 110 spec bench humaneval -p $T/graphs.toml --device cuda --dataset $DATA --tasks 0-7 -n 128 \
  --methods baseline,speculative,staged,hf_greedy,hf_assisted --modes greedy,topk --out $T/b > $T/b.txt 2>&1 || echo "bench: failed or timed out" | tee -a $L
sed -n '/method/,$p' $T/b.txt | head -24 | tee -a $L
[ -f $T/b/summary.json ] && cp $T/b/summary.json $OUT/bench-graphs-summary.json
echo "== done" | tee -a $L
