"""An Airflow 3 DAG that runs one batchgen job as N shards in parallel, then finalizes it.

    run_shard[0] ... run_shard[N-1]   `batchgen run ... --num-shards N --shard-index I` (dynamic task mapping)
    finalize                          `batchgen finalize --output OUTPUT`: checks the set, writes OUTPUT/_SUCCESS

Each mapped task is one process with its own output directory (OUTPUT/shard-I-of-N/), so the shards
run on any workers at once, and Airflow's retries resume a shard where it stopped: committed rows
are skipped, never generated twice. batchgen's exit codes fit Airflow (batchgen_task.py): 0 is
success; exit 2 (a usage, config or input error, which a retry repeats) fails the task at once,
without retries; any other failure retries. A task Airflow stops (timeout, a cleared task, a worker
shutting down) gets SIGTERM, commits its finished rows and exits 143, and the retry continues from
there. `batchgen finalize` exits 4 while a shard is missing or incomplete (retried), 2 when the
shards are not one job (other settings or inputs).

At most MAX_PARALLEL_SHARDS shards of one run generate at once: each loads its own model and
takes a machine's cores or GPU. To cap batchgen across DAGs too, create a pool
(`airflow pools set batchgen 4 "batchgen jobs"`) and set POOL to its name.

Trigger it with a conf (or edit the params' defaults):

    airflow dags trigger batchgen_sharded --conf '{"input": "s3://bucket/prompts/", "output": "/data/out/job1",
        "num_shards": 8, "args": "--config /etc/batchgen/summarize.yaml"}'

`batchgen` must be on the workers' PATH (or set the `batchgen` param to its path). The workers
need the input and the output on a shared filesystem (NFS, a mounted bucket) or an object store:
with "output": "s3://bucket/out/job1" each mapped task writes s3://bucket/out/job1/shard-I-of-N/
and finalize writes the job's _SUCCESS there (AWS credentials in the workers' environment).
"""

from __future__ import annotations

import shlex
from datetime import timedelta

from airflow.exceptions import AirflowException, AirflowFailException
from airflow.sdk import DAG, Param, task
from batchgen_task import run_batchgen  # beside this file: Airflow puts the DAGs folder on sys.path

MAX_PARALLEL_SHARDS = 4  # mapped run_shard tasks of one DAG run at once
POOL = "default_pool"  # a pool of your own ("batchgen") caps batchgen processes across DAGs

with DAG(
    dag_id="batchgen_sharded",
    schedule=None,  # triggered per job; set a schedule for a nightly backfill
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=30)},
    params={
        # absolute paths: a BashOperator task runs in a temporary working directory
        "input": Param("/data/prompts.parquet", type="string", description="--input: file, directory, glob or URL"),
        "output": Param("/data/out/job", type="string", description="--output: a directory or s3:// prefix"),
        "num_shards": Param(2, type="integer", minimum=1, description="processes the job is split into"),
        "model": Param("", type="string", description="--model (empty: batchgen's default)"),
        # pinned, not auto: auto resolves per worker (bf16 where the CPU has native bf16, else fp32) and a
        # shard's retry on a worker of the other kind would be refused (exit 2) as a changed setting
        "dtype": Param("bfloat16", type="string", enum=["bfloat16", "float32", "float16"],
                       description="--dtype, the same on every worker"),
        "args": Param("", type="string", description="more `batchgen run` flags (shell words), e.g. --config FILE"),
        "batchgen": Param("batchgen", type="string", description="the batchgen executable on the workers"),
    },
    tags=["batchgen"],
) as dag:

    @task
    def shard_indices(params=None) -> list[int]:
        """0..N-1: one mapped run_shard task per shard, decided when the run starts (conf may change N)."""
        return list(range(int(params["num_shards"])))

    @task(execution_timeout=timedelta(hours=12), max_active_tis_per_dag=MAX_PARALLEL_SHARDS, pool=POOL)
    def run_shard(shard_index: int, params=None) -> None:
        """One shard; a retry runs the same command, which resumes it."""
        command = [params["batchgen"], "run", "--input", params["input"], "--output", params["output"],
                   "--num-shards", str(params["num_shards"]), "--shard-index", str(shard_index),
                   "--dtype", params["dtype"], "--quiet"]
        if params["model"]:
            command += ["--model", params["model"]]
        command += shlex.split(params["args"])
        run_batchgen(command, fail=AirflowFailException, retry=AirflowException)

    @task(pool=POOL)
    def finalize(params=None) -> None:
        """Runs once every shard succeeded: checks the set, writes OUTPUT/_SUCCESS (idempotent)."""
        run_batchgen([params["batchgen"], "finalize", "--output", params["output"]], fail=AirflowFailException,
                     retry=AirflowException)

    run_shard.expand(shard_index=shard_indices()) >> finalize()
