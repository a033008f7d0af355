"""examples/airflow/batchgen_task.py without Airflow: which batchgen exit codes fail an Airflow task
for good (2: a retry repeats the mistake) and which retry (a DAG that retries exit 2 only repeats it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent.parent / "examples" / "airflow" / "batchgen_task.py"
spec = importlib.util.spec_from_file_location("batchgen_task", PATH)
batchgen_task = importlib.util.module_from_spec(spec)
spec.loader.exec_module(batchgen_task)


class Fail(Exception):
    pass


class Retry(Exception):
    pass


def command(code: int) -> list[str]:
    return [sys.executable, "-c", f"print('batchgen says hi'); raise SystemExit({code})"]


def test_success_streams_the_output(capsys):
    batchgen_task.run_batchgen(command(0), fail=Fail, retry=Retry)
    assert "batchgen says hi" in capsys.readouterr().out


def test_exit_2_fails_without_retry(capsys):
    with pytest.raises(Fail, match="exited 2"):
        batchgen_task.run_batchgen(command(2), fail=Fail, retry=Retry)
    assert "batchgen says hi" in capsys.readouterr().out  # the error line reaches the task log


@pytest.mark.parametrize("code", [1, 3, 4, 130, 143])
def test_other_failures_retry(code):
    with pytest.raises(Retry, match=f"exited {code}"):
        batchgen_task.run_batchgen(command(code), fail=Fail, retry=Retry)


def test_the_dag_uses_it_with_a_concurrency_cap():
    dag = (PATH.parent / "batchgen_dag.py").read_text()
    assert "@task.bash" not in dag  # a bash task cannot tell exit 2 from a retryable failure
    assert "run_batchgen(command, fail=AirflowFailException, retry=AirflowException)" in dag
    assert "max_active_tis_per_dag=MAX_PARALLEL_SHARDS" in dag and "pool=POOL" in dag
    assert '"--dtype", params["dtype"]' in dag  # auto resolves per worker kind; a retry elsewhere would exit 2
