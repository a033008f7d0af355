"""Jump-forward over a grammar's forced tokens: greedy tokens equal to decoding without it, for JSON
schemas, regexes and choices, through preemption, split chunks, continuation and drafts the model
refuses; forced tokens counted and decode steps saved."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from batchgen.config.choices import Policy
from batchgen.config.constraint import Constraint
from batchgen.engine.sampling import jump_forward
from tests.engine.sampling.test_grammar import SCHEMA, _stepped, engine, requests, run
from tests.tiny import SPECIAL_TOKENS, _common

VOCAB_SIZE = 280
CONSTRAINTS = {"json": Constraint.json_schema(SCHEMA), "choices": Constraint.choices(["spam", "ham", "not sure"]),
               "regex": Constraint.regex(r"[a-c]{2,5}-[0-9]{1,3}x-end")}


@pytest.fixture(scope="module")
def merging_tokenizer():
    """A byte-level BPE with merges over the constraints' text: a forced string has several
    tokenizations, so which one the model picks is the model's choice (no merges would hide that)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"label": label, "ok": ok, "tag": "ab"}, separators=(",", ":"))
              for label in ("cat", "dog", "bird") for ok in (True, False)]
    corpus += ["spam", "ham", "not sure", "abc-12x-end"] * 3
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(**_common(vocab_size=VOCAB_SIZE))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def _tokens(done: dict) -> dict:
    return {k: c.token_ids for k, c in done.items()}


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("settings", [{}, {"num_kv_blocks": None}, {"max_num_batched_tokens": 3},
                                      {"policy": Policy.STATIC}], ids=["roomy", "preempting", "split-chunks", "static"])
def test_on_and_off_give_the_same_greedy_tokens(model, merging_tokenizer, one_thread, kind, settings):
    if "num_kv_blocks" in settings:  # too few for 4 rows at once: rows are preempted and recomputed
        settings = {"num_kv_blocks": {"json": 24, "choices": 5, "regex": 8}[kind]}
    reqs = requests(CONSTRAINTS[kind], n=6)
    off = engine(model, merging_tokenizer, jump_forward=False, **settings)
    reference = run(off, reqs)
    on = engine(model, merging_tokenizer, **settings)
    assert _tokens(run(on, reqs)) == _tokens(reference)
    assert off.metrics.num_forced_tokens == 0 and on.metrics.num_forced_tokens > 0
    # the per-step token counts (progress, ETA, metrics files) still add up to every generated token
    assert on.metrics.num_sampled_tokens == off.metrics.num_sampled_tokens == on.metrics.num_generated_tokens
    assert on.metrics.num_row_steps < off.metrics.num_row_steps == off.metrics.num_generated_tokens
    if "max_num_batched_tokens" not in settings:  # one decode step fewer per confirmed draft, roughly
        assert on.metrics.num_steps < off.metrics.num_steps
    if "num_kv_blocks" in settings:
        assert on.metrics.num_preemptions >= 1


@pytest.mark.parametrize("kind", ["json", "choices"])  # the regex's forced tail is picked byte by byte here
def test_drafts_the_model_refuses_are_replaced_by_its_picks(model, merging_tokenizer, one_thread, monkeypatch, kind):
    """Drafts that spell the forced text one byte per token: grammatical, but not what the model
    picks where a merged token fits; each refused draft gives way to the model's pick."""
    canonical = jump_forward.forced_tokens

    def bytewise(matcher, seq, num_generated, max_model_len):
        text = merging_tokenizer.decode(canonical(matcher, seq, num_generated, max_model_len))
        byte_ids = [merging_tokenizer.convert_tokens_to_ids(merging_tokenizer.tokenize(ch)) for ch in text]
        return [i for ids in byte_ids if len(ids) == 1 for i in ids]

    reqs = requests(CONSTRAINTS[kind], n=6)
    reference = run(engine(model, merging_tokenizer, jump_forward=False), reqs)
    monkeypatch.setattr(jump_forward, "forced_tokens", bytewise)
    on = engine(model, merging_tokenizer)
    assert _tokens(run(on, reqs)) == _tokens(reference)
    assert on.runner.sampler.num_refused_drafts > 0


@pytest.mark.parametrize("stop_after", [2, 3])
def test_continuation_leaves_unconfirmed_drafts_out(model, merging_tokenizer, one_thread, stop_after):
    reqs = requests(CONSTRAINTS["json"], n=4)
    reference = run(engine(model, merging_tokenizer, jump_forward=False), reqs)
    eng = engine(model, merging_tokenizer)
    snapshot: dict = {}
    done = {c.request_id: c for c in _stepped(eng, reqs, stop_after=stop_after, snapshot=snapshot)}
    assert snapshot, "nothing was in flight"
    drafting = [s for s in eng.scheduler.running if s.num_draft_tokens]
    assert drafting, "no row held drafts when stopped"
    for seq in drafting:  # the checkpoint holds the confirmed tokens only
        assert len(snapshot[seq.request.request_id].token_ids) == seq.num_confirmed_tokens - seq.num_prompt_tokens
    continued = [dataclasses.replace(r, continuation=snapshot[r.request_id]) for r in reqs if r.request_id in snapshot]
    later = run(engine(model, merging_tokenizer), continued)
    assert _tokens({k: c for k, c in done.items() if k not in snapshot} | later) == _tokens(reference)
