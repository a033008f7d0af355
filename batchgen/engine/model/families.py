"""Which model families the engine runs, decided from a config alone (config.json or GGUF metadata).

The engine runs an unmodified Hugging Face decoder through its attention interface, with paged
attention that honours per-layer sliding windows, attention logit softcapping, attention sinks and
any query scale (engine/attention/). What a config can ask for beyond that is refused here, before
any GGUF conversion or weight load, naming what is missing. MoE blocks, Gemma's norms and MLPs,
q/k norms and final logit softcapping are the HF modules' own code and need nothing of ours.
"""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from batchgen.engine.kv.groups import MAX_KV_GROUPS, KVGroups, plan_groups
from batchgen.errors import UnsupportedModelError

log = logging.getLogger(__name__)

# the layer kinds engine/attention/ implements; transformers names them in config.layer_types
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config: a multimodal wrapper's `text_config`, else the config itself."""
    return getattr(config, "text_config", None) or config


def missing_features(config: PretrainedConfig) -> list[str]:
    """What this config asks for that the engine does not implement, one phrase each; [] if none."""
    config = text_config(config)
    missing = []
    if getattr(config, "is_encoder_decoder", False):
        missing.append("an encoder-decoder model (batchgen runs decoder-only causal LMs)")
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if other:
        missing.append(f"{other} layers (batchgen runs full_attention and sliding_attention layers)")
    if getattr(config, "use_bidirectional_attention", False):
        missing.append("bidirectional attention (batchgen's attention is causal)")
    if getattr(config, "attention_chunk_size", None):
        missing.append("chunked local attention (attention_chunk_size)")
    if getattr(config, "num_kv_shared_layers", 0):
        missing.append("layers that read another layer's KV cache (num_kv_shared_layers)")
    head_dim = getattr(config, "head_dim", None)
    global_head_dim = getattr(config, "global_head_dim", None)
    if global_head_dim and head_dim and global_head_dim != head_dim:
        missing.append("layers of different head sizes (global_head_dim != head_dim): one paged KV layout")
    v_head_dim = getattr(config, "v_head_dim", None)
    if getattr(config, "kv_lora_rank", None) or (v_head_dim and head_dim and v_head_dim != head_dim):
        missing.append("latent or unequal key/value heads (MLA): one paged KV layout of K and V alike")
    return missing


def model_class_problem(config: PretrainedConfig) -> str | None:
    """Why transformers' causal-LM class for this config cannot run in the engine, read from the
    class without building it; None when it can, or when the class is not known here (remote code)."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None if getattr(config, "auto_map", None) else "transformers has no causal-LM class for it"
    if not getattr(cls, "_supports_attention_backend", False):
        return f"{cls.__name__} does not use transformers' attention interface"
    return None


def check_config(config: PretrainedConfig, name: str, *, check_class: bool = True) -> None:
    """Refuse, from its config alone, a model the engine cannot run (UnsupportedModelError)."""
    problems = missing_features(config)
    why_class = model_class_problem(config) if check_class else None
    if why_class:
        problems.insert(0, why_class)
    if problems:
        model_type = getattr(config, "model_type", "?")
        raise UnsupportedModelError(f"model {name!r} ({model_type}) uses {'; '.join(problems)}, which batchgen "
                                    "does not support")


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window in tokens (None: full attention), as transformers' masks apply them:
    per `layer_types` where the config has them, else `sliding_window` on every layer (Mistral, Mixtral,
    Qwen3-MoE: their masks are sliding on all layers whenever the window is set)."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * config.num_hidden_layers


def uniform_window(config: PretrainedConfig) -> int | None:
    """The sliding window every layer shares (Mistral v0.1, Mixtral with a window, Qwen2/3 with
    max_window_layers 0), else None: a model with a full-attention layer keeps all its KV."""
    windows = set(layer_windows(config))
    return windows.pop() if len(windows) == 1 and None not in windows else None


def kv_window(model) -> int | None:
    """`uniform_window` of the model's config, where its attention modules agree (those that keep a
    `sliding_window` of their own); None, logged, where one does not: then all KV is kept."""
    window = uniform_window(model.config)
    if window is None or not _modules_agree(model, [window] * text_config(model.config).num_hidden_layers):
        return None
    return window


def kv_groups(model) -> KVGroups | None:
    """The KV layer groups (kv/groups.py) of a model with both full-attention and sliding layers,
    where its attention modules agree with its config; None otherwise (one group: kv_window's)."""
    windows = layer_windows(model.config)
    groups = plan_groups(windows)
    if groups is None:
        num_sliding = sum(w is not None for w in windows)
        if 0 < num_sliding < len(windows):
            log.debug("KV: %d of %d layers slide, they would need more than %d layer groups of equal size: "
                      "keeping all KV", num_sliding, len(windows), MAX_KV_GROUPS)
        return None
    return groups if _modules_agree(model, windows) else None


def _modules_agree(model, windows: list[int | None]) -> bool:
    """Does every attention module that keeps a `sliding_window` keep its layer's window from the
    config? Logged where one does not: then all KV is kept."""
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "sliding_window"):
            expected = windows[module.layer_idx]
            if module.sliding_window != expected:
                log.warning("layer %s of %s attends a window of %s tokens, not the config's %s: keeping all KV",
                            module.layer_idx, type(model).__name__, module.sliding_window, expected)
                return False
    return True


def describe(config: PretrainedConfig) -> str:
    """One line for the log: the attention features a model uses."""
    config = text_config(config)
    windows = layer_windows(config)
    parts = []
    sliding = [w for w in windows if w]
    if sliding:
        parts.append(f"{len(sliding)}/{len(windows)} sliding-window layers ({sliding[0]} tokens)")
    for attr, label in (("attn_logit_softcapping", "attention softcap"), ("final_logit_softcapping", "logit softcap")):
        if getattr(config, attr, None):
            parts.append(f"{label} {getattr(config, attr)}")
    if getattr(config, "query_pre_attn_scalar", None):
        parts.append(f"query scale {config.query_pre_attn_scalar}**-0.5")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        parts.append(f"{experts} experts (HF MoE blocks)")
    return ", ".join(parts) or "full attention"


def check_model(model) -> None:
    """Refuse, at engine start, a built model the engine cannot run (UnsupportedModelError)."""
    name = getattr(model.config, "name_or_path", None) or text_config(model.config).model_type
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(f"model {name!r} does not use transformers' attention interface")
    check_config(model.config, name, check_class=False)


def score_rules_used(model) -> set[str]:
    """The ScoreRules fields (engine/attention/base.py) some layer of `model` needs: its backend must honour them."""
    config = text_config(model.config)
    used = set()
    if any(layer_windows(config)):
        used.add("sliding_window")
    if getattr(config, "attn_logit_softcapping", None):
        used.add("softcap")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        used.add("sinks")
    return used
