"""`python -m spec_cli.exec.native`: build spec's CPU kernels now, not at the first load that needs them (a
container image, a machine set up before it goes offline); says whether they run here, and why not."""

import sys
import time

from spec_cli.exec import native

start = time.perf_counter()
module = native.int4(lambda line: print(line, file=sys.stderr))
where = f" ({module.__file__}, {time.perf_counter() - start:.0f} s)" if module is not None else ""
print(f"spec's CPU kernels: {native.status()}{where}")
sys.exit(1 if native.status().startswith("not built") else 0)
