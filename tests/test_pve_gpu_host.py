"""The node and CT sides of provisioning that read files or run commands, on fake trees.

pve_gpu_host_facts reads /sys and /dev of a fake node; pve_gpu_devices picks the devN list from it;
nvidia_userspace_facts reads libraries and asks a fake nvidia-smi inside a "CT".
"""

from __future__ import annotations

import doctest
import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from ansible.errors import AnsibleFilterError
from pve_fixtures import ROOT, load_file_module, run_module

host_facts = load_file_module("pve_gpu_host_facts", ROOT / "roles/pve_gpu_host/library/pve_gpu_host_facts.py")
userspace = load_file_module("nvidia_userspace_facts", ROOT / "roles/gpu_userspace/library/nvidia_userspace_facts.py")
pve_gpu = load_file_module("pve_gpu_filter", ROOT / "roles/pve_gpu_container/filter_plugins/pve_gpu.py")


def fake_node(root, version="570.144", gpus=(0, 1, 10), control=("nvidiactl",), bins=("nvidia-modprobe",), units=()):
    """A node tree: /sys/module/nvidia/version, /dev/nvidia*, binaries and units (regular files stand in)."""
    if version is not None:
        (root / "sys/module/nvidia").mkdir(parents=True)
        (root / "sys/module/nvidia/version").write_text(version + "\n")
    (root / "dev").mkdir(exist_ok=True)
    for name in [f"nvidia{n}" for n in gpus] + list(control) + ["null", "nvidia-modeset"]:
        (root / "dev" / name).write_text("")
    for name in bins:
        (root / "usr/bin").mkdir(parents=True, exist_ok=True)
        (root / "usr/bin" / name).write_text("#!/bin/sh\n")
    for path in units:
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text("[Unit]\n")
    return root


