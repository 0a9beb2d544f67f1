#!/usr/bin/env bash
# One idempotent set-up for both README commands (`make demo`, `make test`):
#   1. Debian packages: lxc (the local CT 129), mmdebstrap (its root filesystem), psmisc, iproute2.
#   2. Controller venv  .venv        on Python >= 3.12 (Ansible, molecule, proxmoxer, linters, tests).
#   3. Training venv    .venv-train  on Python 3.11   (torch 2.13.0 and the trainer's dependencies).
# A second run does no work it does not need: packages are checked with dpkg, and each venv carries a stamp
# holding the hash of its requirements file. Override the interpreters with EAGLE3_CONTROLLER_PYTHON and
# EAGLE3_TRAIN_PYTHON.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. Debian packages ----------------------------------------------------------------------------------
APT_PACKAGES=(lxc mmdebstrap psmisc iproute2 make)
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

# --- interpreter discovery -------------------------------------------------------------------------------
# find_python MIN_MINOR MAX_MINOR CANDIDATE...: print the first candidate that runs and whose version is
# 3.MIN..3.MAX. pyenv shims exist for versions that are not selected and fail when run, so every candidate
# is executed, not just looked up.
find_python() {
    local min=$1 max=$2; shift 2
    local c
    for c in "$@"; do
        [ -n "$c" ] || continue
        command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
        if "$c" -c "import sys; sys.exit(not ((3, $min) <= sys.version_info[:2] <= (3, $max)))" 2>/dev/null; then
            # A venv's python (an activated venv on PATH) is resolved to the interpreter it was made from.
            "$c" -c 'import os, sys; v = sys.version_info; print(sys.executable if sys.prefix == sys.base_prefix else os.path.join(sys.base_prefix, "bin", f"python{v[0]}.{v[1]}"))'
            return 0
        fi
    done
    return 1
}

pyenv_root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
controller_candidates=("${EAGLE3_CONTROLLER_PYTHON:-}" python3.14 python3.13 python3.12 /usr/bin/python3.13
    /usr/bin/python3.12 /usr/local/bin/python3.13 /usr/local/bin/python3.12)
for v in "$pyenv_root"/versions/3.1[2-9]*/bin/python3; do controller_candidates+=("$v"); done
controller_candidates+=(python3)
train_candidates=("${EAGLE3_TRAIN_PYTHON:-}" python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11)
for v in "$pyenv_root"/versions/3.11*/bin/python3; do train_candidates+=("$v"); done
train_candidates+=(python3)

# --- 2./3. venvs -----------------------------------------------------------------------------------------
# ensure_venv DIR PYTHON REQUIREMENTS: (re)build DIR when the interpreter or the requirements changed.
ensure_venv() {
    local dir=$1 py=$2 req=$3
    local want
    want="$(sha256sum "$req" | cut -c1-16) $("$py" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))')"
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.eagle3-stamp" 2>/dev/null)" = "$want" ]; then
        say "$dir up to date ($want)"
        return 0
    fi
    say "building $dir with $py from $req"
    [ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --disable-pip-version-check -r "$req" 2>&1 | grep -v '^WARNING: Location' || true
    "$dir/bin/python" -m pip check >/dev/null 2>&1 || say "note: pip check reports conflicts in $dir"
    # pip's exit status is hidden by the filter above: verify the pins instead.
    "$dir/bin/python" - "$req" <<'PY' || die "$dir: requirements from $req did not install (see pip output above)"
import sys, re
from importlib.metadata import version, PackageNotFoundError
bad = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    m = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;]+)", line)
    if not m:
        continue
    name, want = m.groups()
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is None or not have.startswith(want.split("+")[0]):
        bad.append(f"{name}: want {want}, have {have}")
if bad:
    print("\n".join(bad), file=sys.stderr)
    sys.exit(1)
PY
    echo "$want" > "$dir/.eagle3-stamp"
}

controller_py=$(find_python 12 99 "${controller_candidates[@]}") || die "no Python >= 3.12 found (tried PATH, /usr/bin, /usr/local/bin and pyenv). Install one (Ubuntu 24.04: apt install python3.12-venv; Debian 12: pyenv install 3.12) or set EAGLE3_CONTROLLER_PYTHON=/path/to/python3.12"
say "controller Python: $controller_py"
ensure_venv .venv "$controller_py" requirements/controller.txt

train_py=$(find_python 11 11 "${train_candidates[@]}") || die "no Python 3.11 found for the trainer (torch 2.13.0 wheel). Install one (pyenv install 3.11, or apt install python3.11-venv) or set EAGLE3_TRAIN_PYTHON=/path/to/python3.11"
say "training Python: $train_py"
ensure_venv .venv-train "$train_py" requirements/train.txt

say "done: controller $(.venv/bin/ansible --version | head -1), torch $(.venv-train/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null)"
