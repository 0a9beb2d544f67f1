"""Credentials: the PROXMOX_* environment works through the role, secrets never show, TLS is never silently off.

The role runs for real (ansible-playbook playbooks/provision_pve.yml, container play only) against fakepve; the
training env file task of eagle3_train runs as the role defines it, on this machine, into tmp_path.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pve_fixtures import ROOT, api_args, ct_spec, load_file_module, run_module, seed_template

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
PASSWORD = "Pw-Never-Shown-42"

pve_lxc = load_file_module("pve_lxc_secrets", ROOT / "library" / "pve_lxc.py")


def inventory(tmp_path, **api_vars):
    """pve1 (the fake's node) and ct129 on it, as molecule/pve has them; api_vars become pve_api_* variables."""
    inv = {
        "all": {
            "vars": {f"pve_api_{k}": v for k, v in api_vars.items()},
            "children": {
                "pve_nodes": {"hosts": {"pve1": {"ansible_connection": "local", "pve_node_name": "pve1"}}},
                "training": {
                    "hosts": {"ct129": {"pct_vmid": 129, "pct_node": "pve1"}},
                    "vars": {
                        "ansible_connection": "pct",
                        "pve_gpu_container_host_gpu_devices": ["/dev/nvidia0", "/dev/nvidia1"],
                        "pve_gpu_container_rootfs": "local-lvm:32",
                        "pve_gpu_container_hostname": "train129",
                    },
                },
            },
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def provision(inv, env=None, *extra):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PROXMOX_")},
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_FORCE_COLOR": "false",
        "ANSIBLE_NOCOLOR": "1",
        **(env or {}),
    }
    args = [str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(ROOT / "playbooks" / "provision_pve.yml")]
    args += ["--skip-tags", "pve_host,gpu_userspace", *extra]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.fixture
def pve(fakepve):
    seed_template(fakepve)
    return fakepve


# ----------------------------------------------------------------- the PROXMOX_* environment, through the role


@pytest.mark.slow
def test_the_role_leaves_the_api_to_the_proxmox_environment_when_the_variables_are_empty(pve, fakepve_cafile, tmp_path):
    env = {
        "PROXMOX_HOST": pve.host,
        "PROXMOX_PORT": str(pve.port),
        "PROXMOX_USER": "root@pam",
        "PROXMOX_PASSWORD": pve.password,
        "PROXMOX_CA_PATH": fakepve_cafile,
        "PROXMOX_TIMEOUT": "7",
    }
    proc = provision(inventory(tmp_path), env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    ct = pve.ct(129)
    assert ct is not None and ct.status == "running" and ct.config["hostname"] == "train129"


@pytest.mark.slow
def test_empty_variables_are_not_passed_but_set_ones_win_over_the_environment(pve, fakepve_cafile, tmp_path):
    # A wrong PROXMOX_PORT in the environment: the inventory's port is the one used.
    env = {"PROXMOX_HOST": "127.0.0.1", "PROXMOX_PORT": "1", "PROXMOX_PASSWORD": pve.password}
    inv = inventory(tmp_path, port=pve.port, ca_path=fakepve_cafile, user="", validate_certs="", timeout="")
    proc = provision(inv, env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert pve.ct(129).status == "running"


# ----------------------------------------------------------------- secrets never show


@pytest.mark.slow
@pytest.mark.fakepve(password=PASSWORD)
def test_the_api_password_never_shows_and_a_failure_still_says_why(pve, fakepve_cafile, tmp_path):
    inv = inventory(tmp_path, host=pve.host, port=pve.port, password=PASSWORD, ca_path=fakepve_cafile)
    ok = provision(inv, None, "-vvv", "--diff")
    assert ok.returncode == 0, ok.stdout[-4000:]
    assert PASSWORD not in ok.stdout + ok.stderr
    # A new CT from a template that is not there: the play fails, the reason is shown, the password still is not.
    bad = provision(
        inv,
        None,
        "-vvv",
        "-e",
        "pve_gpu_container_vmid=130 pve_gpu_container_template=local:vztmpl/missing.tar.zst",
    )
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "template local:vztmpl/missing.tar.zst is not on storage local" in out, out[-4000:]
    assert PASSWORD not in out


def secret_passing_tasks(node, inherited=False):
    """(name, no_log) of every task that passes an API credential, following blocks and module_defaults."""
    found = []
    for task in node or []:
        text = yaml.safe_dump(task.get("module_defaults", {})) + yaml.safe_dump(
            {k: v for k, v in task.items() if k not in ("block", "rescue", "always")}
        )
        passes = inherited or any(k in text for k in ("api_password", "api_token_secret", "api_otp"))
        if "block" in task:
            found += [(task.get("name"), task.get("no_log"))] if passes else []
        elif passes:
            found.append((task.get("name"), task.get("no_log")))
    return found


def test_every_role_task_that_passes_credentials_has_no_log():
    tasks = yaml.safe_load((ROOT / "roles/pve_gpu_container/tasks/main.yml").read_text())
    found = secret_passing_tasks(tasks)
    assert found, "the role passes the API credentials somewhere"
    assert all(no_log not in (None, False) for _, no_log in found), found


# ----------------------------------------------------------------- the training env file


@pytest.mark.slow
def test_the_training_env_file_is_0600_and_its_content_never_shows_in_diff(tmp_path):
    """The role's own task (from deploy.yml), run on this machine with a token in eagle3_train_env."""
    deploy = yaml.safe_load((ROOT / "roles/eagle3_train/tasks/deploy.yml").read_text())
    (task,) = [t for t in deploy if t.get("name") == "Write the environment file"]
    task["ansible.builtin.template"]["src"] = str(ROOT / "roles/eagle3_train/templates/eagle3-train.env.j2")
    token = "hf_TokenNeverShown123"
    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "vars": {
                "eagle3_train_config_dir": str(tmp_path),
                "gpu_cleanup_unit": "eagle3-train.service",
                "gpu_cleanup_marker": "EAGLE3_JOB=eagle3-train",
                "eagle3_train_prefix": "/opt/eagle3",
                "eagle3_train_env": {"HF_TOKEN": token},
                "eagle3_train__layout": {"nnodes": 1},  # nodes.yml: one node
                "eagle3_train_socket_ifname": "",
                "eagle3_train_nccl_ib_hca": "",
            },
            "tasks": [task],
        }
    ]
    playbook = tmp_path / "env.yml"
    playbook.write_text(yaml.safe_dump(play))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    args = [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", "-c", "local", str(playbook), "--diff", "-v"]
    args += ["-e", f"ansible_python_interpreter={sys.executable}"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    written = tmp_path / "eagle3-train.env"
    assert f'HF_TOKEN="{token}"' in written.read_text()  # quoted for systemd (env_file_value)
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert token not in proc.stdout + proc.stderr


# ----------------------------------------------------------------- TLS: ca_path and validate_certs


@pytest.fixture
def be_a_target(monkeypatch):
    # Once controller-side Ansible code is imported in this pytest process, module warnings go to the
    # controller's display instead of the result: be a target again (as tests/test_pve_conf.py does).
    from ansible.module_utils import _internal

    monkeypatch.setattr(_internal, "is_controller", False)


# urllib3's own InsecureRequestWarning is what validate_certs=false means; the test asks for the module's warning.
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_certificate_checks_switched_off_are_said_out_loud(pve, capsys, be_a_target):
    args = dict(api_args(pve, None, validate_certs=False), **ct_spec(state="present"))
    args.pop("ca_path")
    result = run_module(pve_lxc, args, capsys)
    assert result["created"] and not result.get("failed"), result
    assert "TLS certificate verification is off" in str(result.get("warnings")), result


def test_ca_path_is_used_even_with_validate_certs_false(pve, capsys, tmp_path, be_a_target):
    from fakepve.certs import make_cert

    other_ca, _, _ = make_cert(str(tmp_path), name="other-ca", hosts=("127.0.0.1",))
    args = dict(api_args(pve, other_ca, validate_certs=False), **ct_spec(state="present"))
    result = run_module(pve_lxc, args, capsys)
    assert result["failed"] and "TLS verification of https://127.0.0.1" in result["msg"], result
    assert pve.ct(129) is None
