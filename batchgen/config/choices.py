"""The named choices that config, CLI and engine share: one spelling of each, defined once.

The engine takes these values from a JobConfig and the CLI offers them as flag values, so they live
at the ground (no torch) where all three can import them.
"""

from __future__ import annotations

from enum import Enum


class Policy(str, Enum):
    """The batching mode, end to end: config values, planned windows and engines all use it."""

    CONTINUOUS = "continuous"
    STATIC = "static"

    def __str__(self) -> str:  # "static" in logs, f-strings and reports, on every Python version
        return self.value


class Task(str, Enum):
    """`--task`: what a job computes per row. Only generate decodes; the others are one forward pass
    per row (engine/encode/), so generation's sampling and decoding settings mean nothing for them."""

    GENERATE = "generate"
    EMBED = "embed"  # a pooled (and normalized / cut) vector per row
    SCORE = "score"  # the row's (or a continuation's) total log-likelihood under a causal LM
    CLASSIFY = "classify"  # a sequence-classification head's label and scores

    def __str__(self) -> str:
        return self.value


class Pooling(str, Enum):
    """`--pooling`: how an embed job turns a row's token states into one vector (sentence-transformers' modes)."""

    MEAN = "mean"  # the average over the row's tokens
    CLS = "cls"  # the first token's state
    LAST = "last"  # the last token's state (decoders used as embedders)

    def __str__(self) -> str:
        return self.value


TASKS = tuple(t.value for t in Task)
POOLINGS = tuple(p.value for p in Pooling)


class AttentionBackendName(str, Enum):
    """`--attention-backend`: auto picks per device (engine/attention/registry.py says how)."""

    AUTO = "auto"
    CPU = "cpu"  # the C kernels reading K/V in place from the pages (CPU, float32 / bfloat16)
    SDPA = "sdpa"  # torch's scaled_dot_product_attention over gathered pages: runs everywhere
    FLASH = "flash"  # flash-attn's paged varlen kernel (CUDA)

    def __str__(self) -> str:
        return self.value


# earlier spellings still accepted, so configs written for them keep working
ATTENTION_BACKEND_ALIASES = {"torch": AttentionBackendName.SDPA.value}
ATTENTION_BACKENDS = tuple(b.value for b in AttentionBackendName)


def canonical_attention_backend(name: str) -> str:
    """The backend's one name: an alias becomes the name it stands for; anything else is kept as given."""
    return ATTENTION_BACKEND_ALIASES.get(name, name)

# the most alternatives a token's logprobs list (--logprobs, OpenAI's top_logprobs)
MAX_LOGPROBS = 20
# the most samples one row may ask for (--n, a sampling cell's or a Batch API request's n): OpenAI's limit
MAX_SAMPLES = 128
