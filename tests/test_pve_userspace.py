"""gpu_userspace on localhost standing in for the CT: a fake .run installer and a fake nvidia-smi.

The story: the CT gets the host's driver version, a re-run changes nothing, the host's driver is
upgraded, and the next run sees the mismatch and installs the new version.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from pve_fixtures import ROOT

pytestmark = pytest.mark.slow

FAKE_RUN = textwrap.dedent(
    """\
    #!/bin/sh
    # Stand-in for NVIDIA-Linux-x86_64-VERSION.run: records its arguments, "installs" the libraries
    # and an nvidia-smi that reports VERSION, as the real installer with --no-kernel-module would.
    echo "$@" >> "{state}/installer-args"
    rm -f "{state}"/lib/libnvidia-ml.so.*
    touch "{state}/lib/libnvidia-ml.so.{version}"
    printf '#!/bin/sh\\necho {version}\\n' > "{state}/nvidia-smi"
    chmod +x "{state}/nvidia-smi"
    """
)


@pytest.fixture
def ct(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "installers").mkdir()
    return tmp_path


def installer(ct, version):
    path = ct / "installers" / f"NVIDIA-Linux-x86_64-{version}.run"
    path.write_text(FAKE_RUN.format(state=ct, version=version))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def provision(ct, host_version):
    playbook = ct / "play.yml"
    playbook.write_text("- hosts: localhost\n  gather_facts: false\n  roles: [gpu_userspace]\n")
    extra = dict(
        gpu_userspace_driver_version=host_version,
        gpu_userspace_run_path=str(ct / "installers" / f"NVIDIA-Linux-x86_64-{host_version}.run"),
        gpu_userspace_run_dest=str(ct / "staged.run"),
        gpu_userspace_nvidia_smi=str(ct / "nvidia-smi"),
        gpu_userspace_lib_dirs=[str(ct / "lib")],
        gpu_userspace_smi_timeout=5,
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"), ANSIBLE_NOCOLOR="1")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ansible-playbook"),
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        json.dumps(dict(extra, ansible_python_interpreter=sys.executable)),
        str(playbook),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    recap = proc.stdout.rsplit("PLAY RECAP", 1)[-1]
    return proc, recap


def test_install_then_nothing_then_the_host_upgrade_is_followed(ct):
    installer(ct, "570.144")
    first, recap = provision(ct, "570.144")
    assert first.returncode == 0, first.stdout[-3000:]
    assert "changed=3" in recap  # copy, install, remove the staged installer
    assert (ct / "lib/libnvidia-ml.so.570.144").exists() and not (ct / "staged.run").exists()
    assert (ct / "installer-args").read_text().split() == ["--silent", "--no-kernel-module"]
    assert "NVIDIA userspace 570.144 matches the host" in first.stdout

    again, recap = provision(ct, "570.144")
    assert again.returncode == 0 and "changed=0" in recap
    assert len((ct / "installer-args").read_text().splitlines()) == 1

    installer(ct, "575.57.08")  # the host's driver was upgraded; the CT still has 570.144
    upgraded, recap = provision(ct, "575.57.08")
    assert upgraded.returncode == 0, upgraded.stdout[-3000:]
    assert sorted(p.name for p in (ct / "lib").iterdir()) == ["libnvidia-ml.so.575.57.08"]
    assert "NVIDIA userspace 575.57.08 matches the host" in upgraded.stdout


def test_a_version_nvidia_smi_does_not_confirm_fails_with_what_it_saw(ct):
    (ct / "lib/libnvidia-ml.so.570.144").write_text("")
    smi = ct / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch'\nexit 18\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    proc, _ = provision(ct, "570.144")
    assert proc.returncode != 0
    assert "nvidia-smi in the CT reports nothing" in proc.stdout and "version mismatch" in proc.stdout


def test_no_host_version_fails_before_touching_the_ct(ct):
    proc, _ = provision(ct, "")
    assert proc.returncode != 0 and "run the host play (pve_gpu_host)" in proc.stdout
    assert not (ct / "installer-args").exists()
