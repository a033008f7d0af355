"""A machine profile: what one engine step costs on this machine, for `batchgen plan`'s time estimate.

A calibration run (batchgen.jobs.planning.estimate.calibrate) measures it: a few engine steps on
a sample of the job's prompts, fitted as overhead + seconds per token. It costs real generation,
which is most of a plan's time on a CPU, so `plan --calibrate` stores the fit here, under a key of
everything that changes it (the model's weights, device, dtype, quantization, KV cache dtype,
attention backend, this host and its core count), and a later plan of the same setup reads it
instead of measuring again.

Where no profile is stored, a CPU plan scales the built-in one: the fit measured on a reference
machine (the embedded SmolLM2-135M, bfloat16, 2 cores with AVX-512 BF16), scaled by the model's
weight count and the machine's cores. It is a rough guide (memory bandwidth, vector units and
dtype differ between machines); `--calibrate` measures the real one. Another device has no
built-in profile: its plan has no time estimate until a calibration stores one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.jobs.planning.estimate import Calibration
from batchgen.runtime.cache_dir import cache_root

log = logging.getLogger("batchgen")

# the reference machine's calibration (batchgen plan --calibrate on configs/summarize.yaml and
# examples/docs.parquet: the embedded model, bfloat16, 2 cores, AVX-512 BF16, 2026-12-04)
REFERENCE_STEP_OVERHEAD_S = 0.059
REFERENCE_SECONDS_PER_TOKEN = 0.00131
REFERENCE_NUM_WEIGHTS = 134_515_008  # SmolLM2-135M
REFERENCE_CORES = 2


@dataclass(frozen=True, slots=True)
class Profile:
    calibration: Calibration
    source: str  # "calibrated" (this plan), "stored" (an earlier calibration), "built-in" (scaled)
    calibrated_at: float | None = None  # unix time of the stored calibration

    def describe(self) -> str:
        if self.source == "calibrated":
            return f"calibrated now on {self.calibration.num_rows} rows (stored for later plans)"
        if self.source == "stored":
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.calibrated_at or 0))
            return f"this machine's stored profile, calibrated {when}"
        return "the built-in CPU profile scaled to this model and core count: a rough guide; --calibrate measures"


def profiles_dir() -> Path:
    return cache_root() / "profiles"


def profile_key(setup: dict[str, Any]) -> str:
    """The file name of a setup's profile: a digest of everything that changes a step's cost."""
    setup = {**setup, "host": platform.node(), "cores": os.cpu_count()}
    return hashlib.sha256(json.dumps(setup, sort_keys=True, default=str).encode()).hexdigest()[:20]


def store_profile(setup: dict[str, Any], calibration: Calibration) -> None:
    """Keep a calibration for later plans of the same setup; best effort (a plan writes no job files,
    and a cache it cannot write only costs the next plan a calibration)."""
    path = profiles_dir() / f"{profile_key(setup)}.json"
    record = {"setup": setup, "calibrated_at": time.time(), "num_rows": calibration.num_rows,
              "num_steps": calibration.num_steps, "step_overhead_s": calibration.step_overhead_s,
              "seconds_per_token": calibration.seconds_per_token}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # a concurrent plan reads the old profile or this one, whole
    except OSError as e:
        log.warning("could not store the machine profile in %s: %s", path.parent, e)


def load_profile(setup: dict[str, Any], *, device_type: str, num_weights: int) -> Profile | None:
    """The stored profile of this setup, else the built-in one (CPU only), else None."""
    path = profiles_dir() / f"{profile_key(setup)}.json"
    try:
        record = json.loads(path.read_text())
        calibration = Calibration(int(record["num_rows"]), int(record["num_steps"]),
                                  float(record["step_overhead_s"]), float(record["seconds_per_token"]))
        return Profile(calibration, "stored", float(record["calibrated_at"]))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged file: as if none were stored
        log.warning("ignoring the machine profile %s: %s", path, e)
    if device_type != "cpu":
        return None
    scale = (num_weights / REFERENCE_NUM_WEIGHTS) * (REFERENCE_CORES / max(1, os.cpu_count() or 1))
    return Profile(Calibration(0, 0, REFERENCE_STEP_OVERHEAD_S * scale, REFERENCE_SECONDS_PER_TOKEN * scale),
                   "built-in")
