"""The attention implementation a model is built with when it loads.

The engine swaps in its own paged attention (engine/attention/paged.py) before any step, but a
loaded model also runs as transformers built it: quantization's calibration pass, a memory
profile, a caller using `LoadedModel.model` directly. So it loads with an attention transformers
runs on its own: SDPA where the model's class accepts it, else eager, which every class accepts.
Some classes refuse SDPA outright (Gemma 2's attention logit softcapping, gpt-oss's attention
sinks), and asking them for it refuses the whole model before a weight is read.
"""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


def load_attention(config: PretrainedConfig) -> str | None:
    """"sdpa" or "eager" for the class AutoModelForCausalLM builds from `config`; None where that
    class is not transformers' own (remote code): transformers' default then applies, which is
    SDPA where the class accepts it, else eager."""
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
