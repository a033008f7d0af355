"""Paged attention for Hugging Face models: the attention function they call, and one backend per kernel family."""
