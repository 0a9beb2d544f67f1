"""`eagle3 generate` into an output folder that refuses writes, on real file systems: a tmpfs of a few hundred KiB
that fills up in the middle of a shard, and one remounted read-only. The command exits 5 (EXIT_STORAGE, which the
datagen unit never restarts on) with one line naming the folder, the errno and the error kind; the complete shards
are kept as they were, no half-written one is left, and the next run resumes after them. library/datagen_job.py
reads the line back as the job's `fault`.

Mounting needs root (CAP_SYS_ADMIN): elsewhere these tests are skipped, saying so. Every mount is undone."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from eagle3 import errors
from eagle3.data import DatasetReader
from eagle3.generate import FAULT_KILL_ENV
from eagle3.tiny_target import cached
from safetensors.torch import load_file
from test_generate import _run, conversations

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tiny_target():
    return cached(log=lambda *a, **k: None)


@contextlib.contextmanager
def tmpfs(where: Path, size: int):
    """A tmpfs of `size` bytes mounted at `where` (created), unmounted afterwards whatever happens."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full or read-only folder) needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        gc.collect()  # the test's readers (memory-mapped shards) let go of the folder first
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # detached now, freed with its last user


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def datagen_job():
    """library/datagen_job.py with the project's module_utils, as Ansible ships them to the target (this venv has no
    Ansible: its AnsibleModule, which describe() does not use, is a stand-in)."""
    stand_ins = {
        "ansible": types.ModuleType("ansible"),
        "ansible.module_utils": types.ModuleType("ansible.module_utils"),
        "ansible.module_utils.basic": types.SimpleNamespace(AnsibleModule=object),
    }
    spec = importlib.util.spec_from_file_location(
        "ansible.module_utils.train_status", ROOT / "module_utils" / "train_status.py"
    )
    stand_ins["ansible.module_utils.train_status"] = importlib.util.module_from_spec(spec)
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec.loader.exec_module(stand_ins["ansible.module_utils.train_status"])
        job_spec = importlib.util.spec_from_file_location("datagen_job", ROOT / "library" / "datagen_job.py")
        module = importlib.util.module_from_spec(job_spec)
        job_spec.loader.exec_module(module)
        return module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def the_line(stderr: str) -> str:
    """The command's own lines on stderr: exactly one, and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("eagle3 generate:")]
    assert len(lines) == 1, stderr
    return lines[0]


def failed_unit() -> dict:
    return {"LoadState": "loaded", "ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "5"}


def pages(n: int) -> int:
    return -(-n // 4096) * 4096


@pytest.mark.slow
def test_a_full_output_folder_stops_generate_once_naming_it_and_keeps_the_complete_shards(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=7)
    args = ["--target", str(tiny_target), "--data", str(data), "--max-len", "256", "--shard-samples", "2"]
    whole = _run([str(tmp_path / "whole"), *args])
    assert whole.returncode == 0, whole.stderr
    shards = sorted((tmp_path / "whole" / "shards").iterdir())
    assert len(shards) == 4
    # Room for the plan and the first two shards, and half of the third: it fills up while shard 2 is written.
    used = pages((tmp_path / "whole" / "generate_plan.json").stat().st_size) + sum(
        pages(p.stat().st_size) for p in shards[:2]
    )
    with tmpfs(tmp_path / "small", used + pages(shards[2].stat().st_size // 2)) as small:
        out = small / "ds"
        full = _run([str(out), *args])
        assert full.returncode == errors.EXIT_STORAGE == 5, full.stderr
        line = the_line(full.stderr)
        assert line == (
            f"eagle3 generate: the output folder {out} is full (ENOSPC, disk_full): free space there, then run "
            "datagen.yml (or this command) again; the 2 complete shards are kept"
        )
        # the complete shards as they were written, nothing half-written beside them
        assert sorted(p.name for p in (out / "shards").iterdir()) == [p.name for p in shards[:2]]
        for kept, reference in zip(sorted((out / "shards").iterdir()), shards[:2], strict=True):
            a, b = load_file(str(kept)), load_file(str(reference))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert not (out / "index.json").exists()

        job = datagen_job()
        result = job.describe(
            "eagle3-datagen.service",
            failed_unit(),
            str(out),
            (full.stdout + full.stderr).splitlines(),
            job.read_samples(str(out)),
        )
        assert result["fault"] == {"kind": "disk_full", "errno": "ENOSPC", "path": str(out)}
        assert result["summary"] == (
            "eagle3-datagen.service: failed, stopped by its output folder, not restarted (exit status 5): " + line
        )

        remount(small, "size=16m")  # space freed: the next run resumes after the complete shards
        resumed = _run([str(out), *args])
        assert resumed.returncode == 0, resumed.stderr
        assert "resuming: 2 of 4 shards are complete" in resumed.stdout
        a, b = DatasetReader(tmp_path / "whole"), DatasetReader(out)
        assert a.index.num_samples == b.index.num_samples == 7
        for i in range(7):
            x, y = a.sample(i), b.sample(i)
            assert all(torch.equal(x[k], y[k]) for k in x), i


@pytest.mark.slow
def test_a_read_only_output_folder_stops_generate_naming_it(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=7)
    args = ["--target", str(tiny_target), "--data", str(data), "--max-len", "256", "--shard-samples", "2"]
    with tmpfs(tmp_path / "mnt", 16 * 2**20) as mnt:
        out = mnt / "ds"
        killed = _run([str(out), *args], {FAULT_KILL_ENV: "1"})  # two complete shards, then kill -9
        assert killed.returncode == -9, killed.stderr
        remount(mnt, "ro")
        try:
            stopped = _run([str(out), *args])
        finally:
            remount(mnt, "rw")
        assert stopped.returncode == errors.EXIT_STORAGE, stopped.stderr
        line = the_line(stopped.stderr)
        assert line == (
            f"eagle3 generate: the output folder {out} is read-only (EROFS, read_only): remount it read-write, or "
            "choose another folder (eagle3_datagen_out), then run datagen.yml (or this command) again; the 2 "
            "complete shards are kept"
        )
        result = datagen_job().describe(
            "eagle3-datagen.service", failed_unit(), str(out), stopped.stderr.splitlines(), None
        )
        assert result["fault"] == {"kind": "read_only", "errno": "EROFS", "path": str(out)}


def test_the_datagen_unit_never_restarts_on_a_config_or_storage_exit():
    """What the role renders: each `'errors.NAME' | trainer_constant` of the line is the trainer's own code."""
    template = (ROOT / "roles/eagle3_datagen/templates/eagle3-datagen.service.j2").read_text()
    line = re.search(r"^RestartPreventExitStatus=(.*)$", template, re.M)
    assert line, "the datagen unit template lost RestartPreventExitStatus="
    names = re.findall(r"\{\{ 'errors\.(EXIT_[A-Z]+)' \| trainer_constant \}\}", line.group(1))
    assert re.sub(r"\{\{.*?\}\}", "", line.group(1)).strip() == ""  # nothing else on the line
    assert {getattr(errors, name) for name in names} == {errors.EXIT_CONFIG, errors.EXIT_STORAGE}
