"""Bad input to the user's commands fails on the controller with a message naming the value and the fix,
before anything is touched. Each run points at a CT that does not exist (VMID 9998 under an empty lxcpath):
had validation let it through, the play would have failed differently (unreachable), not with the message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


@pytest.fixture
def inventory(tmp_path):
    lxcpath = tmp_path / "lxc"
    lxcpath.mkdir()
    inv = tmp_path / "hosts.yml"
    inv.write_text(f"""\
all:
  vars:
    eagle3_root: {ROOT}
    local_ct_vmid: 9998
    local_ct_lxcpath: {lxcpath}
    local_ct_rootfs_cache: {tmp_path}/rootfs
    local_ct_standin_dir: {tmp_path}/standin
  children:
    local_ct_hosts:
      hosts:
        localhost:
          ansible_connection: local
          ansible_python_interpreter: {sys.executable}
    training:
      hosts:
        ct9998:
          ansible_connection: pct
          pct_vmid: 9998
          pct_command: {ROOT}/bin/pct-local --lxcpath {lxcpath}
""")
    return inv


def run(playbook: str, inventory: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_FORCE_COLOR": "false",
        "ANSIBLE_NOCOLOR": "1",
    }
    args = [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(ROOT / playbook)]
    for e in extra:
        args += ["-e", e]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "1000",
            "max_seq_len=1000 is not a multiple of 128 (the flex_attention block size); try 896 or 1024",
        ),
        ("24000", "try 23936 or 24064"),
        ("0", 'max_seq_len=0 is neither a positive multiple of 128 nor "auto"'),
        ("-128", 'max_seq_len=-128 is neither a positive multiple of 128 nor "auto"'),
        ("big", 'max_seq_len=big is neither a positive multiple of 128 nor "auto"'),
    ],
)
def test_train_rejects_bad_max_seq_len_before_touching_the_ct(inventory, value, message):
    proc = run("train.yml", inventory, f"max_seq_len={value}")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert message in out and "Nothing was changed" in out
    assert "UNREACHABLE" not in proc.stdout  # validation stopped it; the CT was never contacted


def test_train_needs_training_hosts(tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  hosts:\n    localhost:\n      ansible_connection: local\n")
    proc = run("train.yml", inv, "max_seq_len=16384")
    assert proc.returncode == 2
    assert 'no hosts in the group "training"' in " ".join(proc.stdout.split())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("local_ct_state=gone", "local_ct_state"),
        ("local_ct_vmid=abc", "local_ct_vmid"),
    ],
)
def test_provision_rejects_bad_ct_arguments(inventory, tmp_path, extra, message):
    proc = run("provision.yml", inventory, extra)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert message in proc.stdout and "argument" in proc.stdout.lower()
    assert not any((tmp_path / "lxc").iterdir()) and not (tmp_path / "standin").exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/mmdebstrap").exists(), reason="needs root and mmdebstrap"
)
def test_provision_explains_a_rootfs_that_cannot_be_built(inventory, tmp_path):
    # Port 9 (discard) on loopback: nothing listens, so the mirror refuses at once. No traffic leaves the machine.
    proc = run("provision.yml", inventory, "local_ct_mirror=http://127.0.0.1:9/debian")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert (
        "Could not build the CT root file system" in out
        and "local_ct_mirror=http://127.0.0.1:9/debian" in out
    )
    assert "Nothing was created" in out
    assert not list(tmp_path.glob("rootfs*")) and not any((tmp_path / "lxc").iterdir())
