"""Load a safetensors checkpoint one tensor at a time, quantizing each layer as it arrives.

`from_pretrained` followed by quantization holds, at its peak, the whole full-precision model plus
the checkpoint's pages (it maps the files: SmolLM2-135M's converted GGUF is float32, 540 MB), and
glibc then keeps most of what was freed. Here the model is built with its parameters on the meta
device (no memory; buffers such as RoPE's `inv_freq` are computed for real, as in `__init__`), and
each tensor is read with plain file reads (no mapping), cast to the model dtype and put in place;
a linear layer is quantized the moment its weight is in, the embedding/LM head once it is. The
peak is the quantized model plus one full-precision tensor (the embedding, for a small model).

Only a checkpoint whose tensor names and shapes are exactly the model's parameters (tied ones
aside) and persistent buffers loads this way; anything else (renamed keys transformers converts,
sharded formats with extra metadata, a bias the class lacks...) returns None and the caller takes
the `from_pretrained` path. Little-endian files on a little-endian host (safetensors' own rule).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
# bytes read per call: bounds the raw buffer that sits beside the converted tensor
READ_CHUNK_BYTES = 16 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def read_index(model_dir: str) -> dict[str, tuple[Path, dict]] | None:
    """tensor name -> (file, header entry) over the directory's safetensors files; None when it has
    none or a header is malformed."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    index: dict[str, tuple[Path, dict]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > MAX_HEADER_BYTES:
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        header.pop("__metadata__", None)
        for name, entry in header.items():
            if entry.get("dtype") not in _DTYPES or name in index:
                return None
            entry["_data_start"] = 8 + size
            index[name] = (path, entry)
    return index


def read_tensor(path: Path, entry: dict, dtype: torch.dtype | None, file=None) -> torch.Tensor:
    """One tensor from a safetensors file, converted to `dtype` (None: as stored) chunk by chunk."""
    stored = _DTYPES[entry["dtype"]]
    shape = list(entry["shape"])
    begin, end = entry["data_offsets"]
    start = entry["_data_start"] + begin
    out = torch.empty(shape, dtype=dtype or stored)
    flat = out.view(-1)
    itemsize = torch.empty((), dtype=stored).element_size()
    assert (end - begin) == flat.numel() * itemsize, (entry, shape)
    per_chunk = max(1, READ_CHUNK_BYTES // itemsize)
    with contextlib.ExitStack() as stack:
        f = file or stack.enter_context(open(path, "rb", buffering=0))
        raw = torch.empty(min(per_chunk, flat.numel()) * itemsize, dtype=torch.uint8)
        for first in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - first)
            view = raw[:count * itemsize]
            f.seek(start + first * itemsize)
            got = f.readinto(memoryview(view.numpy()))
            if got != count * itemsize:
                raise OSError(f"{path.name}: short read ({got} of {count * itemsize} bytes)")
            flat[first:first + count] = view.view(stored)
    return out


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lands on the meta device; buffers stay real.

    nn.Linear & co. allocate `torch.empty` (untouched, so never resident) and it moves to meta at
    once; HF's weight initialization then runs on meta tensors, which costs nothing. Not thread
    safe (it patches nn.Module for the duration); loading happens on one thread."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps them otherwise): malloc_trim(0)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(libc_name).malloc_trim(0)


