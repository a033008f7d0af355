"""The GGUF cache and the model files' content hashes: any .gguf (the embedded default model's
too, found by model_files.py) dequantized once into a content-keyed safetensors directory, and the
content hashes that name a model's revision.

Dequantizing a GGUF costs many times the time and memory of a reload from safetensors, so it runs
once per file content; the directory is published by an atomic rename, so concurrent runs see either
nothing or a whole model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from batchgen.errors import ModelLoadError
from batchgen.runtime.cache_dir import cache_root
from batchgen.runtime.stage import slow_stage

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
HASH_CHUNK_BYTES = 1 << 20
_file_digests: dict[tuple[str, int, int], str] = {}  # (realpath, size, mtime_ns) -> sha256 hex


def gguf_dir(gguf: Path, prefix: str, convert: bool) -> str:
    if convert:
        return str(gguf_cache_dir(gguf, prefix))
    target = gguf_cache_target(gguf, prefix)
    return str(target) if (target / "config.json").is_file() else ""




def gguf_cache_target(gguf: Path, prefix: str) -> Path:
    return cache_root() / "models" / f"{prefix}-{hash_files([gguf])[:12]}"


def gguf_cache_dir(gguf: Path, prefix: str) -> Path:
    """The dequantized safetensors copy of `gguf`, converted on first use.

    Keyed by the file's sha256 (which we compute anyway for the revision), so a replaced file can
    never hit a stale cache. Written to a temp dir and renamed into place: a concurrent run sees
    either nothing or a complete directory.
    """
    target = gguf_cache_target(gguf, prefix)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{prefix}-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a shared BATCHGEN_CACHE_DIR must stay readable
        try:
            os.replace(tmp, target)
        except OSError:  # a concurrent run got there first: its copy is complete, use it
            if not (target / "config.json").is_file():
                raise
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot convert {gguf.name}: {first_line(e)}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("reading .gguf files needs the gguf package: pip install gguf")
    # out_dir is a temporary name beside its final one: the directory is what a user can look for
    with slow_stage(f"converting {gguf.name} to safetensors in {out_dir.parent} (once; later runs reuse it)",
                    logger=log):
        kwargs: dict = {"local_files_only": True, "gguf_file": gguf.name}
        try:  # transformers >= 5 may keep GGUF blocks packed; we want a plain dense model to save
            from transformers import GgufConfig
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except (ImportError, TypeError):
            pass
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, local_files_only=True, gguf_file=gguf.name)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # transformers 5 refuses to save a model that still carries one
            quantizer.remove_quantization_config(model)
        model.save_pretrained(out_dir)  # float32: Q4_1's d*q+m is exact there, not in bf16/fp16
        tokenizer.save_pretrained(out_dir)
        del model
        reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
        if (reloaded.chat_template, reloaded.eos_token_id) != (tokenizer.chat_template, tokenizer.eos_token_id):
            raise ModelLoadError(f"the tokenizer of {gguf.name} lost its chat template or eos on saving")




def hash_dir(directory: Path) -> str:
    files = sorted(p for p in directory.iterdir()
                   if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"))
    return hash_files(files)


def hash_files(files: list[Path]) -> str:
    """sha256 over (name, content digest) of each file; per-file digests cached by path+size+mtime."""
    total = hashlib.sha256()
    for path in files:
        st = path.stat()
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if key not in _file_digests:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(HASH_CHUNK_BYTES):
                    h.update(chunk)
            _file_digests[key] = h.hexdigest()
        total.update(f"{path.name}\0{_file_digests[key]}\n".encode())
    return total.hexdigest()[:16]


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
