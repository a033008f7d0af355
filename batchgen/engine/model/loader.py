"""Model + tokenizer loading: the embedded default model, a local directory, a .gguf file, a hub id.

Every path ends in the same place: a safetensors (or, reluctantly, pickle) HF directory loaded with
`from_pretrained`, so the first run and every later run build the model the same way. GGUF files are
dequantized once into a content-keyed cache directory (gguf_cache.py).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from batchgen.engine.model import families, gguf_metadata
from batchgen.engine.model.context_length import context_limit
from batchgen.engine.model.gguf_cache import first_line, gguf_dir, hash_dir, hash_files
from batchgen.engine.model.load_attention import load_attention
from batchgen.engine.model.model_files import DEFAULT_MODEL, default_gguf_path
from batchgen.errors import ConfigError, ModelLoadError, UnsupportedModelError
from batchgen.runtime.stage import slow_stage

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

# CPU default when dtype="auto": bfloat16 where the CPU computes it natively (avx512_bf16 or AMX),
# else float32, where bf16 is emulated and slower. Where it is native, bf16 halves the bytes every
# step reads and runs the CPU's bf16 dot products; greedy texts stay sane (they may diverge from
# float32's after a shared opening).
@functools.cache
def cpu_auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU has native bf16 (read from /proc/cpuinfo on first use), else float32."""
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel  # eval mode, on device, in dtype
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for (or DEFAULT_MODEL)
    revision: str  # sha256[:16] over the weight files and config.json
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: list[int]  # every id that ends a sequence, de-duplicated, in discovery order
    max_context_tokens: int
    quantization: str = "none"  # engine/quant/quantize.py's label: "none", "int4/torchao", "prequantized:quanto", ...


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but CUDA is not available (use --device cpu)")
        return torch.device(device)
    raise ConfigError(f"device must be auto, cpu or cuda; got {device!r}")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return cpu_auto_dtype()
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    if dtype == "float16" and device.type == "cpu":
        log.warning("float16 on CPU is slow and overflow-prone; bfloat16 or float32 is usually better")
    return _DTYPES[dtype]


def load_model(name_or_path: str | None, *, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False, quantize: str = "none", quantize_backend: str = "auto",
               quantize_embedding: str = "auto") -> LoadedModel:
    name = DEFAULT_MODEL if name_or_path in (None, DEFAULT_MODEL) else str(name_or_path)
    with slow_stage(f"loading model {name}", logger=log):
        return _load_model(name_or_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                           quantize=quantize, quantize_backend=quantize_backend, quantize_embedding=quantize_embedding)


def _load_model(name_or_path: str | None, *, device: str, dtype: str, trust_remote_code: bool, quantize: str,
                quantize_backend: str, quantize_embedding: str) -> LoadedModel:
    # transformers' own loading bars and notices are noise in a batch job's log
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    name = DEFAULT_MODEL if name_or_path in (None, DEFAULT_MODEL) else str(name_or_path)
    refuse_unsupported(name, trust_remote_code)  # before a GGUF conversion or any weight is read
    model_dir, revision, gguf = _locate(name)

    streamed = None
    if (quantize != "none" or quantize_embedding not in ("none", "auto")) and torch_device.type == "cpu" \
            and os.path.isdir(model_dir) and not trust_remote_code:
        # quantize each layer as it is read: the full-precision model never exists whole (engine/model/stream_load.py)
        from batchgen.engine.model.stream_load import load_quantized
        from batchgen.engine.quant.checkpoint import check_config_quantization
        check_config_quantization(model_dir, name)
        streamed = load_quantized(name, model_dir, torch_dtype, quantize, quantize_backend, quantize_embedding, gguf)
    if streamed is not None:
        model, quantization = streamed
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception as e:  # as _load_hf reports it
            raise ModelLoadError(f"cannot load the tokenizer of {name!r}: {first_line(e)}") from e
    else:
        model, tokenizer = _load_hf(name, model_dir, torch_dtype, trust_remote_code)
        if not revision:
            revision = hash_dir(_hub_snapshot_dir(name))
        model = model.to(torch_device).eval()
        from batchgen.engine.quant.quantize import apply_at_load  # imports torchao/quanto only when asked
        quantization = apply_at_load(model, name, quantize, quantize_backend, gguf, quantize_embedding, tokenizer)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        log.info("tokenizer of %s has no pad token; using eos %r as pad", name, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, revision=revision,
                       device=torch_device, dtype=torch_dtype, eos_token_ids=find_eos_token_ids(model, tokenizer),
                       max_context_tokens=_max_context(name, model, tokenizer), quantization=quantization)


