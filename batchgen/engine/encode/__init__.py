"""The encode tasks (embed, score, classify): packed forwards of whole rows, no KV cache, no decode loop."""
