"""flash-attn's share of the score rules, checked without a GPU: the window and softcap arguments
each call receives, and the backends a model with sinks is given (flash-attn 2 has none)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.attention import flash
from batchgen.engine.attention.base import LayerKV, PackedSeq, ScoreRules
from batchgen.engine.engine import EngineConfig
from batchgen.engine.engine_config import resolve_attention
from batchgen.errors import UnsupportedModelError


@pytest.mark.parametrize(("rules", "expected"), [
    (ScoreRules(), {}),
    (ScoreRules(sliding_window=4096), {"window_size": (4095, 0)}),  # flash-attn's left window excludes the query
    (ScoreRules(sliding_window=1, softcap=50.0), {"window_size": (0, 0), "softcap": 50.0}),
])
def test_varlen_and_graph_decode_calls_get_the_window_and_softcap(rules, expected, monkeypatch):
    calls = []

    def record(*args, **kwargs):
        calls.append(kwargs)
        return torch.zeros(args[0].shape)

    monkeypatch.setattr(flash, "flash_attn_varlen_func", lambda: record)
    monkeypatch.setattr(flash, "flash_attn_with_kvcache", lambda: record)
    backend = flash.FlashBackend()
    layer = LayerKV(torch.zeros(512, 2, 16), torch.zeros(512, 2, 16), 256)
    q = torch.zeros(3, 4, 16)
    backend.forward(q, q[:, :2], q[:, :2], layer, backend.build_metadata([PackedSeq(0, 3, 0, [1])], 256, q.device),
                    0.25, rules)
    graph_meta = flash.FlashBackend.graph_decode_metadata(torch.zeros(3, 1, dtype=torch.int32),
                                                          torch.ones(3, dtype=torch.int32))
    backend.forward(q, q[:, :2], q[:, :2], layer, graph_meta, 0.25, rules)
    for kwargs in calls:
        assert {k: kwargs[k] for k in ("window_size", "softcap") if k in kwargs} == expected
        assert kwargs["causal"] is True


def test_a_model_with_sinks_leaves_flash_for_sdpa_or_is_refused_when_flash_was_asked(monkeypatch):
    monkeypatch.setattr(flash.FlashBackend, "available", staticmethod(lambda device, dtype=None: True))
    cuda = torch.device("cuda")
    name, _, _, reason = resolve_attention(EngineConfig(), cuda, torch.bfloat16, {"sliding_window", "sinks"})
    assert name == "sdpa" and "attention sinks" in reason
    assert resolve_attention(EngineConfig(), cuda, torch.bfloat16, {"sliding_window", "softcap"})[0] == "flash"
    with pytest.raises(UnsupportedModelError, match="no attention sinks"):
        resolve_attention(EngineConfig(attention_backend="flash"), cuda, torch.bfloat16, {"sinks"})
