"""The report's row charts without a job: reasons keep the digits of names, counts get whole-number
ticks, and rows that failed before planning are filed as rejected, not as 'no prompt'."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from batchgen.monitor import figures, report
from batchgen.monitor.records import ROWS_SCHEMA


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures the report draws, kept instead of only their PNG bytes."""
    kept = []
    real = figures.to_png

    def keep(fig):
        kept.append(fig)
        return real(fig)

    monkeypatch.setattr(figures, "to_png", keep)
    return kept


def test_error_reasons_keep_the_digits_of_names_and_group_the_numbers():
    assert report.error_reason("unsupported endpoint /v1/embeddings (line 17)") == \
        "unsupported endpoint /v1/embeddings (line N)"
    assert report.error_reason("prompt of 4096 tokens is longer than 2048 (bf16 model)") == \
        "prompt of N tokens is longer than N (bf16 model)"


def test_error_rows_chart_ticks_are_whole_rows(drawn):
    report.errors_figure(Counter({"a reason": 1, "another": 2}))
    ticks = drawn[-1].axes[0].get_xticks()
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def test_rows_failed_before_planning_are_rejected_rows_on_whole_ticks(drawn):
    rows = pa.Table.from_pylist([
        {"run_id": "r", "time_s": 1, "window": None, "mode": None, "num_rows": 2, "num_rows_error": 2},
        {"run_id": "r", "time_s": 1, "window": 0, "mode": "continuous", "num_rows": 1, "num_rows_error": 0},
    ], schema=ROWS_SCHEMA)
    report._rows_per_window(rows)
    ax = drawn[-1].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "rejected before planning" in labels and not any("no prompt" in label for label in labels), labels
    assert all(float(t).is_integer() for t in ax.get_yticks()), ax.get_yticks()
