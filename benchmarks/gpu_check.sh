#!/usr/bin/env bash
# One-GPU check of what a CPU cannot show (issue 12), offline, in under 8 minutes:
#   - vLLM-vs-trainer log-prob gap in bf16 (and fp32) before and after an in-place reload,
#     and on a fresh engine, for tied and untied generated Qwen2 policies: the bf16 figure
#     sets DAPOConfig's bf16 guard default (dapo/config.py ROLLOUT_GAP_DEFAULTS);
#   - one DAPO step with CUDA vLLM and DeepSpeed through the pipeline functions, the new
#     checkpoint reloaded in place, and the rollout guard's metrics;
#   - three colocated steps (issue 14: trainer and vLLM resident, weights synced in memory):
#     the sync's time, the guard's gap after it, tokens/s, peak GPU memory;
#   - vLLM tokens/s against transformers' generate; peak GPU memory.
# Results: benchmarks/results/gpu_check/gpu_check.json (and the log on stdout).
#
# Usage (from anywhere; needs bash, python3.11, an NVIDIA driver; no internet):
#   benchmarks/gpu_check.sh                      # builds .venv-gpu from the repo's pins, then runs
#   WHEELS=/mnt/wheels benchmarks/gpu_check.sh   # install offline from a wheel directory
#   PIP_INDEX_URL=http://mirror/simple benchmarks/gpu_check.sh   # or from a reachable package index
#   PYTHON=/opt/venv/bin/python benchmarks/gpu_check.sh          # use a ready env (e.g. the dapo-gpu image)
#   benchmarks/gpu_check.sh --cpu                # check the script on a CPU with the dev venv (fp32, small)
#   PYTHON=python3 benchmarks/gpu_check.sh --no-vllm   # a machine without vLLM (CUDA torch, transformers,
#       DeepSpeed and the pure-Python deps only): the vLLM parts are skipped (also automatically when
#       `import vllm` fails) and the rollout engine is transformers' generate (benchmarks/gpu_check_hf.py);
#       benchmarks/gpu_check.sh --cpu --no-vllm checks that mode here
#
# What it installs: exactly the pins of the GPU image (python images/pins.py gpu) under the
# full lock images/constraints-gpu.txt (CUDA builds of torch 2.13.0, vllm 0.32.0,
# deepspeed 0.19.8, ...) and this repo with --no-deps. The CUDA wheels must be reachable:
# from a package index (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL) or a wheel directory (WHEELS),
# made on a connected machine with
#   pip download -d wheels -c images/constraints-gpu.txt -r <(python3 images/pins.py gpu)
#   pip wheel -w wheels --no-deps deepspeed==0.19.8   # DeepSpeed ships an sdist only
# Time: the install from a local wheel dir ~2-3 min; the checks ~3 min on one H100-class GPU
# (estimated: never run on a GPU when written).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/benchmarks/results/gpu_check}"
VENV="${VENV:-$REPO/.venv-gpu}"
MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then
  MODE=cpu
  shift
fi

log() { echo "[gpu_check.sh $(date +%H:%M:%S)] $*"; }

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ "$MODE" == cpu ]]; then
  PY="${DEV_PYTHON:-$REPO/.venv/bin/python}"
else
  PY="$VENV/bin/python"
  if [[ ! -f "$VENV/.installed" ]]; then
    command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this check needs an NVIDIA GPU (or --cpu)" >&2; exit 2; }
    log "building $VENV from images/pins.py gpu + images/constraints-gpu.txt"
    python3.11 -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
    if [[ -n "${WHEELS:-}" ]]; then
      PIP+=(--no-index --find-links "$WHEELS")
    fi
    requirements="$(mktemp)"
    python3 "$REPO/images/pins.py" gpu > "$requirements"
    "${PIP[@]}" -c "$REPO/images/constraints-gpu.txt" -r "$requirements"
    "${PIP[@]}" --no-deps -e "$REPO"
    rm -f "$requirements"
    touch "$VENV/.installed"
  fi
fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT"
if [[ "$MODE" == gpu ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  export DS_ACCELERATOR=cuda
  # peak memory of the whole GPU while the checks run (vLLM's KV cache included)
  (while sleep 1; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) > "$OUT/nvidia_smi_used_mib.txt" 2>/dev/null &
  SAMPLER=$!
  trap 'kill "$SAMPLER" 2>/dev/null || true' EXIT
  timeout "${CHECK_TIMEOUT:-420}" "$PY" "$REPO/benchmarks/gpu_check.py" --out "$OUT" "$@"
  peak="$(sort -n "$OUT/nvidia_smi_used_mib.txt" | tail -1)"
  log "peak GPU memory used (nvidia-smi, whole GPU): ${peak:-?} MiB"
else
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  "$PY" "$REPO/benchmarks/gpu_check.py" --cpu --out "$OUT" "$@"
fi
log "results: $OUT/gpu_check.json"
