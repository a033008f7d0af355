"""plan's arithmetic for --task embed, score and classify: the packed batches of a window, their time
from the profile's fit, each task's bytes per row, and the weight count and labels read from files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from batchgen.engine.encode.batching import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU,
    DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA,
    WINDOW_BUDGETS,
)
from batchgen.jobs.planning.encode_estimate import (
    COMMON_BYTES_PER_ROW,
    EncodeWork,
    budget_tokens,
    labels_from_files,
    num_weights_from_files,
    task_bytes_per_row,
)
from batchgen.jobs.planning.estimate import Calibration


def test_rows_pack_by_length_under_the_token_budget():
    work = EncodeWork(budget_tokens=10)
    work.add([10, 5, 5, 5])  # longest first: 10 | 5 5 | 5: a row never splits, a full row runs alone
    assert (work.num_batches, work.num_rows, work.num_tokens) == (3, 4, 25)
    work.add([30])  # longer than the budget: alone, not dropped
    assert (work.num_batches, work.num_tokens) == (4, 55)
    assert work.seconds(Calibration(0, 0, step_overhead_s=0.1, seconds_per_token=0.01)) == pytest.approx(
        4 * 0.1 + 55 * 0.01)


def test_the_request_stream_is_cut_into_the_encoders_windows():
    """The encoder packs each window of WINDOW_BUDGETS budgets of tokens on its own: rows of 6 tokens
    under a budget of 10 run one a batch, but a row of 4 pairs with one of 6 only in the same window."""
    work = EncodeWork(budget_tokens=10)
    work.add([6] * (WINDOW_BUDGETS * 10 // 6 + 1))  # fills the first window exactly past its budget
    work.add([4])  # starts the next window: alone
    assert work.num_batches == WINDOW_BUDGETS * 10 // 6 + 2
    together = EncodeWork(budget_tokens=12)  # a batch's rows x its longest row fit the budget: 2 x 6
    together.add([6, 4])
    assert together.num_batches == 1


def test_batch_size_caps_the_rows_of_a_batch():
    work = EncodeWork(budget_tokens=1000, max_rows_per_batch=2)
    work.add([1, 1, 1, 1, 1])
    assert work.num_batches == 3


def test_the_budget_is_the_flag_else_the_encoders_default():
    assert budget_tokens(512, "cpu") == 512
    assert budget_tokens(None, "cpu") == DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU
    assert budget_tokens(None, "cuda") == DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA


def test_bytes_per_row_per_task():
    assert task_bytes_per_row("embed", embedding_dim=384) == 384 * 4 + COMMON_BYTES_PER_ROW
    assert task_bytes_per_row("score") == 8 + 4 + 8 + COMMON_BYTES_PER_ROW
    # the label's mean length, a list offset and one float32 per label
    expected = round(11 / 2) + 4 + 2 * 4 + COMMON_BYTES_PER_ROW
    assert task_bytes_per_row("classify", labels=["neg", "positive"]) == expected


def test_weights_and_labels_come_from_the_files_without_loading(tmp_path):
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=3,
                        id2label={0: "low", 1: "mid", 2: "high"}, label2id={"low": 0, "mid": 1, "high": 2})
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    model.save_pretrained(tmp_path)
    assert num_weights_from_files(tmp_path) == sum(p.numel() for p in model.parameters())
    assert labels_from_files(tmp_path) == ["low", "mid", "high"]
    assert num_weights_from_files(tmp_path / "missing") is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert labels_from_files(tmp_path) is None
