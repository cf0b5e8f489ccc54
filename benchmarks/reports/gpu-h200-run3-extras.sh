# extras beside gpu-check steps 1-2: the CUDA test suite (SPEC_TEST_DEVICE) and int4/int8 weights on CUDA
DEV=${EXTRAS_DEVICE:-cuda}; X=$OUT/extras.txt; T=$(mktemp -d)
P=benchmarks/pyfam.toml; sed "s#\.\./\.\./shared#$(cd ../shared && pwd)#g" $P > $T/p.toml
echo "== tests, SPEC_TEST_DEVICE=$DEV" >> $X
SPEC_TEST_DEVICE=$DEV timeout ${EXTRAS_TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -n 6 ${EXTRAS_TESTS:-tests/test_runner.py tests/test_compile.py tests/test_decoding.py tests/test_host_reads.py tests/test_pyfam.py} > $T/tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|error" $T/tests.txt | tail -25 >> $X
grep -B2 -A18 "^_____" $T/tests.txt | head -150 > $OUT/extras-failures.txt
for q in int4 int8; do for m in baseline speculative staged self; do
  extra=""; [ $m = self ] && extra="--skip-attention 3,5 --skip-mlp 4"
  for mode in "-t 0" "-t 1 --top-k 50 --seed 1"; do
    tag=$q-$m-$(echo $mode | tr -d ' -'); 
    timeout 60 spec generate -p $T/p.toml --device $DEV --quantize $q -m $m -n 64 $mode $extra --json "def merge_sort(xs):" > $T/$tag.json 2>$T/err \
      || { echo "quant $q $m $mode: FAILED $(tail -2 $T/err | tr '\n' ' ')" >> $X; continue; }
    python3 - $T/$tag.json $T/$q-baseline-$(echo $mode | tr -d ' -').json "$q $m $mode" >> $X 2>&1 <<'PY'
import json, sys
d, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
print(f"quant {sys.argv[3]:34s} {d['tokens_per_second']:8.1f} tok/s {'same as baseline' if d['tokens'] == b['tokens'] else 'DIFFERS from baseline'} weights={d.get('weights', {}).get('format', d.get('weights'))}")
PY
  done
done; done
echo "== extras done" >> $X
