"""The output schema per --task: generate's columns unchanged; embed, score and classify write their own
columns in place of generate's, and every row's bookkeeping columns (num_prompt_tokens, error,
prompt_hash, prompt_truncated) in all four."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchgen.config.choices import Task
from batchgen.io.store.schema import output_schema

ID = pa.field("id", pa.string())
PASSTHROUGH = [pa.field("source", pa.string())]
COMMON = ["num_prompt_tokens", "error", "prompt_hash", "prompt_truncated"]


def test_generate_keeps_its_schema():
    schema = output_schema(ID, PASSTHROUGH)
    assert schema == output_schema(ID, PASSTHROUGH, task="generate")
    assert schema.names == ["id", "generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens",
                            "error", "prompt_hash", "prompt_truncated", "source"]


def test_embed_writes_a_fixed_size_float32_vector_of_the_model_size():
    schema = output_schema(ID, PASSTHROUGH, task=Task.EMBED, embedding_dim=384)
    assert schema.names == ["id", "embedding", *COMMON, "source"]
    embedding = schema.field("embedding").type
    assert pa.types.is_fixed_size_list(embedding)
    assert embedding.list_size == 384 and embedding.value_type == pa.float32()
    # a dense [rows, 384] array: the whole column reshapes without per-row offsets
    column = pa.array([[0.5] * 384, None], type=embedding)
    assert column.flatten().to_numpy().reshape(-1, 384).shape == (1, 384)  # the null row holds no values


def test_score_and_classify_columns():
    score = output_schema(ID, PASSTHROUGH, task="score")
    assert score.names == ["id", "logprob", "num_scored_tokens", "perplexity", *COMMON, "source"]
    assert [score.field(n).type for n in ("logprob", "num_scored_tokens", "perplexity")] == [
        pa.float64(), pa.int32(), pa.float64()]
    classify = output_schema(ID, PASSTHROUGH, task="classify")
    assert classify.names == ["id", "label", "scores", *COMMON, "source"]
    assert classify.field("label").type == pa.string()
    assert classify.field("scores").type == pa.list_(pa.float32())


@pytest.mark.parametrize("task", ["embed", "score", "classify"])
def test_no_generation_columns_and_the_sample_index_and_old_directories_still_apply(task):
    schema = output_schema(ID, [], task=task, embedding_dim=8, with_sample_index=True, with_prompt_hash=False)
    assert not {"generated_text", "finish_reason", "num_generated_tokens"} & set(schema.names)
    assert schema.names[:2] == ["id", "sample_index"]  # an OpenAI embeddings line's several inputs
    assert "prompt_hash" not in schema.names and "prompt_truncated" in schema.names


def test_the_embedding_size_enters_the_schema():
    """Two sizes are two schemas, so the fingerprint's output_schema key tells a --dimensions change apart."""
    assert output_schema(ID, [], task="embed", embedding_dim=8) != output_schema(ID, [], task="embed",
                                                                                 embedding_dim=4)
