"""Which sequences run in each step and how many tokens each; the per-request state. No torch."""
