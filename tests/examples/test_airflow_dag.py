"""examples/airflow/batchgen_dag.py under real Airflow 3: the DAG imports, and `dag.test()` runs it end
to end on the tiny model (shard_indices -> run_shard mapped over 2 shards -> finalize).

Airflow lives in its own venv (.ci/airflow-venv, `make airflow-venv`; `make test` builds it), so the
DAG runs in a subprocess of that venv's Python; its tasks call this venv's `batchgen`. dag.test()
executes the tasks in that one process, one after another, against a SQLite metadata database
copied from the one `make airflow-venv` migrated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.jobs.helpers import committed_rows

ROOT = Path(__file__).resolve().parent.parent.parent
AIRFLOW_VENV = ROOT / ".ci" / "airflow-venv"
DAG_DIR = ROOT / "examples" / "airflow"
BATCHGEN = Path(sys.executable).parent / "batchgen"

RUN_DAG = """
import json, sys
sys.path.insert(0, sys.argv[1])
import batchgen_dag
run = batchgen_dag.dag.test(run_conf=json.loads(sys.argv[2]))
states = {f"{ti.task_id}[{ti.map_index}]": str(ti.state) for ti in run.get_task_instances()}
print("RESULT " + json.dumps({"state": str(run.state), "tasks": states}))
"""


@pytest.fixture
def airflow_env(tmp_path):
    python = AIRFLOW_VENV / "bin" / "python"
    if not (AIRFLOW_VENV / ".installed").is_file():
        pytest.fail(f"Airflow's venv is missing: `make airflow-venv` creates {AIRFLOW_VENV} (`make test` builds it)")
    home = tmp_path / "airflow"
    home.mkdir()
    shutil.copy(AIRFLOW_VENV / "home" / "airflow.db", home / "airflow.db")  # migrated once by make
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(DAG_DIR), "PYTHONPATH": ""}
    return python, env


def test_the_dag_maps_batchgen_over_the_shards_and_finalizes(tmp_path, tiny_model_dir, airflow_env):
    python, env = airflow_env
    src = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": [f"prompt {i}" for i in range(12)]}), src, row_group_size=4)
    out = tmp_path / "out"
    conf = {"input": str(src), "output": str(out), "num_shards": 2, "model": str(tiny_model_dir),
            "batchgen": str(BATCHGEN),
            "dtype": "float32", "args": "--device cpu --max-new-tokens 3 --no-chat --kv-cache-memory 16MiB"}
    done = subprocess.run([str(python), "-c", RUN_DAG, str(DAG_DIR), json.dumps(conf)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["state"] == "success", result
    assert result["tasks"] == {"shard_indices[-1]": "success", "run_shard[0]": "success",
                               "run_shard[1]": "success", "finalize[-1]": "success"}
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS", "_summary.json", "shard-0-of-2", "shard-1-of-2"]
    assert set(committed_rows(out, "row_id")) == {f"prompts.parquet:{i}" for i in range(12)}
    assert json.loads((out / "_SUCCESS").read_text())["num_shards"] == 2