@pytest.mark.parametrize("module", [host_facts, userspace, pve_gpu], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    failures, tried = doctest.testmod(module)
    assert tried >= 1 and failures == 0


# ----------------------------------------------------------------- host facts


def test_facts_of_a_node_before_the_uvm_unit_ran(tmp_path, capsys):
    fake_node(tmp_path)
    result = run_module(host_facts, dict(root=str(tmp_path)), capsys)
    facts = result["ansible_facts"]
    assert result["changed"] is False
    assert facts["pve_gpu_host_driver_version"] == "570.144"
    assert facts["pve_gpu_host_gpu_devices"] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia10"]
    assert facts["pve_gpu_host_control_devices"] == ["/dev/nvidiactl"]
    assert facts["pve_gpu_host_missing_control_devices"] == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert facts["pve_gpu_host_nvidia_modprobe_path"] == "/usr/bin/nvidia-modprobe"
    assert facts["pve_gpu_host_persistenced_path"] == "" and facts["pve_gpu_host_persistenced_unit_path"] == ""


def test_facts_after_uvm_nodes_persistenced_and_mig_caps(tmp_path, capsys):
    fake_node(
        tmp_path,
        control=("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"),
        bins=("nvidia-modprobe", "nvidia-persistenced"),
        units=("/lib/systemd/system/nvidia-persistenced.service",),
    )
    (tmp_path / "dev/nvidia-caps").mkdir()
    for name in ("nvidia-cap2", "nvidia-cap1"):
        (tmp_path / "dev/nvidia-caps" / name).write_text("")
    facts = run_module(host_facts, dict(root=str(tmp_path)), capsys)["ansible_facts"]
    assert facts["pve_gpu_host_missing_control_devices"] == []
    assert facts["pve_gpu_host_cap_devices"] == [
        "/dev/nvidia-caps/nvidia-cap1",
        "/dev/nvidia-caps/nvidia-cap2",
    ]
    assert facts["pve_gpu_host_persistenced_unit_path"] == "/lib/systemd/system/nvidia-persistenced.service"


def test_rdma_nodes_are_listed_when_the_node_has_them(tmp_path, capsys):
    fake_node(tmp_path)
    assert run_module(host_facts, dict(root=str(tmp_path)), capsys)["ansible_facts"]["pve_gpu_host_rdma_devices"] == []
    (tmp_path / "dev/infiniband").mkdir()
    for name in ("uverbs1", "uverbs0", "rdma_cm", "umad0", "issm0"):
        (tmp_path / "dev/infiniband" / name).write_text("")
    facts = run_module(host_facts, dict(root=str(tmp_path)), capsys)["ansible_facts"]
    assert facts["pve_gpu_host_rdma_devices"] == [
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/rdma_cm",
    ]
    # passed through after the GPUs and control nodes, as plain devN paths
    devices = pve_gpu.pve_gpu_devices(facts["pve_gpu_host_gpu_devices"], [0], extra=facts["pve_gpu_host_rdma_devices"])
    assert [d["path"] for d in devices][-3:] == facts["pve_gpu_host_rdma_devices"]


def test_a_node_without_the_nvidia_module_fails_with_the_fix(tmp_path, capsys):
    fake_node(tmp_path, version=None)
    result = run_module(host_facts, dict(root=str(tmp_path)), capsys)
    assert result["failed"] and "sys/module/nvidia/version is missing" in result["msg"]
    assert "modprobe nvidia" in result["msg"]


def test_facts_module_reads_and_never_writes(tmp_path, capsys):
    fake_node(tmp_path)
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    run_module(host_facts, dict(root=str(tmp_path)), capsys, check_mode=True)
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_host_role_facts_and_checks_run_against_a_fake_tree(tmp_path):
    """The role's own tasks (not only its module), on localhost, with the systemd parts switched off."""
    fake_node(tmp_path, control=("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"))
    good = run_role_play(tmp_path)
    assert good.returncode == 0, good.stdout[-3000:]
    assert "driver 570.144, 3 GPU(s)" in good.stdout

    for name in ("nvidia-uvm", "nvidia-uvm-tools"):
        (tmp_path / "dev" / name).unlink()
    bad = run_role_play(tmp_path)
    assert bad.returncode != 0
    assert "missing control nodes: /dev/nvidia-uvm, /dev/nvidia-uvm-tools" in bad.stdout


def run_role_play(root):
    playbook = root / "play.yml"
    playbook.write_text(
        textwrap.dedent(
            """\
            - hosts: localhost
              gather_facts: false
              roles: [pve_gpu_host]
            """
        )
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"), ANSIBLE_FORCE_COLOR="false", ANSIBLE_NOCOLOR="1")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ansible-playbook"),
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-e",
        json.dumps(dict(pve_gpu_host_root=str(root), pve_gpu_host_uvm_unit=False, pve_gpu_host_persistenced=False)),
        str(playbook),
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


# ----------------------------------------------------------------- devN selection


NODE_GPUS = [f"/dev/nvidia{n}" for n in range(8)]


def test_all_gpus_then_the_control_nodes():
    devices = pve_gpu.pve_gpu_devices(NODE_GPUS[::-1])
    assert [d["path"] for d in devices] == [
        *NODE_GPUS,
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]


def test_a_subset_with_mode_gid_and_a_mig_extra():
    devices = pve_gpu.pve_gpu_devices(
        NODE_GPUS,
        gpus=[4, 5],
        mode="0660",
        gid="44",
        extra=[{"path": "/dev/nvidia-caps/nvidia-cap1", "mode": "0444"}],
    )
    assert devices[0] == {"path": "/dev/nvidia4", "mode": "0660", "gid": 44}
    assert [d["path"] for d in devices][1:4] == ["/dev/nvidia5", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert devices[-1] == {"path": "/dev/nvidia-caps/nvidia-cap1", "mode": "0444"}


@pytest.mark.parametrize(
    ("gpus", "words"),
    [
        ([8], "GPU 8 (/dev/nvidia8) is not on the node; it has GPUs 0, 1, 2, 3, 4, 5, 6, 7"),
        ([0, 0], "listed twice"),
        (["a"], "not a GPU number"),
        ("0,1", "'all' or a list"),
    ],
)
def test_bad_gpu_choices_are_named(gpus, words):
    with pytest.raises(AnsibleFilterError, match=words.replace("(", r"\(").replace(")", r"\)")):
        pve_gpu.pve_gpu_devices(NODE_GPUS, gpus=gpus)


# ----------------------------------------------------------------- userspace in the CT


def fake_smi(tmp_path, body):
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def fake_libs(tmp_path, *versions):
    lib = tmp_path / "lib"
    lib.mkdir(exist_ok=True)
    for name in ["libnvidia-ml.so", "libnvidia-ml.so.1"] + [f"libnvidia-ml.so.{v}" for v in versions]:
        (lib / name).write_text("")
    return [str(lib)]


def test_matching_userspace_is_reported_by_library_and_nvidia_smi(tmp_path, capsys):
    smi = fake_smi(tmp_path, "echo 570.144\necho 570.144\n")
    args = dict(nvidia_smi=smi, lib_dirs=fake_libs(tmp_path, "570.144"))
    facts = run_module(userspace, args, capsys)["ansible_facts"]
    assert facts == dict(
        gpu_userspace_installed_versions=["570.144"],
        gpu_userspace_smi_version="570.144",
        gpu_userspace_smi_error="",
    )


def test_after_a_host_upgrade_the_mismatch_is_visible(tmp_path, capsys):
    smi = fake_smi(tmp_path, "echo 'Failed to initialize NVML: Driver/library version mismatch'\nexit 18\n")
    args = dict(nvidia_smi=smi, lib_dirs=fake_libs(tmp_path, "565.57.01"))
    facts = run_module(userspace, args, capsys)["ansible_facts"]
    assert facts["gpu_userspace_installed_versions"] == ["565.57.01"]
    assert facts["gpu_userspace_smi_version"] == ""
    assert "exited 18" in facts["gpu_userspace_smi_error"] and "version mismatch" in facts["gpu_userspace_smi_error"]


def test_missing_userspace(tmp_path, capsys):
    args = dict(nvidia_smi=str(tmp_path / "absent-nvidia-smi"), lib_dirs=[str(tmp_path / "nolib")])
    facts = run_module(userspace, args, capsys)["ansible_facts"]
    assert facts["gpu_userspace_installed_versions"] == [] and "not found" in facts["gpu_userspace_smi_error"]


def test_a_hanging_nvidia_smi_is_bounded(tmp_path, capsys):
    smi = fake_smi(tmp_path, "exec sleep 120\n")
    began = time.monotonic()
    facts = run_module(userspace, dict(nvidia_smi=smi, timeout=1, lib_dirs=[]), capsys)["ansible_facts"]
    assert time.monotonic() - began < 40  # cut off at 1 s, not the 120 s the fake sleeps
    assert "timed out after 1 s" in facts["gpu_userspace_smi_error"]
