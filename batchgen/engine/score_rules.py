"""How one attention layer turns its scores into probabilities beyond causality (a sliding window,
a softcap, sinks): what the attention backends and the C attention kernels' bindings both read, so
it lives below both."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ScoreRules:
    """How one layer turns its scaled q . k scores into probabilities, beyond causality: what
    transformers passes the attention function as `sliding_window`, `softcap` and `s_aux`."""

    sliding_window: int | None = None  # query i sees keys j with i - sliding_window < j <= i (transformers' rule)
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap, before the mask (Gemma 2)
    sinks: torch.Tensor | None = None  # [num_heads] float32: a logit in each head's softmax denominator (gpt-oss)

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.softcap is None and self.sinks is None

    def first_key(self, query_pos: int) -> int:
        """The first key position query position `query_pos` attends."""
        return 0 if self.sliding_window is None else max(0, query_pos - self.sliding_window + 1)


NO_RULES = ScoreRules()

# what a backend class lists in `score_rules`: the ScoreRules fields it honours
SCORE_RULE_FEATURES = {"sliding_window": "sliding-window attention", "softcap": "attention logit softcapping",
                       "sinks": "attention sinks"}


def rules_used(rules: ScoreRules) -> set[str]:
    return {name for name in SCORE_RULE_FEATURES if getattr(rules, name) is not None}
