"""The named choices that config, CLI and engine share: one spelling of each, defined once.

The engine takes these values from a JobConfig and the CLI offers them as flag values, so they live
at the ground (no torch) where all three can import them.
"""

from __future__ import annotations

from enum import Enum


class Policy(str, Enum):
    """The batching mode, end to end: config values, planned shards and engines all use it."""

    CONTINUOUS = "continuous"
    STATIC = "static"

    def __str__(self) -> str:  # "static" in logs, f-strings and reports, on every Python version
        return self.value


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
