"""GGUF files (what ollama, LM Studio and llama.cpp users hold), run at their own quantization.

A file is read tensor by tensor (the `gguf` package's reader maps it; nothing is copied whole): 4-bit blocks
(Q4_0, Q4_1, Q4_K) become spec's int4 projections value for value (`spec_cli.models.gguf_blocks`), Q8_0 projections
two int4 halves that add up to the file's 8-bit values, every other tensor is dequantized to the compute dtype
(`--quantize int8|int4` requantizes projections instead, `none` dequantizes them too). Names, the
configuration, the tokenizer and its chat template come from transformers' own GGUF support. The result is kept
in the cache dir under the file's sha256 (remembered per path, size and modification time), as a safetensors file
of the packed tensors beside the configuration and tokenizer, so a second load reads it in seconds.
Families whose tensors transformers reshapes beyond a row order (experts merged, Bloom's fused attention) are
dequantized by transformers itself into a Hugging Face folder, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib.util
import json
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from spec_cli.core.errors import SpecError, first_line
from spec_cli.core.paths import used, write_whole
from spec_cli.core.process import quiet_gguf_reads
from spec_cli.core.settings import ModelRef

INSTALL = "pip install 'spec-cli[gguf]' (or: pip install gguf)"


def is_gguf(ref: ModelRef) -> bool:
    return ref.gguf_file is not None or ref.model.lower().endswith(".gguf")


def cache_root() -> Path:
    from spec_cli.core.paths import cache_dir

    return cache_dir() / "gguf"


def _require_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SpecError(f"reading GGUF files needs the gguf package: {INSTALL}")


def _ready() -> None:
    """transformers' GGUF loader as spec reads with it: quiet, and taught the architectures it lacks."""
    from spec_cli.models import gguf_archs

    quiet_gguf_reads()
    gguf_archs.teach()


def file_tokenizer(ref: ModelRef):
    """The tokenizer (with its chat template) a GGUF file holds, read from the file by transformers, or as a load
    of the file kept it in the cache (the one decoding uses; 0.3 s where the 1.5B coder's file takes 10 s)."""
    from transformers import AutoTokenizer

    _require_package()
    path = locate(ref)
    for folder in sorted(cache_root().glob(f"{sha256(path)[:16]}-*")):
        if (folder / "source.json").is_file() and (folder / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(folder))
            except (OSError, ValueError):
                pass
    _ready()
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, NotImplementedError, KeyError) as e:
        raise SpecError(f"{path}: transformers cannot read this GGUF file's tokenizer ({first_line(e)})") from None


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
    from huggingface_hub import hf_hub_download

    from spec_cli.models import hub

    return Path(hub.fetch(
        lambda: hf_hub_download(ref.model, ref.gguf_file, revision=ref.revision, local_files_only=True),
        lambda: hf_hub_download(ref.model, ref.gguf_file, revision=ref.revision),
        f"{ref.gguf_file} of '{ref.model}'", f"hf download {ref.model} {ref.gguf_file}",
        "point the profile at the file"))


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
            write_whole(index_path, json.dumps(index, indent=1))
        except OSError:
            pass
    return index[mark]


def inspect_file(path: Path) -> tuple[str, list[str]]:
    """(architecture, quantization types) from the file's header, refusing in one line what transformers
    cannot load."""
    import gguf
    from gguf.quants import _type_traits
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_SUPPORTED_ARCHITECTURES,
        read_field,
    )

    _ready()
    try:
        reader = gguf.GGUFReader(str(path))
        architecture = read_field(reader, "general.architecture")[0]
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
        first = first_line(e)
        raise SpecError(f"{path}: not a readable GGUF file ({first})") from None
    architectures = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if {architecture, architecture.replace("-", "_")}.isdisjoint(architectures) and \
            architecture not in ("qwen2moe", "qwen3moe"):
        raise SpecError(f"{path}: a GGUF '{architecture}' model, which spec cannot read (GGUF architectures it "
                        f"reads: {', '.join(architectures)})")
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
    folder = cache_root() / f"{digest[:16]}-{str(dtype).removeprefix('torch.')}-dequantized-v{LAYOUT}"
    if not (folder / "source.json").is_file():
        with reading(folder, path.name, say):
            if not (folder / "source.json").is_file():  # (else converted meanwhile by another process)
                architecture, kinds = inspect_file(path)
                say(f"{path.name}: a GGUF {architecture} model ({', '.join(kinds)}); dequantizing it to "
                    f"{str(dtype).removeprefix('torch.')} once, into {folder}")
                start = time.perf_counter()
                convert(path, folder, dtype, architecture)
                say(f"{path.name}: converted in {time.perf_counter() - start:.0f} s; later loads read the cache")
    return dataclasses.replace(ref, model=str(folder), gguf_file=None, revision=None)


@contextlib.contextmanager
def reading(folder: Path, name: str, say: Callable[[str], None]):
    """Held while this process writes `folder`: another one about to write it (the same file, dtype and mode,
    started at once: an editor's server and a terminal) waits for it and then reads what it wrote, instead of
    writing the same folder beside it (each would remove the other's half). A lock file in `.locks` beside it."""
    try:
        import fcntl
    except ImportError:  # (no POSIX locks: as before)
        yield
        return
    locks = folder.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / (folder.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"{name}: another spec process is reading it into {folder}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert(path: Path, folder: Path, dtype: torch.dtype, architecture: str) -> None:
    """Dequantize with transformers and save model, tokenizer (with its chat template) and generation config
    as a Hugging Face folder (its configuration as `gguf_archs.configured` reads the file: the saved one is what
    builds the model again); written beside and renamed, so a crash leaves no half folder."""
    import gguf as gguf_package
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_cli.models import gguf_archs

    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    _ready()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError, NotImplementedError, KeyError, RuntimeError) as e:
        first = first_line(e)
        raise SpecError(f"{path}: transformers cannot load this GGUF file ({first})") from None
    model.config = gguf_archs.configured(model.config, gguf_package.GGUFReader(str(path)), architecture)
    model.hf_quantizer = None  # dequantized already: plain weights, which save_pretrained may write
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _publish(work, folder, lambda: (model.save_pretrained(work), tokenizer.save_pretrained(work)),
             {"file": str(path), "dtype": str(dtype)}, "the dequantized model")


