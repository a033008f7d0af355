"""The paged KV cache: block accounting and prefix caching (no torch), the cache tensors, the int8 cache."""