def stream_load(model: torch.nn.Module, model_dir: str, dtype: torch.dtype,
                on_linear: Callable[[torch.nn.Module, str], None], linear_names: set[str],
                on_embeddings: Callable[[], None] | None = None) -> bool:
    """Fill `model` (built under parameters_on_meta) from `model_dir`'s safetensors.

    `on_linear(parent, child)` runs as soon as the linear layer `parent.child` (one of
    `linear_names`) has all its parameters; `on_embeddings()` once the embedding (and an untied
    LM head) are in. Returns False, having loaded nothing, when the checkpoint does not match the
    model's parameters exactly (then the caller loads another way)."""
    index = read_index(model_dir)
    if index is None:
        return False
    tied = _tied(model)
    expected = {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in tied}
    if set(index) != set(expected) or any(list(index[n][1]["shape"]) != list(expected[n].shape) for n in index):
        log.info("%s: checkpoint names/shapes differ from the model's; loading it whole", model_dir)
        return False
    modules = dict(model.named_modules())
    pending = {name: {n for n, _ in modules[name].named_parameters(recurse=False)} for name in linear_names}
    embedding_names = {_param_name(model, model.get_input_embeddings())}
    head = model.get_output_embeddings()
    if head is not None and _param_name(model, head) not in tied:
        embedding_names.add(_param_name(model, head))
    files: dict[Path, object] = {}
    try:
        for name in sorted(index, key=lambda n: (str(index[n][0]), index[n][1]["data_offsets"][0])):
            path, entry = index[name]
            if path not in files:
                files[path] = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below)
            owner, _, attr = name.rpartition(".")
            module = modules[owner]
            target = expected[name]
            value = read_tensor(path, entry, dtype if target.is_floating_point() else target.dtype, files[path])
            if attr in module._parameters:
                module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[attr] = value
            if owner in pending:
                pending[owner].discard(attr)
                if not pending[owner]:
                    del pending[owner]
                    parent, _, child = owner.rpartition(".")
                    on_linear(modules[parent], child)
            embedding_names.discard(name)
            if not embedding_names and on_embeddings is not None:
                _tie(model, tied)
                on_embeddings()
                on_embeddings = None
            del value
    finally:
        for f in files.values():
            f.close()
    _tie(model, tied)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert not left, left[:4]
    release_freed_memory()
    return True


def _tied(model: torch.nn.Module) -> set[str]:
    """Parameter names that share another's tensor (the tied LM head), as a checkpoint omits them."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return set()
    assert head.weight is embedding.weight or head.weight.device.type == "meta"
    return {f"{_module_name(model, head)}.weight"}


def _tie(model: torch.nn.Module, tied: set[str]) -> None:
    if tied:
        head = model.get_output_embeddings()
        if isinstance(head, torch.nn.Linear):
            head.weight = model.get_input_embeddings().weight


def _module_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is target)


def _param_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return f"{_module_name(model, module)}.weight"


def load_quantized(name: str, model_dir: str, dtype: torch.dtype, scheme: str, backend: str, embedding: str,
                   gguf_path=None) -> tuple[torch.nn.Module, str] | None:
    """The CPU model of a local full-precision checkpoint, quantized while it loads, and its label;
    None when this path does not apply (pre-quantized, nothing to quantize, custom code, keys that
    need transformers' conversions): then load_model takes from_pretrained + quantize_model."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from batchgen.engine.model.load_attention import load_attention
    from batchgen.engine.quant import quantize as q
    from batchgen.engine.quant.embedding import quantize_embeddings
    from batchgen.engine.quant.plan import plan_quantization, requested_scheme

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # custom code, unknown model type...: from_pretrained says what is wrong
        return None
    if getattr(config, "quantization_config", None):
        return None
    plan = plan_quantization(config, requested_scheme(scheme, name, gguf_path), backend, embedding,
                             torch.device("cpu"))
    if plan.scheme == "none" and plan.embedding == "none":
        return None
    if plan.calibrated:  # its outlier channels come from running the whole full-precision model first
        return None
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=load_attention(config))
    names = q.quantizable_linear_names(model, q.linear_group_size(plan)) if plan.scheme != "none" else set()
    if not stream_load(model, model_dir, dtype, lambda parent, child: q.quantize_linear(parent, child, plan, "cpu"),
                       names, (lambda: quantize_embeddings(model)) if plan.embedding != "none" else None):
        return None
    with contextlib.suppress(OSError):  # no generation_config.json: the model config's defaults stand
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    log.info("%s: quantized while loading (%s)", name, plan.label)
    return model.eval(), plan.label
