"""16 fresh HumanEval prompts at once against a running `spec serve` (port 8767): wall time, and what /metrics
says the shared forwards took (forwards, sequences, rows, seconds) for each model."""
import gzip
import json
import sys
import threading
import time

import httpx

URL = "http://127.0.0.1:8767"
rows = [json.loads(l) for l in gzip.open('/work/shared/data/humaneval/HumanEval.jsonl.gz')]
offset = int(sys.argv[1]) if len(sys.argv) > 1 else 0
prompts = [r["prompt"] for r in rows[offset:offset + 16]]
name = httpx.get(URL + "/v1/models").json()["data"][0]["id"]
def metrics():
    return {k: float(v) for k, v in (l.split() for l in httpx.get(URL + "/metrics").text.splitlines()) if "{" not in k or "spec_prefix" not in k}
before = metrics()
first = [None] * 16
def go(i):
    t0 = time.time()
    with httpx.stream("POST", URL + "/v1/completions", json={"model": name, "prompt": prompts[i], "max_tokens": 128, "temperature": 0, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first[i] is None:
                first[i] = time.time() - t0
t0 = time.time()
ts = [threading.Thread(target=go, args=(i,)) for i in range(16)]
[t.start() for t in ts]; [t.join() for t in ts]
wall = time.time() - t0
after = metrics()
print(f"wall {wall:.2f} s, first text median {sorted(first)[8]:.2f} s")
for k in sorted(after):
    d = after[k] - before.get(k, 0)
    if d: print(f"  {k} {d:.3f}")
