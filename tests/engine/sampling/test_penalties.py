"""Repetition, presence and frequency penalties and min_tokens (engine/sampling/penalties.py).

Repetition penalty and min_tokens are checked against transformers' own logits processors on the
same logits and histories, and end to end against `model.generate` (greedy, token for token);
presence and frequency penalties against vLLM's definition, written out here.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import FinishReason, Request, SamplingParams
from batchgen.engine.sampling import penalties as penalties_module
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sequence import Sequence
from tests.tiny import make_tiny_model

VOCAB = 300
EOS = [2, 7]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def sequences(histories: list[tuple[list[int], list[int]]], **sampling) -> list[Sequence]:
    """Sequences with the given (prompt, output) token ids, as the engine holds them mid-generation."""
    seqs = []
    for i, (prompt, output) in enumerate(histories):
        seq = Sequence.from_request(i, Request(str(i), prompt, SamplingParams(max_new_tokens=64, **sampling)))
        seq.token_ids.extend(output)
        seqs.append(seq)
    return seqs


def histories(rng: random.Random, n: int = 6) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        output = [rng.randrange(40) for _ in range(rng.randint(0, 12))]  # a small range: repeats
        out.append((prompt, output))
    return out


def controlled(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    p = penalties_module.Penalties(EOS)
    for seq in seqs:
        p.add(seq)
    return p.apply(logits.clone(), seqs)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers_processor(penalty):
    rng = random.Random(0)
    hist = histories(rng)
    logits = torch.randn(len(hist), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    ours = controlled(sequences(hist, repetition_penalty=penalty), logits)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (prompt, output) in enumerate(hist):
        expected = processor(torch.tensor([prompt + output]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], expected, rtol=0, atol=0)


def test_min_tokens_equals_transformers_processor():
    rng = random.Random(1)
    hist = histories(rng)
    logits = torch.randn(len(hist), VOCAB, generator=torch.Generator().manual_seed(1))
    ours = controlled(sequences(hist, min_tokens=5), logits)
    for i, (prompt, output) in enumerate(hist):
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), 5, EOS)
        expected = processor(torch.tensor([prompt + output]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], expected, rtol=0, atol=0)
        assert (ours[i][EOS] == float("-inf")).all() == (len(output) < 5)


def test_presence_and_frequency_penalties_follow_vllm_definition():
    rng = random.Random(2)
    hist = histories(rng)
    logits = torch.randn(len(hist), VOCAB, generator=torch.Generator().manual_seed(2))
    ours = controlled(sequences(hist, presence_penalty=0.5, frequency_penalty=0.25), logits)
    for i, (prompt, output) in enumerate(hist):
        expected = logits[i].clone()
        for token in set(output):  # the output only: prompt tokens are not penalized
            expected[token] -= 0.25 * output.count(token) + 0.5
        torch.testing.assert_close(ours[i], expected)
        untouched = [t for t in set(prompt) if t not in output]
        assert torch.equal(ours[i][untouched], logits[i][untouched])


def test_rows_without_controls_are_untouched_and_state_follows_growth():
    rng = random.Random(3)
    hist = histories(rng, 2)
    seqs = sequences(hist[:1], frequency_penalty=1.0) + sequences(hist[1:])
    seqs[1].seq_id = 1
    p = penalties_module.Penalties(EOS)
    for seq in seqs:
        p.add(seq)
    logits = torch.randn(2, VOCAB)
    out = p.apply(logits.clone(), seqs)
    assert torch.equal(out[1], logits[1])
    seqs[0].token_ids.extend([5, 5])  # two more steps' tokens: counted once each on the next call
    again = p.apply(logits.clone(), seqs)
    assert again[0][5] == logits[0][5] - (hist[0][1].count(5) + 2) * 1.0


def test_sampler_skips_penalties_when_no_row_asks(monkeypatch):
    def boom(*args):
        raise AssertionError("penalties applied to a job without them")

    monkeypatch.setattr(penalties_module.Penalties, "apply", boom)
    sampler = Sampler(EOS)
    seqs = sequences(histories(random.Random(4)))
    for seq in seqs:
        sampler.add(seq)
    logits = torch.randn(len(seqs), VOCAB)
    assert sampler.sample(logits, seqs) == logits.argmax(-1).tolist()


def hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_equals_generate_with_repetition_penalty_and_min_tokens(tokenizer):
    model = make_tiny_model("llama", seed=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 261) for _ in range(rng.randint(3, 40))] for _ in range(8)]
    # EOS: a token the free-running model emits, so min_tokens has something to hold back
    free = [hf_generate(model, p, max_new_tokens=16, eos_token_id=2) for p in prompts]
    eos = max(set(t for run in free for t in run[1:8]), key=lambda t: sum(t in run[1:8] for run in free))
    settings = [dict(repetition_penalty=1.5), dict(min_tokens=10), dict(repetition_penalty=1.2, min_tokens=4), {}]
    requests, refs = [], []
    for i, prompt in enumerate(prompts):
        s = settings[i % len(settings)]
        refs.append(hf_generate(model, prompt, max_new_tokens=16, eos_token_id=eos,
                                repetition_penalty=s.get("repetition_penalty", 1.0),
                                min_new_tokens=s.get("min_tokens", 0)))
        requests.append(Request(str(i), prompt, SamplingParams(max_new_tokens=16, **s)))
    assert any(len(r) < 16 for r in refs), "some reference must stop at EOS"
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(kv_cache_bytes=4 * 2**20), eos_token_ids=[eos])
    by_id = {c.request_id: c for c in engine.generate(requests)}
    for i, ref in enumerate(refs):
        assert by_id[str(i)].token_ids == ref, (i, settings[i % len(settings)])
        min_tokens = settings[i % len(settings)].get("min_tokens", 0)
        assert len(ref) >= min(min_tokens + 1, 16) or by_id[str(i)].finish_reason is FinishReason.LENGTH
    assert not engine.runner.sampler.penalties, "finished rows keep no penalty state"
