"""Values that are well-formed but point at the wrong thing are refused (or stay inert) and nothing is lost.

The hostile-input tests (test_role_inputs.py) refuse values of the wrong form. These are of the right form and once
destroyed data: a sweep glob that deleted a user's tree, a lock path that overwrote and then deleted a user's file
(test_run_lock.py), a config folder that re-moded /etc, a unit name that would have overwritten and stopped journald,
and an environment entry that hid the workers from the clean-up. Each row of the table below is refused by the
role's input check before anything is touched; then the same values against the code that would act on them (the
modules on a real file system, real processes, a unit file), and one real cleanup.yml / train.yml run each.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
from test_role_inputs import grammar, inventory, ri, run  # noqa: F401 (inventory: a fixture)
from test_train_control import run_module

from module_utils import job_files, owned

# variable -> well-formed values that name the wrong thing
TABLE = {
    "gpu_cleanup_sweep": [
        ["/srv/userdata/*"],
        ["/*"],
        ["/etc/*"],
        ["/tmp/*"],
        ["/dev/shm/*"],
        ["/dev/shm/a*"],
        ["/dev/shm/nccl-*/x"],
        ["/home/alice/torch_*"],
        ["/var/tmp/../etc/*"],
    ],
    "eagle3_train_config_dir": ["/", "/etc", "/usr", "/var/lib", "/root", "/etc/systemd/system", "/usr/lib/x"],
    "eagle3_train_run_dir": ["/var", "/home", "/tmp", "/proc/1"],
    "eagle3_train_prefix": ["/opt", "/usr/local", "/bin"],
    "eagle3_train_state_dir": ["/run", "/var/log"],
    "eagle3_train_data_dir": ["/srv", "/dev/shm"],
    "eagle3_train_venv": ["/usr", "/usr/share/python"],
    "eagle3_datagen_out": ["/var/lib", "/etc/eagle3/../ssl"],
    "eagle3_evaluate_prefix": ["/opt"],
    "eagle3_serve_export_dir": ["/var/lib", "/etc"],
    "eagle3_serve_venv": ["/usr"],
    "local_ct_lxcpath": ["/var/lib/lxc"],
    "eagle3_train_env": [
        {"EAGLE3_JOB": "decoy"},
        {"EAGLE3_STATUS_FILE": "/x"},
        {"PYTHONPATH": "/tmp"},
        {"RANK": "0"},
        {"TORCHELASTIC_RUN_ID": "x"},
        {"GLOO_SOCKET_IFNAME": "eth0"},
    ],
}
ROLE_OF = {name: next(r for r, table in ri.ROLE_VARIABLES.items() if name in table) for name in TABLE}


@pytest.mark.parametrize(
    ("name", "value"), [(n, v) for n, values in TABLE.items() for v in values], ids=lambda v: json.dumps(v)
)
def test_a_well_formed_value_that_names_the_wrong_thing_is_refused_naming_the_variable(name, value):
    errors = ri.role_input_errors({name: value}, ROLE_OF[name])
    assert errors and errors[0].startswith(name), errors
    assert "allowed:" in errors[0]


def test_the_defaults_and_the_project_s_own_places_stay_allowed():
    ok = {
        "gpu_cleanup_sweep": [
            ["/dev/shm/nccl-*", "/dev/shm/torch_*", "/tmp/torchelastic_*"],
            ["/var/tmp/cuda-*"],
        ],
        "eagle3_train_config_dir": ["/etc/eagle3", "/srv/eagle3/etc"],
        "eagle3_train_prefix": ["/opt/eagle3", "/usr/local/eagle3"],
        "eagle3_train_run_dir": ["/var/lib/eagle3/run", "/mnt/shared/run", "/tmp/pytest-of-root/x"],
        "eagle3_train_env": [{"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "HF_TOKEN": "x"}],
    }
    for name, values in ok.items():
        for value in values:
            assert ri.role_input_errors({name: value}, ROLE_OF.get(name, "eagle3_train")) == [], (name, value)


# ------------------------------------------------------------------------------------------------ the sweep
def test_a_refused_sweep_glob_deletes_nothing_even_when_the_module_is_called_directly(tmp_path, capsys):
    tree = tmp_path / "userdata"
    (tree / "project").mkdir(parents=True)
    (tree / "project" / "notes.txt").write_text("two years of work")
    for glob in (f"{tree}/*", "/*", "/etc/*", "/tmp/*"):
        res, rc = run_module("gpu_cleanup", {"sweep": [glob], "devices": [f"{tmp_path}/none*"]}, capsys)
        assert rc == 1 and f"sweep glob {glob} " in res["msg"] and "nothing was touched" in res["msg"]
    assert (tree / "project" / "notes.txt").read_text() == "two years of work"


def test_a_directory_tree_the_job_did_not_create_is_kept_and_named(leftovers, tmp_path, capsys):
    # /tmp/torch_* is an allowed glob; a user's folder /tmp/torch_<token>-cache matches it but is not torchrun's.
    cache = leftovers.shm("torch", "cache")
    cache.mkdir()
    (cache / "weights.bin").write_bytes(b"\0" * 1024)
    segment = leftovers.shm("torch", "segment")
    segment.write_bytes(b"\0" * 1024)
    logs = leftovers.tmp("dead0run")
    (logs / "attempt_0").mkdir(parents=True)
    args = {"sweep": leftovers.globs, "devices": [f"{tmp_path}/none*"], "respawn_window": 0}
    check, rc = run_module("gpu_cleanup", {**args, "_ansible_check_mode": True}, capsys)
    assert rc == 0 and check["removed"] == [str(segment), str(logs)]  # check mode lists every path
    assert segment.exists() and logs.exists()
    out, rc = run_module("gpu_cleanup", args, capsys)
    assert rc == 0 and out["removed"] == [str(segment), str(logs)]
    assert out["sweep_kept"] == [f"{cache}: {job_files.tree_problem(str(cache))}"]
    assert (cache / "weights.bin").exists() and not segment.exists() and not logs.exists()


def test_a_torchrun_folder_with_a_mount_point_in_it_is_kept(leftovers):
    logs = leftovers.tmp("mounted")
    (logs / "m").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(logs / "m")], check=True)
    try:
        (logs / "m" / "data").write_text("another file system")
        free, busy, kept = job_files.candidates([str(leftovers.tmp("*"))], set())
        assert free == busy == [] and kept == [f"{logs}: a mount point lies in it"]
    finally:
        subprocess.run(["umount", str(logs / "m")], check=True)


# ------------------------------------------------------------------------------------------- folders and units
def test_an_existing_folder_of_something_else_is_refused_and_untouched(tmp_path, capsys):
    ssh = tmp_path / "etc-ssh"
    ssh.mkdir(mode=0o755)
    (ssh / "sshd_config").write_text("PermitRootLogin no\n")
    ours = tmp_path / "eagle3"
    ours.mkdir()
    (ours / "train.yaml").write_text("{}")
    dirs = [
        {"var": "eagle3_train_config_dir", "path": str(ssh), "marks": ["train.yaml", "eagle3-train.env"]},
        {"var": "eagle3_train_run_dir", "path": str(ours), "marks": ["train.yaml"]},
        {"var": "eagle3_train_state_dir", "path": str(tmp_path / "new"), "marks": ["status.json"]},
        {"var": "eagle3_train_prefix", "path": "/usr", "marks": ["src"]},
    ]
    res, rc = run_module("owned_paths", {"dirs": dirs}, capsys)
    assert rc == 1 and [p.split(" ", 1)[0] for p in res["problems"]] == [
        f"eagle3_train_config_dir={ssh}",
        "eagle3_train_prefix=/usr",
    ]
    assert "sshd_config" in res["problems"][0] and "Nothing was changed" in res["msg"]
    assert stat.S_IMODE(ssh.stat().st_mode) == 0o755 and not (tmp_path / "new").exists()


@pytest.fixture
def systemctl_showing(tmp_path, monkeypatch):
    """A systemctl on PATH that reports a unit file of the test's choosing and logs every call."""

    def install(unit_text: str | None) -> tuple:
        unit = tmp_path / "unit.service"
        props = "LoadState=not-found\nFragmentPath=\n"
        if unit_text is not None:
            unit.write_text(unit_text)
            props = f"LoadState=loaded\nFragmentPath={unit}\nActiveState=active\n"
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        log = tmp_path / "calls"
        (bindir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\nprintf "{props}"\n')
        (bindir / "systemctl").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
        return unit, log

    return install


JOURNALD = "[Unit]\nDescription=Journal Service\n[Service]\nExecStart=/lib/systemd/systemd-journald\n"


def test_another_program_s_unit_is_never_written_started_or_stopped(systemctl_showing, tmp_path, capsys):
    unit, log = systemctl_showing(JOURNALD)
    res, rc = run_module("owned_paths", {"units": [{"var": "gpu_cleanup_unit", "unit": "x.service"}]}, capsys)
    assert rc == 1 and res["problems"][0].startswith("gpu_cleanup_unit=x.service is a unit eagle3-pve did not write")
    # the cleanup module, called directly with that unit, refuses before any stop (in check mode too)
    (tmp_path / "run-systemd").mkdir()
    for check in (False, True):
        out, rc = run_module(
            "gpu_cleanup",
            {"unit": "x.service", "devices": [f"{tmp_path}/none*"], "_ansible_check_mode": check},
            capsys,
        )
        assert rc == 1 and "did not write" in out["msg"] and "nothing was stopped" in out["msg"]
    assert "stop" not in log.read_text() and unit.read_text() == JOURNALD


@pytest.mark.parametrize(
    ("text", "ours"),
    [
        ("# Ansible managed\n# eagle3-pve: roles/eagle3_train writes this unit\n[Unit]\n", True),
        (
            "# Ansible managed\n[Unit]\nDescription=EAGLE-3 drafter training (2 workers, max_seq_len 16384)\n",
            True,
        ),
        (None, True),  # not installed: the role writes it
        ("# Ansible managed\n[Unit]\nDescription=Something else\n", False),
    ],
)
def test_a_unit_is_the_project_s_only_when_its_file_says_so(systemctl_showing, text, ours):
    systemctl_showing(text)
    assert (owned.unit_problem("eagle3-train.service") is None) is ours


def test_the_unit_templates_carry_the_mark():
    for template in (
        "roles/eagle3_train/templates/eagle3-train.service.j2",
        "roles/eagle3_datagen/templates/eagle3-datagen.service.j2",
        "roles/eagle3_serve/templates/eagle3-serve.service.j2",
    ):
        head = (ri.ROOT / template).read_text().splitlines()[:5]
        assert any(line.startswith(owned.UNIT_MARK) for line in head), template


# ------------------------------------------------------------------------------------------- the playbooks
@pytest.mark.slow
def test_cleanup_and_train_refuse_the_table_before_touching_anything(inventory, tmp_path):  # noqa: F811
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    for playbook, values in (
        ("cleanup.yml", {"gpu_cleanup_sweep": [f"{victim}/*"], "gpu_cleanup_unit": "ok.service"}),
        (
            "train.yml",
            {
                "eagle3_train_config_dir": "/etc",
                "eagle3_train_env": {"EAGLE3_JOB": "decoy"},
                "gpu_cleanup_sweep": ["/*"],
            },
        ),
    ):
        proc = run(playbook, inventory, values)
        out = proc.stdout
        assert proc.returncode == 2 and "Nothing was changed" in out, out[-3000:]
        for name in values:
            if name != "gpu_cleanup_unit":
                assert f"{name}" in out, (name, out[-3000:])
    assert (victim / "keep").read_text() == "x"
    assert grammar.KINDS["sweep_glob"](f"{victim}/*", {})
