"""A row's own sampling settings (jobs/rows/row_sampling.py): a value out of range is that row's
error naming the column, never an assertion deep in the engine."""

from __future__ import annotations

import pytest

from batchgen.jobs.prompting.prompts import RowError
from batchgen.jobs.rows.row_sampling import row_sampling


@pytest.mark.parametrize("cell", [
    '{"temperature": NaN}', '{"temperature": Infinity}', '{"temperature": -0.5}',
    {"temperature": float("nan")},  # a struct column's float field
])
def test_a_temperature_that_is_not_a_finite_number_from_0_is_the_rows_error(cell):
    with pytest.raises(RowError, match=r"column 's': temperature must be a finite number >= 0") as e:
        row_sampling({"s": cell}, "s")
    assert e.value.column == "s"


def test_a_finite_temperature_passes():
    assert row_sampling({"s": '{"temperature": 1.5}'}, "s") == {"temperature": 1.5}


@pytest.mark.parametrize("top_p", ["0", "1.5", "NaN"])
def test_a_top_p_outside_0_to_1_is_the_rows_error(top_p):
    with pytest.raises(RowError, match=r"column 's': top_p must be in \(0, 1\], got"):
        row_sampling({"s": f'{{"top_p": {top_p}}}'}, "s")