def _publish(work: Path, folder: Path, write, source: dict, what: str) -> None:
    """`write()` into `work`, with `source.json`, then `work` renamed to `folder` (replacing it): a crash leaves
    no half folder; a failure to write is one line naming `what`."""
    try:
        write()
        (work / "source.json").write_text(json.dumps(source, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        raise SpecError(f"cannot write {what} to {folder}: {e.strerror or e}{room(e, folder)}") from None


# tensor processors whose only change to a projection is an order of its rows (or GPT-2's transpose, which
# spec's [out, in] projections undo), or that merge experts (which `_build` splits itself): their blocks can be read
# as they are
BLOCKS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")  # an embedding kept as its blocks
ROW_ORDER_ONLY = ("TensorProcessor", "LlamaTensorProcessor", "GPT2TensorProcessor", "Gemma2TensorProcessor",
                  "Qwen2MoeTensorProcessor", "SharedGate", "LlamaExperts", "Experts", "GptOssExperts")
# (the last five: experts merged, which `_build` reads itself)
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")  # every expert's gate, up or down
EXPERT_BIASES = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.bias$")  # (gpt-oss's: [experts, width])
BLOCK = re.compile(r"^blk\.(\d+)\.")  # a layer's tensor
LATENT = re.compile(r"^blk\.(\d+)\.attn_(k|v)_b\.weight$")  # DeepSeek's kv_b, split by llama.cpp's converter
MODES = ("file", "none", "int8", "int4")
LAYOUT = 6  # the cache folder's layout: a change to what `build` writes bumps it (5: the configuration as
            # `gguf_archs` reads it: Llama 3's rope from its rope_freqs, StarCoder2's rope base, which 4 dropped;
            # 6: Phi-4-mini's partial rope, which 5 read as a rope over the whole head)
FOLDER = re.compile(r"^([0-9a-f]{16})-(\w+)-(\w+)-v(\d+)(-native)?$")  # a read's folder: hash, dtype, mode, layout


def precision_of(quantize: str | None) -> str:
    return "file" if quantize in (None, "auto") else quantize


def row_order_only(architecture: str) -> bool:
    """Whether transformers reads this architecture's GGUF tensors with no change but the rows' order, or its
    experts merged (then spec reads their blocks as they are)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
    )

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor).__name__ in ROW_ORDER_ONLY


def load_model(ref: ModelRef, device: torch.device, dtype: torch.dtype, quantize: str | None,
               say: Callable[[str], None]):
    """(model, tokenizer) of a GGUF file at `quantize` (None or "auto": the file's own), from the cache once
    made; None when the file's family is only read through transformers' dequantizing loader (`prepare`)."""
    _require_package()
    with allocations_for_loading():
        return _load_model(ref, device, dtype, quantize, say)


def _load_model(ref: ModelRef, device: torch.device, dtype: torch.dtype, quantize: str | None,
                say: Callable[[str], None]):
    path = locate(ref)
    precision = precision_of(quantize)
    from spec_cli.exec import quant

    # where spec's own CPU kernel runs: Q4_K with its own scales, Q6_K on its 6-bit products, 5- and 8-bit blocks on
    # its 8-bit ones (elsewhere Q4_K's scales rounded to bfloat16 pairs, Q8_0 as two int4 halves on torch's int4
    # kernel, Q5 and Q6_K in the compute dtype), a Q8_0 tied head too; at int4, Q4_K as it is
    kernel = (precision in ("file", "int4") and torch.device(device).type == "cpu"
              and quant.native_kernel(say) is not None)
    folder = cache_root() / (f"{sha256(path)[:16]}-{str(dtype).removeprefix('torch.')}-{precision}-v{LAYOUT}"
                             + ("-native" if kernel else ""))
    if (folder / "source.json").is_file():  # (read before: the file's header is not parsed again)
        used(folder)  # (`spec cache` shows when)
        return from_cache(folder, device, dtype)
    architecture, kinds = inspect_file(path)
    if not row_order_only(architecture):
        return None
    with reading(folder, path.name, say):
        if (folder / "source.json").is_file():  # (read meanwhile by another process)
            return from_cache(folder, device, dtype)
        what = {"file": "its own quantization", "none": str(dtype).removeprefix("torch.")}.get(precision, precision)
        say(f"{path.name}: a GGUF {architecture} model ({', '.join(kinds)}); reading it at {what} once, "
            f"into {folder}")
        start = time.perf_counter()
        formats = build(path, folder, architecture, dtype, precision, kernel, progress=_bar(path.name, say))
        say(f"{path.name}: read in {time.perf_counter() - start:.0f} s ({describe(formats)}); later loads read "
            f"the cache")
    earlier = _superseded(path, folder)
    if earlier:
        say(f"{path.name}: {len(earlier)} earlier read{'s' if len(earlier) > 1 else ''} of this path (another "
            f"version of the file, or of spec's layout) can go: `spec cache --clear stale`")
    return from_cache(folder, device, dtype)


def _superseded(path: Path, folder: Path) -> list[Path]:
    """The cache's reads of the file at `path` that a new read in `folder` leaves unusable: of other bytes (the
    file replaced) or of an older layout."""
    digest = folder.name[:16]
    found = []
    for other in cache_root().iterdir():
        if other == folder or other.suffix == ".partial" or not (other / "source.json").is_file():
            continue
        try:
            source = json.loads((other / "source.json").read_text())
        except (OSError, ValueError):
            continue
        named = FOLDER.match(other.name)  # (None: a transformers-converted folder, of no layout)
        if source.get("file") == str(path) and (other.name[:16] != digest
                                                or (named is not None and int(named.group(4)) != LAYOUT)):
            found.append(other)
    return found


def _skeleton(config, dtype: torch.dtype):
    """The model with its parameters on the meta device (no memory) and its buffers (rotary tables) real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def describe(formats: dict) -> str:
    """The formats a file was read into, most used first: "168 int4 (Q4_K), 29 6-bit (Q6_K), ..."."""
    return ", ".join(f"{n} {what}" for what, n in sorted(formats.items(), key=lambda item: -item[1]))


def _bar(name: str, say: Callable[[str], None]) -> Callable[[int, int], None]:
    """`update(done, total)` for reading a file's tensors: a bar redrawn in place on a terminal, else a line at
    each quarter."""
    import sys

    shown = {"quarter": 0}
    terminal = say is _default_say() and sys.stderr.isatty()

    def update(done: int, total: int) -> None:
        if terminal:
            filled = 30 * done // max(1, total)
            sys.stderr.write(f"\r{name}: [{'#' * filled}{' ' * (30 - filled)}] {done}/{total} tensors")
            if done == total:
                sys.stderr.write("\r" + " " * (len(name) + 50) + "\r")
            sys.stderr.flush()
        elif 4 * done // max(1, total) > shown["quarter"] and done < total:
            shown["quarter"] = 4 * done // max(1, total)
            say(f"{name}: {done}/{total} tensors read")
    return update


def _default_say():
    from spec_cli.core.errors import say

    return say


def build(path: Path, folder: Path, architecture: str, dtype: torch.dtype, precision: str,
          kernel: bool = False, progress: Callable[[int, int], None] | None = None) -> Counter:
    """Read the file tensor by tensor into the cache folder (written beside and renamed: a crash leaves no half
    folder); returns how many tensors went to each format. `kernel`: spec's own CPU kernel runs here (Q6_K goes
    to its 6-bit products, 5- and 8-bit blocks to its 8-bit ones)."""
    import gguf as gguf_package
    from transformers import AutoConfig, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from spec_cli.models import gguf_archs

    _ready()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        settings = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except (OSError, ValueError, NotImplementedError, KeyError) as e:
        first = first_line(e)
        raise SpecError(f"{path}: transformers cannot read this GGUF file's configuration ({first})") from None
    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    need = path.stat().st_size  # (a copy at the file's own quantization: about the file)
    if precision == "file" and shutil.disk_usage(work).free < need:
        shutil.rmtree(work, ignore_errors=True)
        raise SpecError(f"no room to keep {path.name} read{room(None, folder, need)}")
    reader = gguf_package.GGUFReader(str(path))
    config = gguf_archs.configured(config, reader, architecture)
    projections = sum(int(t.shape[-1]) if EXPERTS.match(t.name) else 1 for t in reader.tensors)  # (an expert's own)
    tensors = Stream(work / "weights.safetensors", reserve=4096 + 1024 * projections)  # (~3-5 entries a projection
    # of ~110 bytes: the header is written in its room, not copied after it)
    try:  # (a failed or interrupted read leaves nothing behind: a large file's half copy is gigabytes)
        formats = _build(path, work, folder, architecture, dtype, precision, kernel, progress, reader, tensors,
                         tokenizer, config, settings)
    except BaseException as e:
        tensors.abandon()
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(e, OSError):
            raise SpecError(f"cannot write the packed model to {folder}: {e.strerror or e}{room(e, folder, need)}") \
                from None
        raise
    return formats


def room(e: OSError | None, folder: Path, need: int | None = None) -> str:
    """Where a write into the cache failed for want of room (or `e` None: would), how much there is, and what
    to do."""
    if e is not None and e.errno != errno.ENOSPC:
        return ""
    free = shutil.disk_usage(folder.parent).free
    return (f" ({free / 2**20:.0f} MiB free there{f', about {need / 2**20:.0f} MiB needed' if need else ''}; "
            f"`spec cache` lists what spec keeps, or SPEC_CACHE_DIR puts it on another disk)")


def _build(path, work, folder, architecture, dtype, precision, kernel, progress, reader, tensors, tokenizer, config,
           settings) -> Counter:
    from gguf.quants import dequantize
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from spec_cli.exec import quant
    from spec_cli.models import gguf_blocks

    skeleton = _skeleton(config, dtype)
    processor = hf_gguf.TENSOR_PROCESSORS.get(architecture, hf_gguf.TensorProcessor)(config=settings)
    mapping = hf_gguf.get_gguf_hf_weights_map(skeleton, processor, model_type=architecture)  # (the file's names)
    projections = {f"{name}.weight" for name, m in skeleton.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    layout, formats = {}, Counter()

    def process(array, name):
        extra = {"tensors": {}}
        result = processor.process(weights=array, name=name, tensor_key_mapping=mapping, parsed_parameters=extra)
        if result.name is None:  # GPT-2's output.weight, stored aside as lm_head.weight
            return extra["tensors"]["lm_head.weight"].numpy(), "lm_head.weight"
        return result.weights, mapping.get(result.name, mapping.get(result.name.removesuffix(".weight")))
        # (a parameter of no module of its own, gpt-oss's attention sinks: the file's name has .weight)

    def add_int4(target, module, nibbles, scales, zeros, source):
        tensors[f"{module}.nibbles"] = nibbles
        tensors[f"{module}.scales"] = scales.to(quant.ACTIVATIONS)
        tensors[f"{module}.zeros"] = zeros.to(quant.ACTIVATIONS)
        layout[module] = {"kind": "int4", "source": source}

    def add_int4_super(module, nibbles, sc, mn, d, dmin, source="Q4_K"):
        for part, tensor in zip(("nibbles", "sc", "mn", "d", "dmin"), (nibbles, sc, mn, d, dmin)):
            tensors[f"{module}.{part}"] = tensor
        layout[module] = {"kind": "int4 super", "source": source}

    def add_int6(module, values, sc, d, source="Q6_K"):
        tensors[f"{module}.values"], tensors[f"{module}.sc"], tensors[f"{module}.d"] = values, sc, d
        layout[module] = {"kind": "int6", "source": source}

    def add_int8(module, values, scales, zeros, group, source):
        tensors[f"{module}.values"] = values
        tensors[f"{module}.scales"] = scales.to(quant.ACTIVATIONS)
        tensors[f"{module}.zeros"] = zeros.to(quant.ACTIVATIONS)
        layout[module] = {"kind": "int8g", "group": group, "source": source}

    pending = {}  # layer -> the experts' tensors (gate, up) read before their pair

    def blocks(module, kind, data, columns, order, conv1d=False) -> str | None:
        """A projection's blocks kept as they are on spec's kernels (4-bit ones on torch's too, or at int4): the
        format they went to, or None (read as floats)."""
        if kind == "Q4_K" and precision in ("file", "int4") and kernel and not conv1d:
            add_int4_super(module, *gguf_blocks.permute_rows(_int4_super_of(data, columns), order))
            return "int4 (Q4_K)"
        if kind in gguf_blocks.FOUR_BIT and precision in ("file", "int4"):
            nibbles, scales, zeros = gguf_blocks.permute_rows(gguf_blocks.int4(kind, data, len(order), columns),
                                                              order)
            add_int4(f"{module}.weight", module, nibbles, scales, zeros, kind)
            return f"int4 ({kind})"
        if kind == "Q6_K" and precision == "file" and kernel and not conv1d:
            add_int6(module, *gguf_blocks.permute_rows(_int6_of(data, columns), order))
            return "6-bit (Q6_K)"
        if kind == "MXFP4" and precision == "file" and kernel and not conv1d:
            nibbles, exponents = gguf_blocks.permute_rows(
                _in_pieces(lambda part, rows: gguf_blocks.mxfp4(part, rows, columns), data), order)
            tensors[f"{module}.nibbles"], tensors[f"{module}.exponents"] = nibbles, exponents
            layout[module] = {"kind": "fp4", "source": kind}
            return "4-bit floats (MXFP4)"
        if kind in gguf_blocks.EIGHT_BIT and precision == "file" and kernel and columns % quant.GROUP == 0 \
                and not conv1d:
            values, scales, zeros = gguf_blocks.permute_rows(_int8_of(kind, data, columns), order)
            group = columns // scales.shape[1]
            add_int8(module, values, scales, zeros, group, kind)
            return f"8-bit ({kind}{', in 16s' if group == 16 else ''})"
        return None

    def experts(tensor) -> None:
        """A mixture's gate, up or down weights of every expert (one tensor [experts, out, in]) as each expert's
        projection (`quant.Experts`): a gate and up of one kind as one (`gate_up`, their rows one after the
        other: no copy side by side made at load), blocks as they are where `blocks` keeps them, else in the
        dtype."""
        layer, part = EXPERTS.match(tensor.name).groups()
        held = mapping.get(f"blk.{layer}.ffn_{part}_exps")
        if held is None:
            raise SpecError(f"{path}: {tensor.name} belongs to no experts of the model its settings describe")
        pending.setdefault(layer, {})[part] = tensor
        if part != "down" and len(pending[layer].keys() & {"gate", "up"}) < 2:
            return  # (its gate or up to come)
        parts = [pending[layer].pop(p) for p in ("gate", "up")] if part != "down" else [pending[layer].pop(part)]
        fused = len(parts) == 2 and parts[0].tensor_type == parts[1].tensor_type
        groups = [("gate_up", parts)] if fused else [(EXPERTS.match(t.name).group(2), [t]) for t in parts]
        for name, group in groups:
            kind = group[0].tensor_type.name
            count, rows, columns = (int(n) for n in reversed(group[0].shape))
            kept = None
            for e in range(count):
                module = f"{held.rpartition('.')[0]}.{name}.{e}"
                data = np.concatenate([t.data[e] for t in group]) if len(group) > 1 else group[0].data[e]
                kept = blocks(module, kind, data, columns, np.arange(rows * len(group)))
                if kept is None:
                    tensors[f"{module}.weight"] = _floats(data, group[0].tensor_type).reshape(
                        rows * len(group), columns).to(dtype).contiguous()
            formats[f"{kept or str(dtype).removeprefix('torch.') + f' (from {kind})'}, experts"] += len(group)
            for t in group:  # (a gate read again with its up: its pages dropped again)
                _release(reader, t)

    def latent(tensor) -> None:
        """DeepSeek's kv_b (each head's key rows, then its value rows, over the latent) from the k_b ([heads,
        latent, key width]: each head's transposed) and v_b ([heads, value width, latent]) llama.cpp's converter
        split it into, in the dtype (k_b's rows are not the product's: no blocks to keep)."""
        layer, part = LATENT.match(tensor.name).groups()
        pending.setdefault(f"latent {layer}", {})[part] = tensor
        if len(pending[f"latent {layer}"]) < 2:
            return
        pair = pending.pop(f"latent {layer}")
        k_b, v_b = pair["k"], pair["v"]
        target = mapping.get(f"blk.{layer}.attn_kv_b.weight")
        if target is None:
            raise SpecError(f"{path}: {tensor.name} belongs to no attention of the model its settings describe")
        keys, values = (_floats(t.data, t.tensor_type).reshape(
            [int(n) for n in reversed(t.shape)]) for t in (k_b, v_b))
        tensors[target] = torch.cat([keys.transpose(1, 2), values], 1).reshape(-1, keys.shape[1]).to(dtype)
        for t in (k_b, v_b):
            formats[f"{str(dtype).removeprefix('torch.')} (from {t.tensor_type.name}, kv_b)"] += 1
            _release(reader, t)

    layers = getattr(config, "num_hidden_layers", None)
    for done, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(done, len(reader.tensors))
        try:
            kind = tensor.tensor_type.name
            block = BLOCK.match(tensor.name)
            if block and layers is not None and int(block[1]) >= layers:
                formats["left out (multi-token prediction layers)"] += 1  # (past the decoder's layers)
                continue
            if EXPERTS.match(tensor.name):
                experts(tensor)
                continue
            if found := EXPERT_BIASES.match(tensor.name):
                held = mapping.get(f"blk.{found[1]}.ffn_{found[2]}_exps")
                if held is None:
                    raise SpecError(f"{path}: {tensor.name} belongs to no experts of the model its settings describe")
                tensors[f"{held.rpartition('.')[0]}.{found[2]}_bias"] = torch.from_numpy(
                    np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
                formats["float32 (biases)"] += 1
                continue
            if LATENT.match(tensor.name):
                latent(tensor)
                continue
            rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else None
            columns = int(tensor.shape[0])
            probe, target = process(np.arange(rows).reshape(rows, 1), tensor.name) if rows else (None, None)
            if rows is None:
                array, target = process(dequantize(tensor.data, tensor.tensor_type), tensor.name)
            if target is None:
                continue
            module = target.removesuffix(".weight")
            is_projection = target in projections
            if target.endswith(".bias") and target.removesuffix(".bias") + ".weight" in projections:
                tensors[target] = torch.from_numpy(np.array(array, dtype=np.float32))  # (a quantized projection's
                formats["float32 (biases)"] += 1                                       # takes it in bfloat16)
                continue
            order = probe[:, 0] if probe is not None and probe.shape == (rows, 1) else np.arange(rows or 0)
            if is_projection:
                kept = blocks(module, kind, tensor.data, columns, order,
                              type(skeleton.get_submodule(module)).__name__ == "Conv1D")
                if kept is not None:
                    formats[kept] += 1
                    continue
            if (tensor.name == "token_embd.weight" and kind in BLOCKS and probe is not None
                    and probe.shape == (rows, 1) and (order == np.arange(rows)).all()):
                # kept as the file's blocks, dequantized at load: in the compute dtype a large vocabulary's
                # embedding alone would hold the cache past 1.5x the file (Gemma 3's 262k words: well past it)
                tensors[f"{target}.{kind.lower()}"] = torch.from_numpy(np.array(tensor.data).reshape(rows, -1))
                formats[f"{kind} (the embedding, kept as blocks)"] += 1
                continue
            in_order = probe is not None and probe.shape == (rows, 1) and (order == np.arange(rows)).all()
            if (is_projection and precision == "int4" and in_order and columns % quant.GROUP == 0
                    and type(skeleton.get_submodule(module)).__name__ != "Conv1D"):
                # requantized a piece of rows at a time (a draft's 151,936-word head whole in float32 and
                # min-max's temporaries beside it: gigabytes at the first load)
                add_int4(target, module, *_in_pieces(lambda part, n: quant.int4_of(
                    _floats(part, tensor.tensor_type)), tensor.data), f"int4 (from {kind})")
                formats[f"int4 (from {kind})"] += 1
                continue
            if in_order and not is_projection:
                weight = _dequantized(tensor.data, tensor.tensor_type, rows, dtype)  # rows as they are: a piece at a time, in the dtype
            else:
                array, target = process(dequantize(tensor.data, tensor.tensor_type), tensor.name)
                weight = torch.from_numpy(np.require(array, requirements=["C", "W"]))  # (a copy only if it must)
            if is_projection and type(skeleton.get_submodule(module)).__name__ == "Conv1D":
                weight = weight.t()  # as [out, in]
            if is_projection and (precision in ("int4", "int8") or (precision == "file" and kind == "Q8_0")):
                if precision == "int8":
                    values, scales = quant.int8_of(weight)
                    tensors[f"{module}.int8"], tensors[f"{module}.scales"] = values, scales.to(quant.ACTIVATIONS)
                    layout[module] = {"kind": "int8", "source": f"int8 (from {kind})"}
                    formats[f"int8 (from {kind})"] += 1
                elif precision == "int4" and weight.shape[1] % quant.GROUP == 0:
                    add_int4(target, module, *quant.int4_of(weight), f"int4 (from {kind})")
                    formats[f"int4 (from {kind})"] += 1
                elif kind == "Q8_0" and weight.shape[1] % quant.GROUP == 0:
                    add_int4(target, module, *gguf_blocks.permute_rows(gguf_blocks.q8_halves(tensor.data, rows, columns),
                                                                       order), "Q8_0")
                    layout[module]["kind"] = "int4x2"
                    formats["int8 as two int4 (Q8_0)"] += 1
                else:
                    tensors[target] = weight.to(dtype).contiguous()
                    formats[str(dtype).removeprefix("torch.")] += 1
                continue
            if type(skeleton.get_submodule(target.rpartition(".")[0])).__name__ == "Conv1D" and weight.dim() == 2:
                weight = weight.t()
            held = _held(skeleton, target)
            if held is not None and weight.shape != held and weight.numel() == held.numel():
                weight = weight.reshape(held)  # (ERNIE's expert bias [experts] in the file, [1, experts] held)
            tensors[target] = weight.to(dtype if weight.is_floating_point() else weight.dtype).contiguous()
            formats[f"{str(dtype).removeprefix('torch.')} (from {kind})"] += 1
        finally:
            _release(reader, tensor)
    from spec_cli.models import gguf_archs

    for name, tensor in gguf_archs.metadata_tensors(reader, config).items():  # (Apertus's xIELU)
        tensors[name] = tensor
        formats["float32 (settings)"] += 1
    head = skeleton.get_output_embeddings()
    names = {t.name for t in reader.tensors}
    if (precision == "file" and "output.weight" not in names and "token_embd.weight" in names and head is not None
            and getattr(config, "tie_word_embeddings", False) and head.in_features % quant.GROUP == 0):
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        module = next(n for n, m in skeleton.named_modules() if m is head)
        kind, columns = embedding.tensor_type.name, int(embedding.shape[0])
        # the head reads the embedding's own blocks: made from them at load where the cache keeps them (a large
        # vocabulary's head and embedding both stored would hold the cache past 1.5x the file), else stored
        blocks = next((key for key in tensors.header if key.endswith(f".{kind.lower()}")), None)
        if kind == "Q4_K" and kernel:
            if blocks is not None:
                layout[module] = {"kind": "int4 super", "source": kind, "blocks": blocks}
            else:
                add_int4_super(module, *_int4_super_of(embedding.data, columns))
            formats[f"int4 ({kind}, the tied head)"] += 1
        elif kind in gguf_blocks.FOUR_BIT:
            if blocks is not None:
                layout[module] = {"kind": "int4", "source": kind, "blocks": blocks}
            else:
                add_int4(module + ".weight", module, *_head_of(kind, embedding.data, columns), kind)
            formats[f"int4 ({kind}, the tied head)"] += 1
        elif kind == "Q6_K" and kernel:
            if blocks is not None:
                layout[module] = {"kind": "int6", "source": kind, "blocks": blocks}
            else:
                add_int6(module, *_int6_of(embedding.data, columns))
            formats["6-bit (Q6_K, the tied head)"] += 1
        elif kind in gguf_blocks.EIGHT_BIT and kind != "Q8_0" and kernel:
            if blocks is not None:
                layout[module] = {"kind": "int8g", "source": kind, "blocks": blocks}
            else:
                add_int8(module, *_int8_of(kind, embedding.data, columns), gguf_blocks.group_of(kind), kind)
            formats[f"8-bit ({kind}, the tied head)"] += 1
        elif kind == "Q8_0" and kernel:  # (elsewhere it stays tied in the compute dtype: as two halves on
            # torch's int4 kernel it was no faster than bfloat16 on a Xeon with AMX)
            if blocks is not None:
                layout[module] = {"kind": "int4x2", "source": "Q8_0", "blocks": blocks}
            else:
                add_int4(module + ".weight", module, *_head_of(kind, embedding.data, columns), "Q8_0")
                layout[module]["kind"] = "int4x2"
            formats["int8 as two int4 (Q8_0, the tied head)"] += 1
    if progress is not None:
        progress(len(reader.tensors), len(reader.tensors))
    _publish(work, folder, lambda: (tensors.close(), config.save_pretrained(work), tokenizer.save_pretrained(work)),
             {"file": str(path), "dtype": str(dtype), "precision": precision, "layout": layout, "formats": formats},
             "the packed model")
    return formats


def _held(skeleton, target: str) -> torch.Size | None:
    """The shape the model holds `target` in (a parameter or buffer), or None."""
    module, _, name = target.rpartition(".")
    found = getattr(skeleton.get_submodule(module), name, None)
    return found.shape if isinstance(found, torch.Tensor) else None


def _floats(data, kind) -> torch.Tensor:
    """gguf's dequantized values of blocks of GGML type `kind` as a tensor (a float kind's are the file's own,
    read-only: copied, as torch takes no read-only array)."""
    from gguf.quants import dequantize

    values = dequantize(data, kind)
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _dequantized(data, kind, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D tensor's blocks (`data`, of GGML type `kind`) dequantized piece by piece into `dtype` (a large
    embedding never whole in float32; a piece is a MiB of blocks: gguf's dequantizer makes several temporaries
    of a piece's size)."""
    piece = _piece(data)
    out = None
    for first in range(0, rows, piece):
        part = _floats(data[first:first + piece], kind)
        if out is None:
            out = torch.empty(rows, part.shape[-1], dtype=dtype)
        out[first:first + part.shape[0]] = part
    return out


def _tied(config, model) -> bool:
    """Whether the head will share the embedding's table (it is no quantized module of its own)."""
    return getattr(config, "tie_word_embeddings", False) and isinstance(model.get_output_embeddings(), torch.nn.Linear)


class RowsFromBlocks(torch.nn.Embedding):
    """An embedding whose rows are dequantized from the file's blocks when looked up, as llama.cpp's get_rows:
    the model holds the blocks (Gemma 3's 262k-word table: 94 MB of Q4_0 against 335 MB in bfloat16). A row is
    the same values as the table dequantized whole (gguf's dequantizer, then the compute dtype). `weight` is an
    empty table of the compute dtype (what code reading the embedding's dtype finds)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        rows = dequantize(self.table[input.reshape(-1).cpu().numpy()], self.block_kind)  # (a token's row: cheap)
        return torch.from_numpy(rows).to(self.weight.dtype).reshape(*input.shape, -1).to(input.device)


def rows_from_blocks(embedding: torch.nn.Embedding, blocks: torch.Tensor, kind, dtype: torch.dtype) -> None:
    """Make `embedding` (an nn.Embedding or a subclass, whose own forward then calls this one's) read its rows
    from `blocks` [rows, bytes]."""
    cls = type(embedding)
    if cls is not RowsFromBlocks and not issubclass(cls, RowsFromBlocks):
        embedding.__class__ = RowsFromBlocks if cls is torch.nn.Embedding else type(
            f"{cls.__name__}FromBlocks", (cls, RowsFromBlocks), {})
    embedding.weight = torch.nn.Parameter(torch.empty(0, embedding.embedding_dim, dtype=dtype), requires_grad=False)
    embedding.register_buffer("blocks", blocks.contiguous(), persistent=False)
    embedding.table, embedding.block_kind = embedding.blocks.numpy(), kind  # (the same memory)


def _head_of(kind: str, raw, columns: int):
    """A tied head's int4 (nibbles, scales, zeros) from its embedding's blocks [rows, bytes]: the 4-bit values as
    they are, Q8_0 as two int4 halves adding up to its 8-bit values, a piece of rows at a time (a large
    embedding's temporaries never whole)."""
    from spec_cli.models import gguf_blocks

    if kind == "Q8_0":
        return _in_pieces(lambda part, rows: gguf_blocks.q8_halves(part, rows, columns), raw)
    return _in_pieces(lambda part, rows: gguf_blocks.int4(kind, part, rows, columns), raw)


def _int8_of(kind: str, raw, columns: int):
    """A 5-, 6- or 8-bit tensor's (values, scales, zeros) from its blocks [rows, bytes], a piece of rows at a time
    (a large head's temporaries never whole)."""
    from spec_cli.models import gguf_blocks

    return _in_pieces(lambda part, rows: gguf_blocks.int8(kind, part, rows, columns)[:3], raw)


def _int4_super_of(raw, columns: int):
    """A Q4_K tensor's (nibbles, sc, mn, d, dmin) from its blocks [rows, bytes], a piece of rows at a time."""
    from spec_cli.models import gguf_blocks

    return _in_pieces(lambda part, rows: gguf_blocks.q4_k(part, rows, columns), raw)


def _int6_of(raw, columns: int):
    """A Q6_K tensor's (values, sc, d) from its blocks [rows, bytes], a piece of rows at a time."""
    from spec_cli.models import gguf_blocks

    return _in_pieces(lambda part, rows: gguf_blocks.q6_k(part, rows, columns), raw)


def _piece(raw) -> int:
    """Rows of blocks [rows, bytes] that make about a MiB."""
    return max(16, (1 << 20) // max(1, raw.shape[-1]))


def _in_pieces(make, raw):
    """`make(rows of raw, how many)` -> tensors of those rows, a piece at a time, into tensors for all the rows
    (the pieces never held all at once beside the result)."""
    rows, out, piece = raw.shape[0], None, _piece(raw)
    for first in range(0, rows, piece):
        parts = make(raw[first:first + piece], min(piece, rows - first))
        if out is None:
            out = tuple(torch.empty(rows, *t.shape[1:], dtype=t.dtype) for t in parts)
        for whole, t in zip(out, parts):
            whole[first:first + t.shape[0]] = t
    return out


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # projections of one input, one product


def _alike(model: torch.nn.Module) -> None:
    """Projections of one input quantized differently made 8-bit in the smallest group among them, the same
    weights, so that they run as one product; except q, k and v in two runs of one format (a file's q and k in
    Q4_K beside its v in Q6_K): two products side by side, each at its own size (`quant.side_by_side`)."""
    from spec_cli.exec import quant

    for parent in model.modules():
        for names in SIBLINGS:
            parts = [getattr(parent, name, None) for name in names]
            if not all(isinstance(m, quant.Quantized) and m.layout == "vnni" for m in parts):
                continue
            if len(quant.runs(parts)) > (2 if len(names) == 3 else 1):
                group = min(m.group for m in parts)
                for name, m in zip(names, parts):
                    setattr(parent, name, m.as_int8(group))


class Stream:
    """A safetensors file written tensor by tensor (`stream[name] = tensor`), so no more than one tensor is ever
    held for writing: each tensor's bytes go into the file as they come, after `reserve` bytes kept for the
    header, which `close()` writes there padded with spaces (as the format allows). A header longer than that
    (`build` keeps about three times what the files read so far needed) has the bytes copied after it: twice the
    file on disk for a moment."""

    NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
             torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}

    def __init__(self, path: Path, reserve: int = 1 << 12):
        self.path, self.reserve = path, reserve + -reserve % 8  # (the bytes start 8-aligned)
        self.data, self.header, self.offset = path.open("wb"), {}, 0
        self.data.seek(8 + self.reserve)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        self.data.write(memoryview(raw))
        end = self.offset + raw.nbytes
        self.header[name] = {"dtype": self.NAMES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [self.offset, end]}
        self.offset = end

    def close(self) -> None:
        header = json.dumps(self.header, separators=(",", ":")).encode()
        if len(header) <= self.reserve:
            self.data.seek(0)
            self.data.write(self.reserve.to_bytes(8, "little") + header + b" " * (self.reserve - len(header)))
            self.data.close()
            return
        self.data.close()
        header += b" " * (-len(header) % 8)
        side = self.path.with_suffix(".partial")
        self.path.rename(side)
        with self.path.open("wb") as out, side.open("rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            data.seek(8 + self.reserve)
            shutil.copyfileobj(data, out, 1 << 22)
        side.unlink()

    def abandon(self) -> None:
        self.data.close()


class Stored:
    """A safetensors file read tensor by tensor into memory of its own (`get_tensor`, `keys`), without mapping
    the file: a mapped file's pages count as the process's memory once read."""

    DTYPES = {name: dtype for dtype, name in Stream.NAMES.items()}

    def __init__(self, path: Path):
        self.file = path.open("rb")
        size = int.from_bytes(self.file.read(8), "little")
        self.header = {k: v for k, v in json.loads(self.file.read(size)).items() if k != "__metadata__"}
        self.start = 8 + size

    def __enter__(self) -> "Stored":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return list(self.header)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        first, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=self.DTYPES[entry["dtype"]])
        self.file.seek(self.start + first)
        self.file.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out


def _release(reader, tensor) -> None:
    """Drop the pages of a tensor the reader mapped and we have read (they would count as ours)."""
    import mmap

    memory = getattr(reader.data, "_mmap", None)
    if memory is None or not hasattr(memory, "madvise"):
        return
    start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    try:
        memory.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass


# glibc's malloc: allocations from this size up get mappings of their own (M_MMAP_THRESHOLD); free memory past the
# top of the heap beyond M_TRIM_THRESHOLD goes back to the system
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LOADING_MAPPED = 1 << 20
DECODING_MAPPED = 32 << 20  # (glibc's largest threshold)
DECODING_KEPT = 64 << 20


@contextlib.contextmanager
def allocations_for_loading() -> Iterator[None]:
    """Within: allocations of 1 MiB and up from mappings of their own, given back when freed (loading makes many
    transient tensors, and from the heap they leave it fragmented: a 1B model's peak noticeably higher). After: up
    to 32 MiB from the heap, kept when freed: decoding makes the same transient tensors every forward (logits,
    activations, a product's quantized rows), and mapped afresh each costs a page fault every 4 KB it touches (the
    real pair staged, HumanEval 64-95: 7-9% of its time; `benchmarks/reports/` session 15)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOADING_MAPPED)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, DECODING_MAPPED)
            libc.mallopt(M_TRIM_THRESHOLD, DECODING_KEPT)


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def from_cache(folder: Path, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) from a packed cache folder: projections made from their stored values, everything
    else assigned as stored, the head tied to the embedding where the model ties them and the file has none."""
    from gguf import GGMLQuantizationType
    from transformers import AutoConfig, AutoTokenizer

    from spec_cli.exec import quant
    from spec_cli.models import gguf_blocks

    source = json.loads((folder / "source.json").read_text())
    config = AutoConfig.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = _skeleton(config, dtype)
    state = {}
    with Stored(folder / "weights.safetensors") as f:
        names = {id(m): name for name, m in model.named_modules()}
        for parent, attribute, experts in quant.experts_of(model):  # (each expert's projections as `build` kept them)
            fused = f"{names[id(experts)]}.gate_up.0"
            setattr(parent, attribute, quant.Experts.like(experts, fused in source["layout"]
                                                          or f"{fused}.weight" in f.header))
        for module, what in source["layout"].items():
            parent, _, attribute = module.rpartition(".")
            bias = f.get_tensor(f"{module}.bias") if f"{module}.bias" in f.header else None
            if what["kind"] == "int8":
                new = quant.Quantized.int8(f.get_tensor(f"{module}.int8"), f.get_tensor(f"{module}.scales"), device,
                                           bias, source=what["source"])
            elif what["kind"] == "int4 super":
                if "blocks" in what:  # a tied head, made from the embedding's blocks
                    parts = _int4_super_of(f.get_tensor(what["blocks"]).numpy(),
                                           model.get_input_embeddings().embedding_dim)
                else:
                    parts = (f.get_tensor(f"{module}.{part}") for part in ("nibbles", "sc", "mn", "d", "dmin"))
                new = quant.Quantized.int4_super(*parts, device, bias, what["source"])
            elif what["kind"] == "int6":
                if "blocks" in what:  # a tied head, made from the embedding's blocks
                    parts = _int6_of(f.get_tensor(what["blocks"]).numpy(), model.get_input_embeddings().embedding_dim)
                else:
                    parts = (f.get_tensor(f"{module}.{part}") for part in ("values", "sc", "d"))
                new = quant.Quantized.int6(*parts, device, bias, what["source"])
            elif what["kind"] == "fp4":
                new = quant.Quantized.fp4(f.get_tensor(f"{module}.nibbles"), f.get_tensor(f"{module}.exponents"),
                                          device, bias, what["source"])
            elif what["kind"] == "int8g":
                if "blocks" in what:  # a tied head, made from the embedding's blocks
                    kind = what["blocks"].rpartition(".")[2].upper()
                    values, scales, zeros = _int8_of(kind, f.get_tensor(what["blocks"]).numpy(),
                                                     model.get_input_embeddings().embedding_dim)
                    group = gguf_blocks.group_of(kind)
                else:
                    values, scales, zeros = (f.get_tensor(f"{module}.{part}") for part in ("values", "scales", "zeros"))
                    group = what["group"]
                new = quant.Quantized.int8_grouped(values, scales, zeros, device, bias, group, what["source"])
            else:
                if "blocks" in what:  # a tied head, made from the embedding's blocks
                    nibbles, scales, zeros = _head_of(what["blocks"].rpartition(".")[2].upper(),
                                                      f.get_tensor(what["blocks"]).numpy(),
                                                      model.get_input_embeddings().embedding_dim)
                    parts = nibbles, scales.to(quant.ACTIVATIONS), zeros.to(quant.ACTIVATIONS)  # (as `build` stores them)
                else:
                    parts = (f.get_tensor(f"{module}.nibbles"), f.get_tensor(f"{module}.scales"),
                             f.get_tensor(f"{module}.zeros"))
                new = quant.Quantized.int4(*parts, device, bias, source=what["source"])
                if what["kind"] == "int4x2":
                    new = quant.q8(new)
            setattr(model.get_submodule(parent) if parent else model, attribute, new)
        layout = set(source["layout"])
        for key in f.keys():
            name, _, suffix = key.rpartition(".")
            if suffix.upper() in BLOCKS:
                blocks = f.get_tensor(key)
                kind = GGMLQuantizationType[suffix.upper()]
                embedding = model.get_input_embeddings()
                if (device.type == "cpu" and isinstance(embedding, torch.nn.Embedding) and not _tied(config, model)
                        and name == next(n for n, m in model.named_modules() if m is embedding) + ".weight"):
                    rows_from_blocks(embedding, blocks, kind, dtype)  # (its head is not its table)
                else:
                    state[name] = _dequantized(blocks.numpy(), kind, blocks.shape[0], dtype).to(device)
                del blocks
            elif key.rpartition(".")[0] not in layout:
                tensor = f.get_tensor(key)  # (a bias is stored in float32: cast as its float projection is)
                state[key] = tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
    model.load_state_dict(state, strict=False, assign=True)
    _alike(model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if _tied(config, model) and head.weight.is_meta and not embedding.weight.is_meta:
        head.weight = embedding.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SpecError(f"{source['file']}: the GGUF file has no tensor for {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.to(device).eval()
    model.gguf_formats = source["formats"]
    return model, tokenizer
