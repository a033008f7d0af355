"""Loading the models of the score and classify tasks, and the heads they end in.

score runs a causal LM, loaded through engine/model/loader.py like a generation job's model, so the
embedded default GGUF and every family the engine runs load the same way. Its forward is split in two:
the decoder's hidden states (packed, every token), then the LM head on only the positions a row scores.
That split is exact only where the model's logits are `lm_head(hidden)` followed by the scaling its
family applies; `LogitRule` reads that scaling from the config and `check_logit_rule` compares the split
to the model's own forward once at load, refusing a family whose logits are made some other way.

classify runs an `AutoModelForSequenceClassification` checkpoint (a BERT-style classifier, a Llama-style
reward model). A checkpoint saved as anything else is refused: transformers would give it a randomly
initialized head and every row a meaningless class.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
from transformers.utils import logging as hf_logging

from batchgen.engine.kernels import fused
from batchgen.engine.model import experts, prepack
from batchgen.engine.model.context_length import context_limit
from batchgen.engine.model.gguf_cache import first_line, hash_dir
from batchgen.engine.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from batchgen.engine.model.model_files import DEFAULT_MODEL
from batchgen.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

# The load-time check of the split forward: relative tolerance on the logits of a few tokens. Loose
# enough for bfloat16 rounding between two orders of the same operations, far below what a missed
# scaling or softcap changes.
_LOGIT_CHECK_RTOL = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
_LOGIT_CHECK_TOKENS = 8


@dataclass(frozen=True, slots=True)
class LogitRule:
    """What a causal LM does to `lm_head(hidden)` to make its logits."""

    multiplier: float = 1.0  # Cohere's logit_scale; Granite's 1 / logits_scaling
    softcap: float | None = None  # Gemma 2/3's final_logit_softcapping: cap * tanh(logits / cap)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_rule(config: PretrainedConfig) -> LogitRule:
    """The scaling the family's CausalLM forward applies after its LM head, read from the config."""
    text = getattr(config, "text_config", None) or config
    multiplier = 1.0
    if getattr(text, "logit_scale", None) is not None:  # Cohere, Cohere2: logits * logit_scale
        multiplier *= float(text.logit_scale)
    if getattr(text, "logits_scaling", None) is not None and "granite" in str(text.model_type):
        multiplier /= float(text.logits_scaling)  # Granite: logits / logits_scaling
    softcap = getattr(text, "final_logit_softcapping", None)
    return LogitRule(multiplier=multiplier, softcap=float(softcap) if softcap else None)


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """The module whose `last_hidden_state` the causal LM's head reads (its decoder stack)."""
    decoder = model.get_decoder()
    if decoder is model:
        raise UnsupportedModelError(f"model {type(model).__name__}: cannot find its decoder stack")
    return decoder


@torch.no_grad()
def check_logit_rule(model: PreTrainedModel, rule: LogitRule, name: str) -> None:
    """Refuse a model whose logits are not `rule.apply(lm_head(decoder hidden states))`: scores from
    the split forward would silently differ from the model's own."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    input_ids = torch.arange(3, 3 + _LOGIT_CHECK_TOKENS, device=device).remainder(vocab)[None]
    whole = model(input_ids=input_ids).logits[0].float()
    hidden = decoder_of(model)(input_ids=input_ids).last_hidden_state[0]
    split = rule.apply(model.get_output_embeddings()(hidden)).float()
    rtol = _LOGIT_CHECK_RTOL.get(model.dtype, 6e-2)
    scale = whole.abs().max().clamp_min(1e-6)
    if not torch.isfinite(split).all() or (split - whole).abs().max() > rtol * scale:
        raise UnsupportedModelError(
            f"model {name!r} ({model.config.model_type}): its logits are not its LM head's output with "
            f"the scaling batchgen knows (logit_scale, logits_scaling, final_logit_softcapping), so "
            f"--task score cannot compute them")


def prepare_cpu_forward(model: PreTrainedModel) -> None:
    """What LLMEngine does to a model's modules before its first step (each a no-op off the CPU):
    oneDNN-reordered linear weights, MoE experts in one grouped pass, fused RMSNorm and MLP. A score
    or classify forward is a prefill, so it runs on the same kernels a generation job's prefill does."""
    prepack.pack_linear_layers(model)
    experts.group_experts(model)
    fused.fuse_pointwise(model)