def refuse_unsupported(name: str, trust_remote_code: bool = False) -> None:
    """Refuse a model the engine cannot run from its config alone (GGUF metadata or config.json),
    naming what is missing (engine/model/families.py). Says nothing where the config cannot be read
    cheaply (a hub id not in the local cache): the load and the engine's own check report it."""
    local = Path(os.path.expanduser(name))
    if name == DEFAULT_MODEL:
        return  # the embedded Llama
    if local.is_file() and local.suffix == ".gguf":
        config = gguf_metadata.config_from_gguf(local)
    elif local.is_dir() and (local / "config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(local, local_files_only=True, trust_remote_code=trust_remote_code)
        except Exception:  # a broken config: from_pretrained reports it in its own words
            return
    else:
        return
    if config is not None:
        families.check_config(config, name)
        log.info("model %s (%s): %s", name, config.model_type, families.describe(config))


def _locate(name: str, *, convert: bool = True) -> tuple[str, str, Path | None]:
    """(HF directory or hub id, revision, the .gguf it came from) of the model `name`. A GGUF is
    converted on first use; with `convert=False` an unconverted one gives model_dir "" instead."""
    local = Path(os.path.expanduser(name))
    if name == DEFAULT_MODEL:
        gguf = default_gguf_path()
        return gguf_dir(gguf, DEFAULT_MODEL, convert), hash_files([gguf]), gguf
    if name.endswith(".gguf") or local.is_file():
        if not local.is_file():
            raise ModelLoadError(f"model file not found: {local}")
        if local.suffix != ".gguf":
            raise ModelLoadError(f"model {name!r} is a file but not a .gguf; pass a model directory")
        return gguf_dir(local, f"gguf-{local.stem.lower()}", convert), hash_files([local]), local
    if local.is_dir():
        return str(local), hash_dir(local), None
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:  # hub ids: "org/name"
        raise ModelLoadError(f"model path not found: {local}")
    return name, "", None  # a hub id; its revision is hashed once its files are local


def load_tokenizer(name_or_path: str | None, *, trust_remote_code: bool = False
                   ) -> tuple[PreTrainedTokenizerBase, int] | None:
    """The tokenizer and the context length of a model from its config and tokenizer files alone:
    no weights are read. A rerun whose prompts turn out unchanged (batchgen.jobs.commands.prompt_check) then
    needs no model. None where that takes more (a GGUF not converted yet, a hub model not in the
    local cache, a tokenizer that fails to load): the caller loads the model, which says why."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    name = DEFAULT_MODEL if name_or_path in (None, DEFAULT_MODEL) else str(name_or_path)
    try:
        model_dir, _, _ = _locate(name, convert=False)
        if not model_dir:
            return None
        kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": True}
        config = AutoConfig.from_pretrained(model_dir, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
        return tokenizer, _context_limit(name, config, tokenizer)
    except Exception:  # anything: the model load that follows reports it properly
        return None


def _load_hf(name: str, model_dir: str, dtype: torch.dtype, trust_remote_code: bool):
    """from_pretrained for a local directory or a hub id; every failure becomes ModelLoadError."""
    is_local = os.path.isdir(model_dir)
    kwargs: dict = {"trust_remote_code": trust_remote_code}
    if is_local:
        from batchgen.engine.quant.checkpoint import check_config_quantization
        check_config_quantization(model_dir, name)
        kwargs["local_files_only"] = True
        names = os.listdir(model_dir)
        if any(n.endswith(".safetensors") for n in names):
            kwargs["use_safetensors"] = True
        elif any(n.endswith(".bin") for n in names):
            log.warning("%s has no safetensors weights: loading pickle (.bin) weights", name)
    attempts = [True] if is_local or _hub_offline() else [True, False]
    for local_only in attempts:  # the local HF cache first: no network round trips when it is there
        kwargs["local_files_only"] = local_only
        try:
            # an attribute of the lazy package: the modeling code is imported here, not for a
            # rerun that needs the tokenizer alone
            config = AutoConfig.from_pretrained(model_dir, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=dtype, attn_implementation=load_attention(config), **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
            return model, tokenizer
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... alike
            error = e
    if not is_local and attempts == [True]:
        raise ModelLoadError(f"model {name!r} not found locally: pass a local path, or download it "
                             f"first with `hf download {name}`") from error
    raise ModelLoadError(f"cannot load model {name!r}: {first_line(error)}") from error


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_snapshot_dir(name: str) -> Path:
    from transformers.utils.hub import cached_file
    config = cached_file(name, "config.json", local_files_only=True)
    return Path(config).parent


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def find_eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a sequence (tokenizer, generation config, model config), de-duplicated."""
    generation_config = getattr(model, "generation_config", None)
    text_config = model.config.get_text_config()
    ids = (_as_list(tokenizer.eos_token_id) + _as_list(getattr(generation_config, "eos_token_id", None))
           + _as_list(getattr(text_config, "eos_token_id", None)))
    return list(dict.fromkeys(ids))


def _max_context(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    return _context_limit(name, model.config, tokenizer)


def _context_limit(name: str, config, tokenizer: PreTrainedTokenizerBase) -> int:
    limit = context_limit(getattr(config.get_text_config(), "max_position_embeddings", None),
                          getattr(tokenizer, "model_max_length", None))
    if limit is None:
        raise UnsupportedModelError(f"model {name!r}: cannot tell its maximum context length "
                                    f"(no max_position_embeddings, no tokenizer model_max_length)")
    return limit
