"""--logprobs K through run_job on the tiny random Llama: a `logprobs` list column per row, one entry per
generated token with its text, id and logprob and K alternatives, equal to the model's log_softmax."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.io.store.schema import LOGPROBS_FIELD
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

TEXTS = ["one prompt", "another prompt", "a third, longer prompt than the others"]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 30}], ids=["greedy", "sampled"])
def test_logprobs_column_holds_each_tokens_logprob_and_alternatives(tmp_path, loaded, tiny_model_dir, one_thread,
                                                                    sampling):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), src)
    out = tmp_path / "out"
    run_job(tiny_job_config(src, out, tiny_model_dir, id_column="id", chat=False, max_new_tokens=6, logprobs=3,
                            ignore_eos=True, **sampling), loaded=loaded)
    part = next(p for p in out.rglob("*.parquet") if not p.name.startswith("_"))
    assert pq.read_schema(part).field("logprobs").type == LOGPROBS_FIELD.type
    rows = committed_rows(out)
    # the job's model runs batchgen's paged attention on prepacked weights: a fresh copy for the reference
    tokenizer = loaded.tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    for row_id, text in enumerate(TEXTS):
        row = rows[row_id]
        entries = row["logprobs"]
        assert len(entries) == row["num_generated_tokens"] == 6
        assert "".join(e["token"] for e in entries) == row["generated_text"]
        prompt = tokenizer(text, add_special_tokens=True)["input_ids"]
        generated = [e["token_id"] for e in entries]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()
        temperature = sampling.get("temperature", 1.0)
        for t, e in enumerate(entries):
            x = logits[t] / temperature
            if "top_k" in sampling:
                x = x.masked_fill(x < torch.topk(x, sampling["top_k"]).values[-1], float("-inf"))
            expected = torch.log_softmax(x, -1)
            assert abs(e["logprob"] - expected[e["token_id"]].item()) < 1e-4
            assert [a["token_id"] for a in e["top_logprobs"]] == torch.topk(expected, 3).indices.tolist()
            assert all(a["token"] == tokenizer.decode([a["token_id"]]) for a in e["top_logprobs"])
