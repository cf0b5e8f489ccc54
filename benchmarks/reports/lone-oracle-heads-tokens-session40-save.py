"""Ad hoc (session 40): heads fitted on the first N tokens of the saved library read, saved where staged finds them
(SPEC_CACHE_DIR)."""
import sys

import torch

sys.path.insert(0, ".")
from spec_cli.core.paths import write_whole
from spec_cli.core.settings import Draft2Ref, ModelRef, Profile
from spec_cli.draft2 import heads
from spec_cli.engine import Engine

oracle, n = sys.argv[1], int(sys.argv[2])
engine = Engine(Profile("alone", "", ModelRef(oracle), None, draft2=Draft2Ref("auto")))
d = torch.load("/tmp/k40/reads.pt")
k = n // heads.PIECE
reads = heads.Reads(d["hidden"][:k], d["tokens"][:k], d["targets"][:k])
saved = heads.fit(reads, engine.oracle.model)
print(write_whole(heads.path_for(ModelRef(oracle)), lambda f: torch.save(saved, f)), saved["tokens"])
