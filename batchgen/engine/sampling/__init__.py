"""From a step's logits to the next token: sampling, penalties, and when a sequence stops."""
