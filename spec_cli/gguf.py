"""GGUF files (what ollama, LM Studio and llama.cpp users hold), through transformers' own GGUF support.

Transformers dequantizes a GGUF file into an ordinary model (`from_pretrained(dir, gguf_file=...)`, with the
`gguf` package), the tokenizer and chat template from the same file. That takes tens of seconds, so spec does
it once per file and dtype and keeps the result, saved as a Hugging Face folder, in the cache dir under the
file's sha256; the hash itself is remembered per (path, size, modification time), so a second load reads
a folder and hashes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from spec_cli.errors import SpecError
from spec_cli.profiles import ModelRef

INSTALL = "pip install 'spec-cli[gguf]' (or: pip install gguf)"


def is_gguf(ref: ModelRef) -> bool:
    return ref.gguf_file is not None or ref.model.lower().endswith(".gguf")


def cache_root() -> Path:
    from spec_cli.firstload import cache_dir

    return cache_dir() / "gguf"


def _require_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SpecError(f"reading GGUF files needs the gguf package: {INSTALL}")


def locate(ref: ModelRef) -> Path:
    """The GGUF file a reference names: a path, a file in a local folder, or a file of a hub repository."""
    if ref.gguf_file is None:
        path = Path(ref.model).expanduser()
        if not path.is_file():
            raise SpecError(f"GGUF file not found: {ref.model}")
        return path.resolve()
    folder = Path(ref.model).expanduser()
    if ref.model.startswith((".", "/", "~")) or folder.is_dir():
        path = folder / ref.gguf_file
        if not path.is_file():
            raise SpecError(f"GGUF file not found: {path}")
        return path.resolve()
    return _download(ref)


def _download(ref: ModelRef) -> Path:
    import os

    from huggingface_hub import hf_hub_download

    from spec_cli.loading import _hub_host, _hub_reachable

    try:
        return Path(hf_hub_download(ref.model, ref.gguf_file, revision=ref.revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: fetch it below
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise SpecError(f"{ref.gguf_file} of '{ref.model}' is not in the Hugging Face cache and the hub "
                        f"({_hub_host()}) cannot be reached; download it once online with "
                        f"`hf download {ref.model} {ref.gguf_file}`, or point the profile at the file")
    try:
        return Path(hf_hub_download(ref.model, ref.gguf_file, revision=ref.revision))
    except Exception as e:  # noqa: BLE001 - any hub failure is one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"cannot get {ref.gguf_file} of '{ref.model}' from the hub ({first})") from None


def sha256(path: Path) -> str:
    """The file's sha256, computed once per (path, size, modification time) and remembered."""
    stat = path.stat()
    index_path = cache_root() / "hashes.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    mark = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    if mark not in index:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        index[mark] = digest.hexdigest()
        try:
            index_path.parent.mkdir(parents=True, exist_ok=True)
            index_path.write_text(json.dumps(index, indent=1))
        except OSError:
            pass
    return index[mark]


def inspect_file(path: Path) -> tuple[str, list[str]]:
    """(architecture, quantization types) from the file's header, refusing in one line what transformers
    cannot load."""
    import gguf
    from gguf.quants import _type_traits
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, read_field

    try:
        reader = gguf.GGUFReader(str(path))
        architecture = read_field(reader, "general.architecture")[0]
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"{path}: not a readable GGUF file ({first})") from None
    architectures = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if architecture.replace("-", "_") not in architectures and architecture not in ("qwen2moe", "qwen3moe"):
        raise SpecError(f"{path}: a GGUF '{architecture}' model, which transformers cannot load from GGUF "
                        f"(GGUF architectures it loads: {', '.join(architectures)})")
    supported = {"F32", "F16"} | {t.name for t in _type_traits}
    odd = [k for k in kinds if k not in supported]
    if odd:
        raise SpecError(f"{path}: tensors quantized as {', '.join(odd)}, which the gguf package cannot "
                        f"dequantize (it can: {', '.join(sorted(supported))})")
    return architecture, kinds


def prepare(ref: ModelRef, dtype: torch.dtype, say: Callable[[str], None]) -> ModelRef:
    """A reference to the dequantized model in the cache (made on first use) in place of the GGUF one."""
    _require_package()
    path = locate(ref)
    digest = sha256(path)
    folder = cache_root() / f"{digest[:16]}-{str(dtype).removeprefix('torch.')}"
    if not (folder / "source.json").is_file():
        architecture, kinds = inspect_file(path)
        say(f"{path.name}: a GGUF {architecture} model ({', '.join(kinds)}); dequantizing it to "
            f"{str(dtype).removeprefix('torch.')} once, into {folder}")
        start = time.perf_counter()
        convert(path, folder, dtype)
        say(f"{path.name}: converted in {time.perf_counter() - start:.0f} s; later loads read the cache")
    return dataclasses.replace(ref, model=str(folder), gguf_file=None, revision=None)


def convert(path: Path, folder: Path, dtype: torch.dtype) -> None:
    """Dequantize with transformers and save model, tokenizer (with its chat template) and generation config
    as a Hugging Face folder; written beside and renamed, so a crash leaves no half folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    bar = hf_gguf.tqdm
    hf_gguf.tqdm = lambda items, **kwargs: items  # its progress bar ignores transformers' verbosity
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError, NotImplementedError, KeyError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"{path}: transformers cannot load this GGUF file ({first})") from None
    finally:
        hf_gguf.tqdm = bar
    model.hf_quantizer = None  # dequantized already: plain weights, which save_pretrained may write
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / "source.json").write_text(json.dumps({"file": str(path), "dtype": str(dtype)}, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        raise SpecError(f"cannot write the dequantized model to {folder}: {e.strerror or e}") from None
