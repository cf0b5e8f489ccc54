"""Loading models and tokenizers from local folders or the Hugging Face hub, on the right device and dtype."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.core import paths
from spec_cli.core.errors import OutOfMemory, SpecError, first_line
from spec_cli.core.errors import say as say_line
from spec_cli.core.families import check_architecture, context_length
from spec_cli.core.hardware import pick_dtype
from spec_cli.core.settings import ModelRef
from spec_cli.exec import placement as offload
from spec_cli.models import hub


@dataclass
class Loaded:
    ref: ModelRef
    model: torch.nn.Module
    tokenizer: object

    @property
    def context(self) -> int:
        return context_length(self.model.config)


def _is_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def load_tokenizer(ref: ModelRef):
    """A model's tokenizer alone: a folder's, the hub's, or a GGUF file's own (read from the file)."""
    from transformers import AutoTokenizer

    from spec_cli.models import gguf

    return gguf.file_tokenizer(ref) if gguf.is_gguf(ref) else _from_pretrained(AutoTokenizer, ref)


def _from_pretrained(loader, ref: ModelRef, **kwargs):
    """Local folder, else the hub cache, else the hub; one clear error when none has it."""
    if _is_path(ref.model):
        path = Path(ref.model).expanduser()
        if not path.is_dir():
            raise SpecError(f"model folder not found: {ref.model}")
        try:
            return loader.from_pretrained(str(path), **kwargs)
        except (OSError, ValueError) as e:
            raise SpecError(f"cannot load the model in {ref.model}: {first_line(e)}") from None
    return hub.fetch(lambda: loader.from_pretrained(ref.model, revision=ref.revision, local_files_only=True,
                                                    **kwargs),
                     lambda: loader.from_pretrained(ref.model, revision=ref.revision, **kwargs),
                     f"model '{ref.model}' (not a local folder)", f"hf download {ref.model}",
                     "point the profile at a local folder")



def dtype_for(ref: ModelRef, name: str, device: torch.device, quantize: str | None) -> torch.dtype:
    """The dtype `name` means for this model on `device` (`pick_dtype`): "auto" on a CPU without fast bfloat16
    (an AVX2 CPU) is bfloat16 wherever spec's kernels run: a GGUF file as stored or a model quantized to int4 or
    int8 on its integer kernels (the Qwen 1.5B's file on a Zen 3: 27-31 tok/s, against 21-22 in float32), a float
    model on its bfloat16 products (`mm16`; pyfam on a Zen 3: 395 tok/s, against 205 in float32)."""
    from spec_cli.exec import native
    from spec_cli.models import gguf

    kind = ref.quantize or quantize or "auto"
    quantized = kind in ("int4", "int8") or (gguf.is_gguf(ref) and kind == "auto")
    kernels = native.wanted() and native.variant() is not None
    if kernels and not quantized and name == "auto" and device.type == "cpu":
        kernels = native.int4() is not None  # (built: else torch's bfloat16 product, slower than float32 there)
    return pick_dtype(name, device, own_kernels=kernels)

def load(ref: ModelRef, device: torch.device, dtype: torch.dtype, untested: bool = False,
         say: Callable[[str], None] = say_line, quantize: str | None = None,
         max_memory: offload.MaxMemory | None = None) -> Loaded:
    """A model and its tokenizer (from a folder, the hub, or a GGUF file), in `dtype` unless its reference
    names one, its projections at `quantize` unless its reference names one (None or "auto": as stored, a GGUF
    file at its own quantization; "none", "int8", "int4"); with `max_memory`, spread over the devices it names
    and disk (spec_cli/offload.py). A family spec has no test for is checked on first load
    (spec_cli/firstload.py), unless `untested` (spec check runs the check itself) or SPEC_ALLOW_UNTESTED=1."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from spec_cli.exec import quant
    from spec_cli.models import firstload, gguf

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    model_dtype = dtype_for(ref, ref.dtype, device, quantize) if ref.dtype else dtype
    kind = ref.quantize or quantize or "auto"
    name = f"model '{ref.model}'" + (f" ({ref.gguf_file})" if ref.gguf_file else "")
    if max_memory:
        refuse_offloading(ref, kind)
    try:
        native = gguf.load_model(ref, device, model_dtype, kind, say) if gguf.is_gguf(ref) else None
        if native is not None:
            model, tokenizer = native
            check_architecture(model.config, name, untested=True)
        else:
            source = gguf.prepare(ref, model_dtype, say) if gguf.is_gguf(ref) else ref
            config = _from_pretrained(AutoConfig, source)
            check_architecture(config, name, untested=True)  # untested families are checked once loaded, below
            tokenizer = _from_pretrained(AutoTokenizer, source)
            spread = offloading(source, config, model_dtype, max_memory, name) if max_memory else {}
            model = _from_pretrained(AutoModelForCausalLM, source, dtype=model_dtype, **spread)
            if spread:
                offload.drop_idle_hooks(model)
            else:
                model.to(device)
            model.eval()
            if kind in ("int4", "int8"):
                if kind == "int4" and device.type == "cpu":
                    quant.native_kernel(say)  # (its first build, said)
                quant.split_experts(model)  # (a mixture's experts quantized as any projection)
                quant.quantize_model(model, kind, copies=paths.cache_dir() / "quantized")
            elif model_dtype == torch.bfloat16 and device.type == "cpu":
                quant.split_experts(model)  # (each expert's products packed: a row's bits its own)
        quant.route_rows_alone(model)
    except torch.cuda.OutOfMemoryError:
        raise OutOfMemory(f"out of {device} memory loading {ref.model} in {str(model_dtype).removeprefix('torch.')}: "
                        f"try --dtype bfloat16 or float16, --quantize int4, --max-memory {device.type}=SIZE,cpu=SIZE "
                        f"(the rest in CPU memory and on disk), a smaller model, or --device cpu") from None
    if not untested:
        firstload.ensure(model, tokenizer, name, say)
    return Loaded(ref, model, tokenizer)


def refuse_offloading(ref: ModelRef, kind: str) -> None:
    from spec_cli.models import gguf

    if gguf.is_gguf(ref):
        raise SpecError(f"--max-memory: GGUF files are not offloaded ({ref.model}); run it without --max-memory, "
                        f"or point at a Hugging Face folder of the model")
    if kind in ("int4", "int8"):
        raise SpecError(f"--max-memory: weights quantized at load (quantize = {kind}) are not offloaded; use "
                        f"one or the other")


def offloading(source: ModelRef, config, dtype: torch.dtype, limits: offload.MaxMemory, name: str) -> dict:
    """from_pretrained's arguments that spread the model as `limits` say (none when it fits whole); a model whose
    disk part fits nowhere is one line saying what it needs."""
    import logging

    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)  # (that parameters are on `meta`)
    planned = offload.place(config, dtype, limits)
    if len(planned.bytes) == 1 and not planned.disk:  # it fits whole where it runs
        return {}
    folder = offload.folder(source.model)
    if planned.disk and not _safetensors(source):  # (safetensors are read where they are: nothing is written)
        offload.check_disk(planned, folder, name, dtype, limits)
    return {"device_map": planned.device_map, "offload_folder": str(folder)}


def _safetensors(source: ModelRef) -> bool:
    path = Path(source.model).expanduser()
    return path.is_dir() and any(path.glob("*.safetensors"))


