"""The last layer's output projection and MLP on the head's rows only (engine/model/head_rows.py):
the head's logits are the full forward's, the skipped rows never reach those modules, and outside
an engine's forward nothing changes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.forward_context import forward_context
from batchgen.engine.model import head_rows
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import make_tiny_model


def rows_seen(module: torch.nn.Module) -> list[int]:
    seen: list[int] = []
    module.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[-2]))
    return seen


def test_the_head_rows_get_the_full_forwards_logits_and_only_they_pass_the_mlp():
    model = make_tiny_model("llama")
    ids = torch.randint(5, 200, (1, 40))
    keep = torch.tensor([3, 17, 39])
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0, keep]
    assert head_rows.install(model) == ["mlp", "self_attn.o_proj"]
    assert head_rows.install(model) == ["mlp", "self_attn.o_proj"]  # idempotent: wrapped once
    last, first = model.model.layers[-1], model.model.layers[0]
    seen_mlp, seen_first = rows_seen(last.mlp.down_proj), rows_seen(first.mlp)
    o_proj_out: list[torch.Tensor] = []  # its hooks see its whole input: its output tells what it ran on
    last.self_attn.o_proj.register_forward_hook(lambda _, args, out: o_proj_out.append(out[0]))
    with torch.no_grad(), forward_context(SimpleNamespace(head_rows=keep)):
        got = model(input_ids=ids, logits_to_keep=keep).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert seen_mlp == [3] and seen_first == [40]  # earlier layers keep every row
    skipped = [i for i in range(40) if i not in keep.tolist()]
    assert o_proj_out[0][skipped].abs().sum() == 0 and o_proj_out[0][keep].abs().sum() > 0
    with torch.no_grad():
        again = model(input_ids=ids).logits[0, keep]  # outside an engine's forward: every row
    assert seen_mlp[-1] == 40
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


class RouterBlock(torch.nn.Module):
    """As an MoE block that also returns its router logits."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x), x.sum(-1)


class OneLayerDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].mlp = RouterBlock()

    def get_decoder(self):
        return self


def test_a_block_returning_a_tuple_gets_its_hidden_states_scattered():
    model = OneLayerDecoder()
    assert head_rows.install(model) == ["mlp"]  # no attention module: its MLP alone
    block = model.layers[0].mlp
    x, rows = torch.randn(1, 6, 8), torch.tensor([1, 5])
    with torch.no_grad(), forward_context(SimpleNamespace(head_rows=rows)):
        hidden, router = block(x)
        expected = block.proj(x[0, rows])
    assert hidden.shape == (1, 6, 8) and router.shape == (1, 2)
    torch.testing.assert_close(hidden[0, rows], expected)
    assert hidden[0, [0, 2, 3, 4]].abs().sum() == 0  # rows nobody reads: zeros, the residual carries them


def test_engine_greedy_output_equals_generate_with_the_head_rows_cut(tokenizer):
    model = make_tiny_model("llama")
    prompts = [[5 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((3, 19, 41))]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                 eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    # a 16-token budget chunks the longer prompts: steps of 16 packed tokens, one or two read by the head
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16), eos_token_ids=[])
    assert getattr(model.model.layers[-1].mlp, "_batchgen_head_rows", False)
    seen = rows_seen(model.model.layers[-1].mlp.down_proj)
    got = {c.request_id: c.token_ids for c in engine.generate(
        Request(str(i), p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for i, p in enumerate(prompts))}
    assert [got[str(i)] for i in range(len(prompts))] == refs
    assert min(seen) < 16 and max(seen) <= len(prompts)  # never the chunk's 16 rows: only the head's
