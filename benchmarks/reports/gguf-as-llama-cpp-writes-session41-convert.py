"""llama.cpp's own convert_hf_to_gguf.py (vendored in llama-cpp-python 0.3.36's sdist) on a tiny test model whose
BPE tokenizer llama.cpp does not know: its pre-tokenizer named "gpt-2" (the test is of the weights and settings)."""
import runpy
import sys
from pathlib import Path

LLAMA = Path(sys.argv.pop(1))
sys.path[:0] = [str(LLAMA), str(LLAMA / "gguf-py")]
from conversion import base

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = str(LLAMA / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
