#!/usr/bin/env bash
# GPU-only checks of eagle3-pve in one run (< 9.5 minutes): real /dev/nvidia* holders released by gpu_cleanup
# with NVML back to baseline, flex_attention forward+backward, peak memory and tokens/s per max_seq_len for a
# Kimi-shaped drafter on one GPU, planner prediction vs measured, the probe and its cache, and context parallelism:
# the largest planned length at context_parallel 1 and at context_parallel = the GPUs present, run and measured;
# then, where vLLM's CUDA build is installed, the drafter's real speed-up in vLLM (bench/vllm_speedup.py).
#
#   bench/gpu_check.sh             on a CUDA machine; figures in $OUT/gpu_check.json or bench/results/
#   bench/gpu_check.sh --dry-run   anywhere: the same Python code path on CPU with a tiny drafter
#
# PYTHON=/path/to/python picks the interpreter (default: .venv-train/bin/python, else python3, with torch).
# GPU_CHECK_TIMEOUT (seconds, default 560) bounds the whole run. Exit 2: no usable GPU or Python.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for arg in "$@"; do
    [[ "$arg" == "--dry-run" ]] && dry_run=1
done

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    for candidate in .venv-train/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
            python="$candidate"
            break
        fi
    done
fi
if [[ -z "$python" ]]; then
    echo "gpu_check: no Python with torch found (tried .venv-train/bin/python, python3); set PYTHON=..." >&2
    exit 2
fi

if [[ "$dry_run" == 0 ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "gpu_check: nvidia-smi not found: no NVIDIA driver on this machine; use --dry-run for the CPU path" >&2
        exit 2
    fi
    if ! timeout 20 nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_check: nvidia-smi -L failed or hung (driver not loaded, or a GPU in a bad state)" >&2
        exit 2
    fi
    if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        version=$("$python" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "?")
        echo "gpu_check: $python has torch $version without a usable CUDA device (a CPU build?)" >&2
        exit 2
    fi
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true
fi

export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export PYTHONUNBUFFERED=1
rc=0
timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-560}" "$python" bench/gpu_check.py "$@" || rc=$?

# The real speed-up of the drafter in vLLM on this GPU (bench/vllm_speedup.py: the tiny target and a drafter trained
# on it for 100 steps, tokens/s with and without it, vLLM's acceptance beside the project's decoder). GPU only: the
# CPU path is the trainer tier's test_vllm. Needs vLLM's CUDA build in the same venv (requirements/vllm-cuda.txt);
# GPU_CHECK_VLLM_TIMEOUT (seconds, default 240; 0 skips it) bounds it. Its exit status does not change gpu_check's.
if [[ "$dry_run" == 0 && "${GPU_CHECK_VLLM_TIMEOUT:-240}" != 0 ]]; then
    if "$python" -c "import vllm" >/dev/null 2>&1; then
        echo "gpu_check: vLLM speed-up (bench/vllm_speedup.py, at most ${GPU_CHECK_VLLM_TIMEOUT:-240} s)"
        timeout --kill-after=15 "${GPU_CHECK_VLLM_TIMEOUT:-240}" "$python" bench/vllm_speedup.py || echo "gpu_check: vllm_speedup ended with status $?" >&2
    else
        echo "gpu_check: no vLLM in $python: the vLLM speed-up is not measured (pip install -r requirements/vllm-cuda.txt)" >&2
    fi
fi
exit "$rc"
