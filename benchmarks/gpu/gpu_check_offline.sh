#!/usr/bin/env bash
# The GPU check on a machine that reaches no package registry: the image's own python3 (torch,
# transformers, pyarrow, typer, ... already there), batchgen from this checkout on PYTHONPATH, and the
# carried folder .gpu/ that `python -m benchmarks.gpu.gpu_check_prepare --dir .gpu` builds beforehand
# (tokenizer, ShareGPT workloads, rows for the extras, a tiny BERT, wheels of what the image lacks).
#
#   bash benchmarks/gpu/gpu_check_offline.sh OUT_DIR          # QUICK=1 or FULL=1 for the other sizes
#                                         # NO_PYTEST=1, NO_EXTRAS=1: a rerun of the measurements alone
#   GPU_CHECK_ARGS='--device cpu --tiny-shape' PYTHON=venv/bin/python bash benchmarks/gpu/gpu_check_offline.sh /tmp/o
#                                                         # a dry run of the whole path on the CPU
#
# It runs, each under its own timeout so a hang cannot eat the machine's time:
#   1. pytest -m gpu tests/engine/test_gpu.py
#   2. python -m benchmarks.gpu.gpu_check (the gate, ShareGPT vs HF generate, uniform static vs continuous,
#      decode step vs the HBM bound); its JSON records land in OUT_DIR
#   3. extras, each allowed to fail: a sampled and a JSON-schema `batchgen run` on ShareGPT rows with
#      the 1B-shaped model at default flags, and an embed job on the tiny BERT
# Exit status: gpu_check's (0 all equal, 1 greedy differs, 2 no GPU), else 1 if the gpu tests failed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT_DIR="${1:-${OUT:-/tmp/gpu-check-out}}"
GPU="${GPU_DIR:-$REPO/.gpu}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu-check-work}"
PY="${PYTHON:-python3}"
SIZE=()
[[ -n "${QUICK:-}" ]] && SIZE=(--quick)
[[ -n "${FULL:-}" ]] && SIZE=(--full)
T0=$SECONDS
stamp() { echo "[gpu_check_offline +$((SECONDS - T0))s] $*"; }
mkdir -p "$OUT_DIR" "$WORK"
cd "$REPO" || exit 2

for need in tokenizer sharegpt rows.parquet; do
  [[ -e "$GPU/$need" ]] || { echo "gpu_check_offline: $GPU/$need missing: run python -m benchmarks.gpu.gpu_check_prepare" >&2; exit 2; }
done
export PYTHONPATH="$REPO"
if compgen -G "$GPU/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$GPU"/whl/*.whl || { echo "gpu_check_offline: carried wheels did not install" >&2; exit 2; }
  export PYTHONPATH="$REPO:$WORK/site"
fi
export BATCHGEN_CACHE_DIR="$WORK/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# the C kernels serve CPU tensors only; on CUDA nothing calls them, so none is built there
export BATCHGEN_NO_NATIVE=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" - <<'EOF'
import importlib.util, torch, transformers
print(f"python3 torch {torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()}) "
      f"transformers {transformers.__version__}; flash_attn "
      f"{'installed' if importlib.util.find_spec('flash_attn') else 'absent: SDPA attention, no CUDA graphs'}")
EOF
mkdir -p benchmarks/results && cp "$GPU"/sharegpt/*.json benchmarks/results/

TESTS_RC=0
if [[ -z "${NO_PYTEST:-}" ]]; then
  stamp "pytest -m gpu"
  timeout -k 10 "${PYTEST_TIMEOUT_S:-120}" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu.py
  TESTS_RC=$?
fi

stamp "benchmarks.gpu.gpu_check"
timeout -k 10 "${CHECK_TIMEOUT_S:-330}" "$PY" -m benchmarks.gpu.gpu_check --out "$OUT_DIR" --work "$WORK" \
  --tokenizer "$GPU/tokenizer" "${SIZE[@]}" ${GPU_CHECK_ARGS:-}
CHECK_RC=$?
stamp "gpu_check rc=$CHECK_RC"

MODEL="$WORK/llama-3.2-1b-shaped-random"
DEADLINE_S="${DEADLINE_S:-450}"  # extras start only while this many seconds since the start are not spent
extra() {  # name, timeout seconds, batchgen run flags: one job; its _summary.json comes back as OUT/NAME_summary.json
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE_S - (SECONDS - T0)))
  (( left < limit )) && limit=$left
  (( limit >= 20 )) || { stamp "extra $name skipped: ${left}s left before the ${DEADLINE_S}s deadline"; return; }
  stamp "extra $name (timeout ${limit}s)"
  rm -rf "$WORK/extra-$name"
  timeout -k 10 "$limit" "$PY" -m batchgen run --input "$GPU/rows.parquet" --output "$WORK/extra-$name" --id-column id \
    --quiet "$@"
  local rc=$?
  cp "$WORK/extra-$name/_summary.json" "$OUT_DIR/${name}_summary.json" 2>/dev/null
  stamp "extra $name rc=$rc"
}
if [[ -d "$MODEL" && -z "${NO_EXTRAS:-}" ]]; then
  extra sampled "${EXTRA_TIMEOUT_S:-60}" --model "$MODEL" --temperature 0.8 --top-p 0.95
  extra json "${EXTRA_TIMEOUT_S:-60}" --model "$MODEL" --json-schema examples/doc_fields.schema.json --max-rows 128
  "$PY" - "$WORK/extra-json" <<'EOF' 2>/dev/null
import collections, sys
import pyarrow.dataset as ds
rows = ds.dataset(sys.argv[1], format="parquet").to_table(columns=["json_valid", "finish_reason"]).to_pylist()
print(f"extra json: {len(rows)} rows; json_valid {dict(collections.Counter(r['json_valid'] for r in rows))}; "
      f"finish_reason {dict(collections.Counter(r['finish_reason'] for r in rows))}")
EOF
fi
if [[ -z "${NO_EXTRAS:-}" && -d "$GPU/bert" ]]; then
  extra embed "${EXTRA_TIMEOUT_S:-60}" --task embed --model "$GPU/bert"
fi

stamp "done: gpu tests rc=$TESTS_RC, gpu_check rc=$CHECK_RC; records in $OUT_DIR"
if [[ $CHECK_RC -ne 0 ]]; then exit "$CHECK_RC"; fi
[[ $TESTS_RC -eq 0 ]] || exit 1
