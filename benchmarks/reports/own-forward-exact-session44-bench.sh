# Models forced onto their own forward (no lean loop): baseline and staged, 128 greedy tokens, 4 prompts.
# usage: bash ownfwd.sh LABEL  (run from a checkout)
label=$1
run() { python -c "import sys; from spec_cli.exec import backends; backends.LEAN.clear(); from spec_cli.cli import main; sys.argv=['spec']+sys.argv[1:]; main()" "$@"; }
for p in "def fib(n):" "class Stack:" "def parse_args(argv):" "import os
def walk(root):"; do
  for m in baseline staged; do
    run generate -p benchmarks/pyfam.toml -m $m --dtype bfloat16 -n 128 --json "$p" > /tmp/k44/bench/$label-pyfam-$m-$(echo "$p" | md5sum | cut -c1-6).json 2>/dev/null
    run generate --oracle /work/shared/models/smollm2-135m-instruct/*.gguf -m $m -n 128 --json "$p" > /tmp/k44/bench/$label-smol-$m-$(echo "$p" | md5sum | cut -c1-6).json 2>/dev/null
  done
done
