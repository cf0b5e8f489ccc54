# Ad hoc (session 43): spec against llama.cpp (its AVX-512 build without AMX, docs/benchmarks.md) on random
# gpt-oss-shaped GGUF files (benchmarks/scripts/random_gguf.py --family gpt-oss [--layers N]), 2 threads,
# alternating; spec: 64 greedy tokens after a 124-token prompt (HumanEval's first), its cache read already.
F=$1; B=${LLAMA_BIN:-/tmp/k42/sd/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin}
P=$(python -c "import gzip,json; print(json.loads(next(gzip.open('../shared/data/humaneval/HumanEval.jsonl.gz','rt')))['prompt'])")
for r in 1 2; do
  LD_LIBRARY_PATH=$B $B/llama-bench -m $F -t 2 -p 128 -n 64 -r 2 2>&1 | grep -E "pp128|tg64" | awk -F'|' '{print "llama.cpp", $7, $8}'
  spec generate --oracle $F -m baseline -n 64 --json "$P" 2>/dev/null | python -c "
import json,sys; d=json.load(sys.stdin); print('spec baseline prompt', d['prompt_tokens'], 'tokens', round(d['prompt_tokens_per_second'],1), 'tok/s; generation', d['generation_tokens_per_second'], 'tok/s')"
done
