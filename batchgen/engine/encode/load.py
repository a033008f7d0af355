"""The model of an embed, score or classify job, with everything the Encoder and the job need of it.

embed accepts three shapes of model:
- a sentence-transformers directory: its Transformer is loaded as the HF base model, its Pooling and
  Normalize modules and its max_seq_length decide the vectors (st_config.py);
- a plain HF encoder directory (BERT, XLM-RoBERTa, ModernBERT, ...): mean pooling, no normalization, as
  sentence-transformers wraps such a model;
- a causal LM (a directory, a hub id, a .gguf, the embedded default): its decoder stack, last-token
  pooling and normalization (the Qwen3-Embedding recipe), loaded through the engine's own loader.
`--pooling` / `--normalize` override what the model says. score and classify load through heads.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING
from transformers.utils import logging as hf_logging

from batchgen.config.choices import Pooling, Task
from batchgen.engine.encode.heads import (
    LogitRule,
    decoder_of,
    load_classify_model,
    load_score_model,
    prepare_cpu_forward,
)
from batchgen.engine.encode.st_config import StConfig, is_st_dir, read_st_config
from batchgen.engine.model.context_length import context_limit
from batchgen.engine.model.gguf_cache import first_line, hash_files
from batchgen.engine.model.loader import load_model, resolve_device, resolve_dtype
from batchgen.engine.model.model_files import DEFAULT_MODEL
from batchgen.errors import ConfigError, ModelLoadError, UnsupportedModelError

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_ST_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "tokenizer.json",
             "tokenizer_config.json")
# RoBERTa-family embeddings number positions from padding_idx + 1: that many of their positions are never a token's
_PADDING_OFFSET_TYPES = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text")


@dataclass
class EncodeModel:
    task: Task
    model: PreTrainedModel  # embed: the base model run packed; score: the causal LM; classify: the classifier
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    name: str
    max_input_tokens: int  # sentence-transformers' max_seq_length, else the model's positions
    files_identity: str  # content identity of the weights and the files that decide the output
    # embed
    pooling: Pooling | None = None
    normalize: bool = False
    dimensions: int | None = None  # the job's Matryoshka cut
    embedding_dim: int | None = None  # the output's width: dimensions, else the model's
    causal: bool = False  # the embedding model attends as a decoder
    # score
    logit_rule: LogitRule | None = None
    # classify
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    # the special tokens the tokenizer puts before and after a text: truncation keeps them, as
    # sentence-transformers' tokenizer call (truncation="longest_first", max_length) does
    num_special_prefix: int = 0
    num_special_suffix: int = 0

    def truncate(self, token_ids: list[int], max_tokens: int | None = None) -> tuple[list[int], bool]:
        """(ids cut to `max_tokens` (default max_input_tokens), whether cut). The cut drops text tokens
        from the end and keeps the special tokens the tokenizer added at both ends."""
        limit = self.max_input_tokens if max_tokens is None else max_tokens
        if len(token_ids) <= limit:
            return token_ids, False
        prefix, suffix = self.num_special_prefix, self.num_special_suffix
        keep_text = limit - prefix - suffix
        if keep_text < 0 or len(token_ids) < prefix + suffix:  # no room for the specials: a plain cut
            return token_ids[:limit], True
        return token_ids[:prefix + keep_text] + token_ids[len(token_ids) - suffix:], True


def load_encode_model(model: str | None, task: Task, *, dtype: str = "auto", device: str | None = None,
                      pooling: Pooling | None = None, normalize: bool | None = None, dimensions: int | None = None,
                      trust_remote_code: bool = False) -> EncodeModel:
    task = Task(task)
    device = device or "auto"
    if task is Task.SCORE:
        loaded, rule = load_score_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return _with_specials(EncodeModel(
            task=task, model=loaded.model, tokenizer=loaded.tokenizer, device=loaded.device, dtype=loaded.dtype,
            name=loaded.name, max_input_tokens=loaded.max_context_tokens, files_identity=loaded.revision,
            causal=True, logit_rule=rule))
    if task is Task.CLASSIFY:
        loaded = load_classify_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return _with_specials(EncodeModel(
            task=task, model=loaded.model, tokenizer=loaded.tokenizer, device=loaded.device, dtype=loaded.dtype,
            name=loaded.name, max_input_tokens=loaded.max_input_tokens, files_identity=loaded.revision,
            id2label=loaded.id2label, problem_type=loaded.problem_type))
    if task is not Task.EMBED:
        raise UnsupportedModelError(f"task {task.value!r} does not run on the encode engine")
    return _with_specials(_load_embed(model, dtype=dtype, device=device, pooling=pooling, normalize=normalize,
                                      dimensions=dimensions, trust_remote_code=trust_remote_code))


def _load_embed(name: str | None, *, dtype: str, device: str, pooling: Pooling | None, normalize: bool | None,
                dimensions: int | None, trust_remote_code: bool) -> EncodeModel:
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    directory = _model_dir(name)
    st = read_st_config(directory) if directory is not None and is_st_dir(directory) else None
    if st is None and (directory is None or _is_decoder(_config(directory, name, trust_remote_code))):
        # a causal LM as an embedder: the engine's loader (GGUF, hub cache, the default model)
        loaded = load_model(name, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        prepare_cpu_forward(loaded.model)
        return _embed_model(decoder_of(loaded.model), loaded.tokenizer, loaded.device, loaded.dtype, loaded.name,
                            loaded.max_context_tokens, loaded.revision, None, True, pooling, normalize, dimensions)
    assert directory is not None
    hf_dir = st.transformer_dir if st else directory
    config = _config(hf_dir, name, trust_remote_code)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    try:
        base = AutoModel.from_pretrained(hf_dir, config=config, dtype=torch_dtype, attn_implementation="sdpa",
                                         **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, **kwargs)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... alike
        raise ModelLoadError(f"cannot load model {name!r}: {first_line(e)}") from e
    base = base.to(torch_device).eval()
    prepare_cpu_forward(base)
    positions = _positions(config)
    if st is not None and st.max_seq_length:
        limit = min(st.max_seq_length, positions) if positions else st.max_seq_length
    else:
        limit = context_limit(positions, getattr(tokenizer, "model_max_length", None))
    if limit is None:
        raise UnsupportedModelError(f"model {name!r}: cannot tell its maximum input length "
                                    f"(no max_seq_length, max_position_embeddings or tokenizer model_max_length)")
    identity = _files_identity(directory, hf_dir)
    return _embed_model(base, tokenizer, torch_device, torch_dtype, str(name), limit, identity, st,
                        _is_decoder(config), pooling, normalize, dimensions)


def _embed_model(base: PreTrainedModel, tokenizer, device, dtype, name: str, limit: int, identity: str,
                 st: StConfig | None, causal: bool, pooling: Pooling | None, normalize: bool | None,
                 dimensions: int | None) -> EncodeModel:
    hidden = int(base.config.get_text_config().hidden_size)
    if st is not None and st.embedding_dim is not None and st.embedding_dim != hidden:
        raise UnsupportedModelError(f"model {name!r}: its Pooling module's dimension {st.embedding_dim} is not the "
                                    f"model's hidden size {hidden}")
    if pooling is None:
        pooling = st.pooling if st is not None and st.pooling is not None else (Pooling.LAST if causal
                                                                                  else Pooling.MEAN)
    if normalize is None:
        normalize = st.normalize if st is not None else causal
    if dimensions is not None and not 1 <= dimensions <= hidden:
        raise ConfigError(f"--dimensions {dimensions}: model {name!r} embeds in {hidden} dimensions "
                          f"(a cut must be 1 to {hidden})")
    return EncodeModel(task=Task.EMBED, model=base, tokenizer=tokenizer, device=device, dtype=dtype, name=name,
                       max_input_tokens=limit, files_identity=identity, pooling=Pooling(pooling),
                       normalize=bool(normalize), dimensions=dimensions, embedding_dim=dimensions or hidden,
                       causal=causal)


def _model_dir(name: str | None) -> Path | None:
    """The local directory of `name` (a path, or a hub id in the local cache); None for a GGUF file or
    the embedded default, which the engine's loader converts."""
    if name in (None, DEFAULT_MODEL) or str(name).endswith(".gguf"):
        return None
    local = Path(os.path.expanduser(str(name)))
    if local.is_dir():
        return local
    if local.is_file() or str(name).startswith(("/", "./", "../", "~")) or str(name).count("/") > 1:
        raise ModelLoadError(f"model path not found: {local}" if not local.is_file()
                             else f"model {name!r} is a file but not a .gguf; pass a model directory")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(str(name), local_files_only=True))
    except Exception as e:  # not in the local cache (or not a hub id at all)
        raise ModelLoadError(f"model {name!r} not found locally: pass a local path, or download it first "
                             f"with `hf download {name}` ({first_line(e)})") from e


