"""batchgen: offline batch LLM generation over a paged KV cache."""

__version__ = "0.1.0"
