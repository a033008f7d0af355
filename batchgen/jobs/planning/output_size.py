"""What `batchgen plan` expects the output to weigh: generated text plus the input columns copied.

Uncompressed bytes, as Arrow holds them: the generated text is the predicted output tokens (p50)
times the bytes per token of this tokenizer on this input (measured by decoding a sample of the
prompts); copied columns are measured on the rows themselves. By default every input column is
copied, so a summarization job writes each document a second time: the plan line says so, and
--keep-columns chooses fewer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FIXED_BYTES_PER_ROW = 4 + 4 + 8  # num_prompt_tokens, num_generated_tokens (int32), finish_reason (~"stop")


def cell_bytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(cell_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(cell_bytes(v) for v in value.values())
    return 8  # numbers, booleans, timestamps


@dataclass(slots=True)
class OutputSize:
    columns: list[str]  # the input columns copied to the output
    num_rows: int = 0
    num_id_bytes: int = 0
    num_copied_bytes: dict[str, int] = field(default_factory=dict)

    def add(self, row_id: Any, values: dict[str, Any], copies: int = 1) -> None:
        """One input row, written `copies` times (once per sample of a row with n samples)."""
        self.num_rows += copies
        self.num_id_bytes += copies * cell_bytes(row_id)
        for name in self.columns:
            self.num_copied_bytes[name] = self.num_copied_bytes.get(name, 0) + copies * cell_bytes(values.get(name))

    def describe(self, predicted_output_tokens: int, bytes_per_token: float) -> dict[str, Any]:
        generated = round(predicted_output_tokens * bytes_per_token)
        copied = sum(self.num_copied_bytes.values())
        return {"total_bytes": generated + copied + self.num_id_bytes + FIXED_BYTES_PER_ROW * self.num_rows,
                "generated_text_bytes": generated, "copied_columns_bytes": copied,
                "copied_columns": dict(sorted(self.num_copied_bytes.items(), key=lambda kv: -kv[1])),
                "bytes_per_token": round(bytes_per_token, 2)}


def text_bytes_per_token(tokenizer, samples: list[list[int]]) -> float:
    """UTF-8 bytes per token of decoded text, over sample prompts (4.0, a usual figure, without any)."""
    num_tokens = sum(len(s) for s in samples)
    if not num_tokens:
        return 4.0
    return sum(len(tokenizer.decode(s, skip_special_tokens=True).encode()) for s in samples) / num_tokens


def size_text(num_bytes: float) -> str:
    """A byte count for people: 512 B, 1.5 KiB, 2.0 MiB, 3.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"
