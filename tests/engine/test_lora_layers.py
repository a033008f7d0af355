"""A wrapped projection adds each token's own adapter's update, whichever way the step runs it: a
few tokens as one masked pass over the layer's stacked adapters (two matmuls, however many adapters
the step holds), many tokens as one shrink/expand pair per adapter on its own slice."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchgen.engine.lora import layers
from batchgen.engine.lora.adapter import read_adapter
from batchgen.engine.lora.layers import AdapterRows, attach, current_step, lora_step
from tests.lora_adapters import make_adapter
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

aten = torch.ops.aten
MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.addmm_.default}
# tokens 0-1: the base model; 2-4: "all"; 5-8: "qv"; 9: "mlp" (which has no q_proj)
GROUPS = [AdapterRows("all", slice(2, 5)), AdapterRows("qv", slice(5, 9)), AdapterRows("mlp", slice(9, 10))]
TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qv": ["q_proj", "v_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    model = make_tiny_model("llama", seed=0)
    root = tmp_path_factory.mktemp("lora-layers")
    adapters = {name: read_adapter(name, make_adapter(model, root / name, seed=i + 1, r=4 * (i + 1),
                                                      lora_alpha=8, target_modules=targets))
                for i, (name, targets) in enumerate(TARGETS.items())}
    expected_updates = {name: dict(a.weights) for name, a in adapters.items()}
    scalings = {name: a.scaling for name, a in adapters.items()}
    base = {n: getattr(model.model.layers[0].self_attn if n[0] in "qkvo" else model.model.layers[0].mlp, n)
            for n in ("q_proj", "v_proj", "gate_proj")}
    x = torch.randn(1, 10, 64)
    with torch.inference_mode():
        reference = {}
        for name, module in base.items():
            out = module(x).clone()
            for g in GROUPS:
                pair = expected_updates[g.name].get(f"model.layers.0.{'self_attn' if name[0] in 'qkvo' else 'mlp'}."
                                                    f"{name}")
                if pair is not None:
                    a, b = pair
                    out[0, g.rows] += (x[0, g.rows] @ a.T @ b.T) * scalings[g.name]
            assert torch.equal(out[0, :2], module(x)[0, :2]) and not torch.equal(out, module(x)), name
            reference[name] = out
    attach(model, adapters)
    return base, x, reference


@pytest.mark.parametrize("stacked", [True, False])
def test_each_token_takes_its_own_adapters_update(wrapped, monkeypatch, stacked):
    base, x, reference = wrapped
    if not stacked:
        monkeypatch.setattr(layers, "STACKED_MAX_TOKENS", 0)  # a prefill-sized step
    with torch.inference_mode(), lora_step(GROUPS):
        assert current_step().stacked is stacked
        for name, module in base.items():
            y = module(x)
            assert torch.allclose(y, reference[name], atol=1e-5), name
        masks = current_step().masks
    if stacked:  # one mask per set of adapters a layer holds (q/v: all+qv, gate: all+mlp), shared by the layers
        assert len(masks) == 2
        span, mask = masks[next(k for k in masks if [n for n, *_ in k] == ["all", "qv"])]
        assert span == slice(2, 9) and mask.shape == (7, 4 + 8)
        assert mask.sum(1).tolist() == [4, 4, 4, 8, 8, 8, 8]  # each token keeps its own adapter's rank
    else:
        assert not masks


def test_a_decode_step_runs_two_matmuls_per_layer_however_many_adapters(wrapped):
    base, x, _ = wrapped
    q = base["q_proj"]
    with torch.inference_mode():
        with CountMatmuls() as plain, lora_step(None):
            q(x)
        with CountMatmuls() as mixed, lora_step(GROUPS):
            q(x)
    assert mixed.count - plain.count == 2  # one shrink over the stack, one expand-and-add, for 2 adapters
