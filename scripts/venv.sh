# Interpreter discovery and venv (re)building for scripts/setup.sh; sourced, never run. Kept apart so the tests
# (tests/test_setup.py) can call the same functions on throw-away folders.
#
#   find_python MIN MAX CANDIDATE...   print the first candidate that runs and is Python 3.MIN..3.MAX
#   ensure_venv DIR PYTHON REQS [NODEPS...]
#                                      make DIR a working venv of PYTHON with REQS installed (and each NODEPS, a
#                                      further requirements file, with --no-deps after it), repairing any state
#                                      an earlier run can leave: no venv, a half-built one (no pip, interrupted
#                                      install), one whose interpreter was removed or is another version
# Both print progress lines prefixed with [setup]; ensure_venv stamps DIR/.eagle3-stamp only once all is in.

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

find_python() {
    local min=$1 max=$2; shift 2
    local c
    for c in "$@"; do
        [ -n "$c" ] || continue
        command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
        # pyenv shims exist for versions that are not selected and fail when run: run every candidate.
        if "$c" -c "import sys; sys.exit(not ((3, $min) <= sys.version_info[:2] <= (3, $max)))" 2>/dev/null; then
            # A venv's python (an activated venv on PATH) is resolved to the interpreter it was made from.
            "$c" -c 'import os, sys; v = sys.version_info; print(sys.executable if sys.prefix == sys.base_prefix else os.path.join(sys.base_prefix, "bin", f"python{v[0]}.{v[1]}"))'
            return 0
        fi
    done
    return 1
}

# venv_version DIR: the version of DIR's interpreter with a working pip, or nothing when either is broken.
venv_version() {
    "$1/bin/python" -c 'import sys, pip; print(".".join(map(str, sys.version_info[:3])))' 2>/dev/null
}

ensure_venv() {
    local dir=$1 py=$2 req=$3
    shift 3
    local nodeps=("$@")
    local version want have n
    version=$("$py" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))') || die "$py does not run"
    want="$(cat "$req" "${nodeps[@]}" | sha256sum | cut -c1-16) $version"
    have=$(venv_version "$dir") || have=""
    if [ "$have" = "$version" ] && [ "$(cat "$dir/.eagle3-stamp" 2>/dev/null)" = "$want" ]; then
        say "$dir up to date ($want)"
        return 0
    fi
    rm -f "$dir/.eagle3-stamp"
    if [ "$have" != "$version" ]; then
        if [ -e "$dir" ]; then
            say "rebuilding $dir: ${have:+it has Python $have, }${have:-its interpreter or pip is broken or missing, }want $version from $py"
        else
            say "building $dir with $py ($version)"
        fi
        "$py" -m venv --clear "$dir" || die "$py -m venv $dir failed (Debian/Ubuntu: apt install python3-venv for that version)"
    else
        say "updating $dir: requirements $req changed or an earlier install did not finish"
    fi
    say "installing $req into $dir (pip; torch alone is a few hundred MB the first time)"
    # One line per package as pip resolves and installs it, so a long install shows progress.
    "$dir/bin/python" -m pip install --disable-pip-version-check --progress-bar off -r "$req" 2>&1 |
        grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully|ERROR)' | sed -u 's/^/[setup]   /' || true
    for n in "${nodeps[@]}"; do
        say "installing $n into $dir (--no-deps)"
        "$dir/bin/python" -m pip install --disable-pip-version-check --progress-bar off --no-deps -r "$n" 2>&1 |
            grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully|ERROR)' | sed -u 's/^/[setup]   /' || true
    done
    # pip's exit status is lost in the pipes above: verify the pins instead.
    "$dir/bin/python" - "$req" "${nodeps[@]}" <<'PY' || die "$dir: requirements from $req ${nodeps[*]} did not install (see pip output above)"
import sys, re
from importlib.metadata import version, PackageNotFoundError
bad = []
for line in (line for path in sys.argv[1:] for line in open(path)):
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
