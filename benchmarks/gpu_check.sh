#!/usr/bin/env bash
# The CUDA path's check (benchmarks/gpu_check.py: versions, Triton, a 1.5B-shaped vLLM engine
# against HF generate, the in-memory sync, sleep level 2, three colocated steps), time-boxed,
# its JSON rewritten after every part. Results: $OUT/gpu_check.json (default
# benchmarks/results/gpu_check) and the log on stdout.
#
# On a GPU machine without vLLM, DeepSpeed or a network (the device tool's: Python 3.12,
# torch 2.11.0+cu130), from the kit `benchmarks/gpu_kit.py prepare` builds here in
# .gpu_kit/call-1, call-2 (each under one call's 64 MiB); two calls in a row, the second
# within the 30 s the machine stays up (it keeps its files):
#   call 1, carry .gpu_kit/call-1:  mkdir -p /root/kit && cp -r .gpu_kit/call-1 /root/kit/
#   call 2, carry .gpu_kit/call-2:  cp -r .gpu_kit/call-2 /root/kit/ && OUT=$OUT KIT=/root/kit benchmarks/gpu_check.sh
# Elsewhere:
#   PYTHON=/opt/venv/bin/python benchmarks/gpu_check.sh   # an environment with vLLM and DeepSpeed (the dapo-gpu image)
#   KIT=.gpu_kit benchmarks/gpu_check.sh --cpu            # the dry run here: the kit installed for real with a
#       Python 3.12 (into a scratch folder), then the check small on the CPU with the dev venv (vLLM's CPU build)
# BUDGET_SECONDS (default 480) is the check's time box: parts that would not fit are skipped.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/benchmarks/results/gpu_check}"
MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then
  MODE=cpu
  shift
fi

log() { echo "[gpu_check.sh $(date +%H:%M:%S)] $*"; }

if [[ "$MODE" == gpu ]]; then
  PY="${PYTHON:-python3}"
else
  PY="${PYTHON:-$REPO/.venv/bin/python}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [[ -n "${KIT:-}" ]]; then
  if [[ "$MODE" == gpu ]]; then
    KIT_PYTHON="$PY"
    TARGET="${KIT_TARGET:-$KIT/site}"
  else  # the install as there, with this machine's Python 3.12, into a scratch folder
    KIT_PYTHON="$("$PY" "$REPO/benchmarks/gpu_kit.py" python312)"
    TARGET="$(mktemp -d)/site"
  fi
  if [[ ! -f "$TARGET/.installed" ]]; then
    log "installing the kit from $KIT into $TARGET"
    "$KIT_PYTHON" "$REPO/benchmarks/gpu_kit.py" install --kit "$KIT" --target "$TARGET"
    touch "$TARGET/.installed"
  fi
  if [[ "$MODE" == gpu ]]; then
    export PYTHONPATH="$TARGET:$PYTHONPATH"
    if [[ -d "$TARGET/python3.12" ]]; then  # Python's headers, carried: Triton compiles its launcher with them
      export C_INCLUDE_PATH="$TARGET/python3.12${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
    fi
  else
    log "the kit installs with $("$KIT_PYTHON" --version); its imports need the GPU machine's packages (torch 2.11): not tried here"
    rm -rf "$(dirname "$TARGET")"
  fi
fi

export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT"
if [[ "$MODE" == gpu ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  export DS_ACCELERATOR=cuda
  # peak memory of the whole GPU while the checks run (vLLM's own allocations included)
  (while sleep 1; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) > "$OUT/nvidia_smi_used_mib.txt" 2>/dev/null &
  SAMPLER=$!
  trap 'kill "$SAMPLER" 2>/dev/null || true' EXIT
  "$PY" "$REPO/benchmarks/gpu_check.py" --out "$OUT" --budget-seconds "${BUDGET_SECONDS:-480}" "$@"
  log "peak GPU memory used (nvidia-smi, whole GPU): $(sort -n "$OUT/nvidia_smi_used_mib.txt" | tail -1) MiB"
else
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  "$PY" "$REPO/benchmarks/gpu_check.py" --cpu --out "$OUT" --budget-seconds "${BUDGET_SECONDS:-480}" "$@"
fi
log "results: $OUT/gpu_check.json"
