"""Structured output in the engine: constrained rows (greedy and sampled) match their constraint,
end when the grammar does, equal a manually masked reference, and keep the constraint across
preemption by recompute and continuation."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jsonschema
import pytest
import torch

from batchgen.config.constraint import Constraint
from batchgen.engine.admission import RequestRejected
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Continuation, FinishReason, Request, SamplingParams
from tests.tiny import make_tiny_model

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["label", "ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model("llama").eval()


def engine(model, tokenizer, **overrides) -> LLMEngine:
    settings = dict(num_kv_blocks=64, block_size=4, max_num_seqs=4, adaptive_threads=False) | overrides
    return LLMEngine(model, tokenizer, EngineConfig(**settings), eos_token_ids=[2])


def requests(constraint: Constraint, n: int = 6, **sampling) -> list[Request]:
    rng = random.Random(1)
    params = SamplingParams(max_new_tokens=60, constraint=constraint, **sampling)
    return [Request(str(i), [rng.randrange(3, 60) for _ in range(rng.randint(2, 9))],
                    dataclasses.replace(params, seed=1000 + i)) for i in range(n)]


def run(eng: LLMEngine, reqs: list[Request]) -> dict:
    return {c.request_id: c for c in eng.generate(reqs)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_rows_parse_and_validate(model, tokenizer, one_thread, temperature):
    eng = engine(model, tokenizer)
    done = run(eng, requests(Constraint.json_schema(SCHEMA), temperature=temperature))
    assert len(done) == 6
    for c in done.values():
        assert c.finish_reason is FinishReason.STOP, c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert eng.grammar.num_compiled == 1  # rows sharing a schema compile once


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choices_and_regex(model, tokenizer, one_thread, temperature):
    eng = engine(model, tokenizer)
    choices = ["spam", "ham", "not sure"]
    for c in run(eng, requests(Constraint.choices(choices), temperature=temperature)).values():
        assert c.text in choices and c.finish_reason is FinishReason.STOP
    pattern = r"[a-c]{2,5}-[0-9]{1,3}"
    for c in run(eng, requests(Constraint.regex(pattern), temperature=temperature)).values():
        assert re.fullmatch(pattern, c.text), c.text


def test_length_cut_is_not_a_stop(model, tokenizer, one_thread):
    reqs = requests(Constraint.json_schema(SCHEMA))
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=5)) for r in reqs]
    for c in run(engine(model, tokenizer), reqs).values():
        assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 5


def test_greedy_equals_manually_masked_reference(model, tokenizer, one_thread):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    constraint = Constraint.json_schema(SCHEMA)
    reqs = requests(constraint, n=3)
    done = run(engine(model, tokenizer), reqs)
    torch.manual_seed(0)
    reference = make_tiny_model("llama").eval()  # the fixture's weights, untouched by the engine's prepacking
    vocab = reference.get_output_embeddings().weight.shape[0]
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    for r in reqs:
        matcher = llguidance.LLMatcher(ll_tokenizer, constraint.grammar())
        ids, out = list(r.prompt_token_ids), []
        while not matcher.is_stopped() and len(out) < r.sampling.max_new_tokens:
            with torch.no_grad():
                logits = reference(torch.tensor([ids])).logits[0, -1]
            bitmask = lt.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            allowed = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
            token = int(torch.where(torch.tensor(allowed, dtype=torch.bool), logits, float("-inf")).argmax())
            assert matcher.consume_token(token)
            ids.append(token)
            out.append(token)
        assert done[r.request_id].token_ids == out


@pytest.mark.parametrize("jump_forward", [True, False])
def test_greedy_rows_pick_from_the_bitmask_without_a_masked_copy(model, tokenizer, one_thread, monkeypatch,
                                                                  jump_forward):
    """Greedy constrained steps read the mask inside the argmax kernel; a step that needs the masked
    logits themselves (here: logprobs) makes the copy, and both pick the same tokens."""
    from batchgen.engine.kernels import argmax
    from batchgen.engine.sampling.grammar import GrammarMasks

    if argmax.argmax_rows_masked(torch.zeros(1, 32), torch.full((1, 1), -1, dtype=torch.int32), [0]) is None:
        pytest.skip("the C kernels are not built here")
    copies = []
    apply = GrammarMasks.apply
    monkeypatch.setattr(GrammarMasks, "apply", lambda self, *a: copies.append(1) or apply(self, *a))
    constraint = Constraint.json_schema(SCHEMA)
    fused = run(engine(model, tokenizer, jump_forward=jump_forward), requests(constraint, n=4))
    assert not copies
    copied = run(engine(model, tokenizer, jump_forward=jump_forward), requests(constraint, n=4, logprobs=0))
    assert copies
    assert {k: c.token_ids for k, c in fused.items()} == {k: c.token_ids for k, c in copied.items()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_keeps_the_constraint(model, tokenizer, one_thread, temperature):
    reqs = requests(Constraint.json_schema(SCHEMA), n=6, temperature=temperature)
    reference = run(engine(model, tokenizer), reqs)
    small = engine(model, tokenizer, num_kv_blocks=24)  # 96 token slots for 6 rows of up to ~70: recompute
    done = run(small, reqs)
    assert small.metrics.summary()["num_preemptions"] >= 1
    assert {k: c.token_ids for k, c in done.items()} == {k: c.token_ids for k, c in reference.items()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuation_keeps_the_constraint(model, tokenizer, one_thread, temperature):
    reqs = requests(Constraint.json_schema(SCHEMA), n=4, temperature=temperature)
    reference = run(engine(model, tokenizer), reqs)
    snapshot: dict = {}
    eng = engine(model, tokenizer)  # stopped after a few steps: the rows in flight continue in a fresh engine
    done = {c.request_id: c for c in _stepped(eng, reqs, stop_after=12, snapshot=snapshot)}
    assert snapshot, "nothing was in flight"
    continued = [dataclasses.replace(r, continuation=snapshot[r.request_id]) for r in reqs if r.request_id in snapshot]
    finished_first = {k: c for k, c in done.items() if k not in snapshot}
    later = run(engine(model, tokenizer), continued)
    merged = finished_first | later
    assert {k: c.token_ids for k, c in merged.items()} == {k: c.token_ids for k, c in reference.items()}


def _stepped(eng: LLMEngine, reqs: list[Request], *, stop_after: int, snapshot: dict):
    """Completions until `stop_after` steps, then what is in flight goes into `snapshot`."""
    class Stop(Exception):
        pass

    steps = [0]

    def between_steps():
        steps[0] += 1
        if steps[0] == stop_after:
            snapshot.update({r.request_id: c for r, c in eng.in_flight()})
            raise Stop

    try:
        yield from eng.generate(reqs, between_steps=between_steps)
    except Stop:
        return


def test_continued_tokens_that_finish_the_grammar_end_the_row(model, tokenizer, one_thread):
    constraint = Constraint.choices(["yes", "no"])
    request = Request("r", [5, 6, 7], SamplingParams(max_new_tokens=10, constraint=constraint),
                      continuation=Continuation(tuple(tokenizer.encode("no", add_special_tokens=False))))
    (c,) = run(engine(model, tokenizer), [request]).values()
    assert c.text == "no" and c.finish_reason is FinishReason.STOP


def test_invalid_constraint_rejects_the_request(model, tokenizer):
    eng = engine(model, tokenizer)
    with pytest.raises(RequestRejected, match="regex"):
        eng.add_request(Request("r", [5, 6], SamplingParams(constraint=Constraint.regex("[a-"))))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_free_rows_beside_constrained_ones_are_untouched(model, tokenizer, one_thread, temperature):
    constrained = requests(Constraint.json_schema(SCHEMA), n=4, temperature=temperature)
    free = [dataclasses.replace(r, request_id=f"free-{r.request_id}",
                                sampling=dataclasses.replace(r.sampling, constraint=None)) for r in constrained]
    alone = run(engine(model, tokenizer), free)
    mixed = run(engine(model, tokenizer), [r for pair in zip(constrained, free, strict=True) for r in pair])
    assert {k: mixed[k].token_ids for k in alone} == {k: c.token_ids for k, c in alone.items()}
    for r in constrained:
        jsonschema.validate(json.loads(mixed[r.request_id].text), SCHEMA)


def test_a_constraint_complete_before_min_tokens_ends_the_row_and_says_so_once(model, tokenizer, one_thread, caplog):
    eng = engine(model, tokenizer)
    with caplog.at_level("WARNING", logger="batchgen.engine.sampling.grammar"):
        done = run(eng, requests(Constraint.choices(["yes", "no"]), n=3, min_tokens=6))
    for c in done.values():
        assert c.text in ("yes", "no") and c.finish_reason is FinishReason.STOP and len(c.token_ids) < 6
    assert caplog.text.count("before its min_tokens 6") == 1, caplog.text