def load_score_model(name: str | None, *, dtype: str = "auto", device: str = "auto",
                     trust_remote_code: bool = False) -> tuple[LoadedModel, LogitRule]:
    """The causal LM of a score job (as a generation job loads it) and its checked logit rule."""
    loaded = load_model(name, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    prepare_cpu_forward(loaded.model)
    rule = logit_rule(loaded.model.config)
    check_logit_rule(loaded.model, rule, loaded.name)
    return loaded, rule


@dataclass(slots=True)
class ClassifyModel:
    model: PreTrainedModel  # eval mode, on device, in dtype
    tokenizer: PreTrainedTokenizerBase
    name: str
    revision: str  # sha256[:16] over the weight files and config.json
    device: torch.device
    dtype: torch.dtype
    id2label: dict[int, str]
    problem_type: str | None  # "single_label_classification", "multi_label_classification", "regression"
    num_labels: int
    max_input_tokens: int


def load_classify_model(name: str | None, *, dtype: str = "auto", device: str = "auto",
                        trust_remote_code: bool = False) -> ClassifyModel:
    """A sequence-classification checkpoint from a local directory or the local hub cache."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if name in (None, DEFAULT_MODEL) or str(name).endswith(".gguf"):
        raise UnsupportedModelError(f"--task classify needs a sequence-classification checkpoint (a directory "
                                    f"or hub id); {name or DEFAULT_MODEL!r} is a causal LM")
    name = str(name)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    local = Path(os.path.expanduser(name))
    is_local = local.is_dir()
    if not is_local and (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1):
        raise ModelLoadError(f"model path not found: {local}")
    source = str(local) if is_local else name
    kwargs: dict = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... alike
        hint = "" if is_local else f": pass a local path, or download it first with `hf download {name}`"
        raise ModelLoadError(f"cannot load the config of {name!r}{hint} ({first_line(e)})") from e
    _check_classifier(config, name)
    try:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            source, config=config, dtype=torch_dtype, attn_implementation=_load_attention(config), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {name!r}: {first_line(e)}") from e
    model = model.to(torch_device).eval()
    prepare_cpu_forward(model)
    revision = hash_dir(local if is_local else _hub_snapshot_dir(name))
    limit = context_limit(_positions(config), getattr(tokenizer, "model_max_length", None))
    if limit is None:
        raise UnsupportedModelError(f"model {name!r}: cannot tell its maximum input length "
                                    f"(no max_position_embeddings, no tokenizer model_max_length)")
    id2label = {int(k): str(v) for k, v in (config.id2label or {}).items()}
    return ClassifyModel(model=model, tokenizer=tokenizer, name=name, revision=revision, device=torch_device,
                         dtype=torch_dtype, id2label=id2label, problem_type=config.problem_type,
                         num_labels=int(config.num_labels), max_input_tokens=limit)


def _check_classifier(config: PretrainedConfig, name: str) -> None:
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        saved_as = ", ".join(architectures) or "no architecture named in config.json"
        raise UnsupportedModelError(
            f"model {name!r} is not a sequence classifier ({saved_as}); --task classify needs a checkpoint "
            f"saved as *ForSequenceClassification: another would get an untrained classification head")
    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING and not getattr(config, "auto_map", None):
        raise UnsupportedModelError(f"model {name!r} ({config.model_type}): transformers has no "
                                    f"sequence-classification class for it")


def _load_attention(config: PretrainedConfig) -> str | None:
    """SDPA where the class accepts it, else eager (as engine/model/load_attention.py does for causal LMs)."""
    try:
        model_class = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
    except KeyError:
        return None
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _positions(config: PretrainedConfig) -> int | None:
    """The longest input the position embeddings allow: RoBERTa-family models number positions from
    padding_idx + 1, so two of their max_position_embeddings are never a token's."""
    text = getattr(config, "text_config", None) or config
    positions = getattr(text, "max_position_embeddings", None)
    if positions and text.model_type in ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl") \
            and text.pad_token_id is not None:
        positions -= text.pad_token_id + 1
    return positions


def _hub_snapshot_dir(name: str) -> Path:
    from transformers.utils.hub import cached_file
    return Path(cached_file(name, "config.json", local_files_only=True)).parent
