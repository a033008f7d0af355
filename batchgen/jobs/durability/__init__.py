"""Exactly-once: commits, the fingerprint, the input scan and identity, resume rules, signals deferred to a
safe point, in-flight checkpoints, the output session."""
