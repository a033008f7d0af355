"""What `batchgen plan` estimates for --task embed, score and classify: time and output size.

Each row is one forward pass of a length known once it is tokenized, so nothing is predicted: the
encoder packs length-sorted rows into batches of at most the step token budget, and a batch costs
what a generation prefill of as many tokens costs (the same linears over every real token, no
padding). The time is the machine profile's fit (batchgen.jobs.planning.profile: overhead per
step + seconds per token) over those batches and tokens. The output is fixed per task: an embed
row's vector is its dimension's float32s, a score row three numbers, a classify row its label and
one float32 per label.

The weight count that scales the built-in profile comes from the safetensors headers (names,
dtypes, shapes), so a plan reads no weight.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.config.choices import Task
from batchgen.engine.encode.batching import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU,
    DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA,
    WINDOW_BUDGETS,
    plan_batches,
)
from batchgen.jobs.planning.estimate import Calibration
from batchgen.jobs.planning.output_size import OutputSize, cell_bytes

# what every row of these tasks writes beside its task columns: num_prompt_tokens (int32), prompt_hash
# (16 hex characters), prompt_truncated (one byte as Arrow counts a bool column's validity and value)
COMMON_BYTES_PER_ROW = 4 + 16 + 1
SCORE_BYTES_PER_ROW = 8 + 4 + 8  # logprob, num_scored_tokens, perplexity
FLOAT32_BYTES = 4
LIST_OFFSET_BYTES = 4  # a list<float32> cell's offset


@dataclass(slots=True)
class EncodeWork:
    """The forward passes of a job's rows: how many tokens, in how many packed batches. The batches
    are the encoder's own (engine/encode/encoder.py): the requests' stream cut into windows of
    WINDOW_BUDGETS budgets of tokens, each window's rows packed longest first by plan_batches."""

    budget_tokens: int  # the step token budget: a batch packs rows up to this many tokens
    max_rows_per_batch: int | None = None  # --batch-size
    padded_attention: bool = True  # batches sized by rows x longest (False: by real tokens, batching.engine_prefill)
    num_rows: int = 0
    num_tokens: int = 0
    _num_batches_done: int = 0
    _window: list[int] = field(default_factory=list)
    _window_tokens: int = 0

    def add(self, lengths: list[int]) -> None:
        """Requests' token lengths, in the order the job hands them to the encoder."""
        for n in lengths:
            self._window.append(n)
            self._window_tokens += n
            if self._window_tokens >= WINDOW_BUDGETS * self.budget_tokens:
                self._num_batches_done += self._batches(self._window)
                self._window, self._window_tokens = [], 0
        self.num_rows += len(lengths)
        self.num_tokens += sum(lengths)

    @property
    def num_batches(self) -> int:
        return self._num_batches_done + self._batches(self._window)

    def _batches(self, lengths: list[int]) -> int:
        return len(plan_batches(lengths, max_num_batched_tokens=self.budget_tokens,
                                max_num_seqs=self.max_rows_per_batch, padded_attention=self.padded_attention))

    def seconds(self, calibration: Calibration) -> float:
        return round(calibration.seconds(self.num_batches, self.num_tokens), 3)


def task_bytes_per_row(task: Task | str, *, embedding_dim: int | None = None,
                       labels: list[str] | None = None) -> int:
    """Uncompressed bytes of one row's task columns and the columns every row has."""
    task = Task(task)
    assert task != Task.GENERATE, "generation's output size is predicted (output_size.py)"
    if task == Task.EMBED:
        assert embedding_dim is not None
        own = embedding_dim * FLOAT32_BYTES
    elif task == Task.SCORE:
        own = SCORE_BYTES_PER_ROW
    else:  # the argmax label (its mean length over the labels) and one float32 per label
        labels = labels or ["LABEL_0"]
        own = round(sum(cell_bytes(label) for label in labels) / len(labels)) + LIST_OFFSET_BYTES + (
            FLOAT32_BYTES * len(labels))
    return own + COMMON_BYTES_PER_ROW


def encode_output_size(size: OutputSize, bytes_per_row: int) -> dict[str, Any]:
    """The output's uncompressed bytes: the task's columns per row, plus the ids and copied columns."""
    task_bytes = bytes_per_row * size.num_rows
    copied = sum(size.num_copied_bytes.values())
    return {"total_bytes": task_bytes + copied + size.num_id_bytes, "task_columns_bytes": task_bytes,
            "bytes_per_row": bytes_per_row, "copied_columns_bytes": copied,
            "copied_columns": dict(sorted(size.num_copied_bytes.items(), key=lambda kv: -kv[1]))}


def labels_from_files(model_path: str | Path | None) -> list[str] | None:
    """A sequence classifier's labels in id order, from its config.json's id2label."""
    config = _json(Path(model_path) / "config.json") if model_path is not None else None
    id2label = config.get("id2label") if isinstance(config, dict) else None
    if not isinstance(id2label, dict) or not id2label:
        return None
    try:
        return [str(label) for _, label in sorted((int(k), v) for k, v in id2label.items())]
    except (TypeError, ValueError):
        return None


def num_weights_from_files(model_path: str | Path | None) -> int | None:
    """The parameter count of a safetensors checkpoint, from its headers alone; None where it has none."""
    if model_path is None or not Path(model_path).is_dir():
        return None
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                (header_bytes,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_bytes))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                count = 1
                for dim in entry.get("shape", []):
                    count *= int(dim)
                total += count
    return total


def budget_tokens(max_num_batched_tokens: int | None, device_type: str) -> int:
    """The step token budget the encoder packs to: the flag's, else the encoder's default for the device."""
    if max_num_batched_tokens:
        return max_num_batched_tokens
    return DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA if device_type == "cuda" else DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
