"""The next step's grammar masks filled beside the forward: the same tokens as masks filled after it
(greedy and sampled, with rows joining, finishing and being preempted), prefetched masks used where
they are current, and a row whose mask was filled for another state filled again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen.config.constraint import Constraint
from batchgen.engine.request import Continuation, Request, SamplingParams
from batchgen.engine.sampling.grammar import GrammarMasks
from batchgen.engine.sequence import Sequence
from tests.engine.sampling.test_grammar import SCHEMA, engine, requests, run
from tests.tiny import make_tiny_model, make_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model("llama").eval()


def _mixed(temperature: float) -> list[Request]:
    """JSON, choice and regex rows interleaved: more rows than the batch, so rows join mid-run."""
    reqs = []
    for constraint, tag in ((Constraint.json_schema(SCHEMA), "j"), (Constraint.choices(["alpha", "beta gamma"]), "c"),
                            (Constraint.regex(r"[a-z]{3,9}-[0-9]{2}"), "r")):
        reqs += [Request(f"{tag}{r.request_id}", r.prompt_token_ids, r.sampling)
                 for r in requests(constraint, n=4, temperature=temperature)]
    return reqs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("num_kv_blocks", [64, 24], ids=["roomy", "preempting"])
def test_overlapped_masks_give_the_serial_tokens(model, tokenizer, one_thread, temperature, num_kv_blocks):
    reqs = _mixed(temperature)
    serial = engine(model, tokenizer, num_kv_blocks=num_kv_blocks)
    serial.grammar.overlap = False
    reference = run(serial, reqs)
    assert serial.grammar.num_prefetched_rows == 0
    overlapped = engine(model, tokenizer, num_kv_blocks=num_kv_blocks)
    done = run(overlapped, reqs)
    assert {k: c.token_ids for k, c in done.items()} == {k: c.token_ids for k, c in reference.items()}
    masks = overlapped.grammar
    # most masks came from the fill beside the forward; the rows that joined were filled after it
    assert masks.num_prefetched_rows > masks.num_filled_rows >= len(reqs)
    if num_kv_blocks == 24:
        assert overlapped.metrics.summary()["num_preemptions"] >= 1


def test_a_mask_filled_for_another_state_is_filled_again(model, tokenizer):
    vocab = model.get_output_embeddings().weight.shape[0]
    masks = GrammarMasks(tokenizer, vocab)
    constraint = Constraint.choices(["alpha", "beta"])
    seqs = [Sequence.from_request(i, Request(str(i), [5, 6, 7], SamplingParams(max_new_tokens=8,
                                                                               constraint=constraint)))
            for i in range(2)]
    for seq in seqs:
        masks.add(seq)
    logits = torch.zeros(2, vocab)
    first = masks.mask(logits, seqs)
    assert masks.num_filled_rows == 2
    token = tokenizer.encode("alpha", add_special_tokens=False)[0]
    assert not torch.isinf(first[0, token])
    masks.accept(seqs, [token, token])  # starts the next masks for two generated tokens each ...
    seqs[0].token_ids.append(token)  # ... which only row 0 then has (row 1's token is not appended)
    second = masks.mask(logits, seqs)
    assert (masks.num_prefetched_rows, masks.num_filled_rows) == (1, 3)
    # row 1 was filled again, from its grammar's state: the state row 0's prefetched mask is for
    continued = Sequence.from_request(9, Request("9", [5, 6, 7], SamplingParams(
        max_new_tokens=8, constraint=constraint), continuation=Continuation((token,))))
    reference = GrammarMasks(tokenizer, vocab)
    reference.add(continued)
    expected = reference.mask(logits[:1], [continued])[0]
    assert torch.equal(second[0], expected) and torch.equal(second[1], expected)
    assert not torch.equal(first[0], expected)


def test_filling_masks_does_not_import_torch_dynamo():
    # llguidance.torch compiles a kernel with torch.compile at import, which imports torch._dynamo:
    # the first constrained step would wait for that import
    code = """
import sys
import torch
from batchgen.config.constraint import Constraint
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sampling.grammar import GrammarMasks
from batchgen.engine.sequence import Sequence
from tests.tiny import VOCAB_SIZE, make_tokenizer

masks = GrammarMasks(make_tokenizer(), VOCAB_SIZE)
seq = Sequence.from_request(0, Request("0", [5, 6], SamplingParams(max_new_tokens=4,
                                                                   constraint=Constraint.choices(["ab", "cd"]))))
masks.add(seq)
logits = masks.mask(torch.zeros(1, VOCAB_SIZE), [seq])
allowed = sorted(torch.isfinite(logits[0]).nonzero().flatten().tolist())
print(allowed, "torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    tok = make_tokenizer()
    first_tokens = sorted(tok(text, add_special_tokens=False)["input_ids"][0] for text in ("ab", "cd"))
    assert done.stdout.split("]")[0] + "]" == str(first_tokens)  # the mask is the grammar's
    assert done.stdout.strip().endswith("False")