def _config(directory: Path, name: str | None, trust_remote_code: bool) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the config of {name!r}: {first_line(e)}") from e


def _is_decoder(config: PretrainedConfig) -> bool:
    """A causal LM's config (Llama, Qwen3, ...): it has a causal-LM class and no masked-LM one (BERT
    and RoBERTa have both, as encoders)."""
    kind = type(config)
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING and kind not in MODEL_FOR_MASKED_LM_MAPPING


def _positions(config: PretrainedConfig) -> int | None:
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None)
    if positions and text.model_type in _PADDING_OFFSET_TYPES and text.pad_token_id is not None:
        positions -= text.pad_token_id + 1
    return positions


def _files_identity(directory: Path, hf_dir: Path) -> str:
    """Content identity of the weights, config.json and the files that decide the vectors (pooling,
    normalization, the tokenizer, the length)."""
    files = sorted(p for p in hf_dir.iterdir() if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES
                                                                   or p.name == "config.json"))
    files += [directory / f for f in _ST_FILES if (directory / f).is_file() and directory / f not in files]
    return hash_files(files)


def _with_specials(model: EncodeModel) -> EncodeModel:
    """Count the special tokens the tokenizer adds before and after a text (CLS ... SEP, BOS ..., ... EOS)."""
    tokenizer = model.tokenizer
    text = tokenizer("a b c", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b c", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(text) + 1):
        if full[start:start + len(text)] == text:
            model.num_special_prefix = start
            model.num_special_suffix = len(full) - start - len(text)
            break
    return model
