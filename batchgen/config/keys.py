"""How settings are named: YAML keys, their JobConfig fields, and the label an error gives a setting
(the flag a user types and its YAML key). Apart from config/rules.py so every rule module can name
settings without importing the rules themselves.
"""

from __future__ import annotations

# YAML key -> JobConfig field, where they differ. Every `run` flag's own name is a YAML key
# (--commit-every-seconds: commit_every_seconds, tests/test_config_keys.py walks the flags), and
# vLLM's max_tokens is max_new_tokens. The CLI maps its parameters through the same table.
KEY_ALIASES = {"input": "inputs", "commit_every": "commit_every_rows", "commit_every_seconds": "commit_every_s",
               "metrics_every_seconds": "metrics_every_s", "stop_grace_seconds": "stop_grace_s",
               "checkpoint_in_flight_every": "checkpoint_in_flight_every_s", "ray_keep_warm": "ray_keep_warm_s",
               "max_tokens": "max_new_tokens"}
# field -> the key (and flag) users type for it; max_tokens is an alias, not the name errors use
_KEYS = {field: key for key, field in KEY_ALIASES.items() if key != "max_tokens"}
# settings with a YAML key but no flag (tests/test_config_keys.py checks this list against the CLI)
NO_FLAG = frozenset({"read_batch_size", "log_every_s", "enable_prefix_caching"})
TOP_K_OFF = (0, -1)  # vLLM's top_k=-1 (and 0): no limit


def label(field: str) -> str:
    """How an error names a setting: the flag a user types and the YAML key, e.g. "--top-k (YAML
    top_k)"; the key alone for the few settings without a flag."""
    key = _KEYS.get(field, field)
    if field in NO_FLAG:
        return key
    return f"--{key.replace('_', '-')} (YAML {key})"
