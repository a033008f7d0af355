"""Exactly-once: commits, the fingerprint, input identity, resume rules, in-flight checkpoints, the output session."""
