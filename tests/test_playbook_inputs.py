"""Bad input to the user's commands fails on the controller with a message naming the value and the fix,
before anything is touched. Each run points at a CT that does not exist (VMID 9998 under an empty lxcpath):
had validation let it through, the play would have gone on to find the CT stopped (role ct_running), not failed with
the message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.local_inventory import local_training_inventory

pytestmark = pytest.mark.slow

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
        args += [e] if e.startswith("--") else ["-e", e]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "1000",
            "max_seq_len=1000 is not a positive multiple of 128 (the flex_attention block size); try 896 or 1024",
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
    assert "is stopped" not in proc.stdout  # validation stopped it; the CT was never asked about


# One bad value for every variable a user can set on train.yml (-e strings, as the command line gives them, and
# JSON for the structured ones), each with the line that must name the variable, the value and what is allowed.
BAD_TRAIN_INPUTS = [
    ("max_seq_len=1000", "max_seq_len=1000 is not a positive multiple of 128"),
    (
        "context_parallel=2.5",
        "context_parallel=2.5 is not a context-parallel size; allowed: auto (the memory planner picks the smallest",
    ),
    (
        "eagle3_train_allow_unplanned_seq_len=sure",
        "eagle3_train_allow_unplanned_seq_len=sure is not a boolean; allowed: true or false",
    ),
    (
        "eagle3_train_prefix=opt/eagle3",
        "eagle3_train_prefix=opt/eagle3 is not an absolute path; allowed: a folder of its own on the target",
    ),
    ("eagle3_train_config_dir=etc", "eagle3_train_config_dir=etc is not an absolute path"),
    ("eagle3_train_run_dir=run", "eagle3_train_run_dir=run is not an absolute path"),
    (
        '{"eagle3_train_state_dir": "/tmp; rm -rf /"}',
        'eagle3_train_state_dir=/tmp; rm -rf / holds characters a path here may not have (" ", ";")',
    ),
    (
        "checkpoint_every=-1",
        "checkpoint_every is not a variable of these playbooks: a trainer setting goes in",
    ),
    ("eagle3_train_data_dir=~/data", "eagle3_train_data_dir=~/data is not an absolute path"),
    (
        "eagle3_train_synth_if_missing=maybe",
        "eagle3_train_synth_if_missing=maybe is not a boolean; allowed: true or false (also yes/no, on/off, 1/0, any case)",
    ),
    (
        '{"eagle3_train_synth_args": "--num-samples 8"}',
        "eagle3_train_synth_args=--num-samples 8 is not a list; allowed: a list of one command-line argument",
    ),
    ("eagle3_train_venv=venv", "eagle3_train_venv=venv is not an absolute path"),
    ("eagle3_train_venv_provided=2", "eagle3_train_venv_provided=2 is not a boolean"),
    (
        '{"eagle3_train_python": ""}',
        'eagle3_train_python="" has the wrong form; allowed: a command name found on PATH',
    ),
    (
        "eagle3_train_nproc=0",
        "eagle3_train_nproc=0 is not a worker count; allowed: auto (one per GPU) or a whole number >= 1",
    ),
    (
        "eagle3_train_cpu_workers=two",
        "eagle3_train_cpu_workers=two is not a whole number; allowed: a whole number >= 1",
    ),
    (
        "eagle3_train_rdzv_port=70000",
        "eagle3_train_rdzv_port=70000 is out of range; allowed: a whole number >= 1 and <= 65535",
    ),
    (
        '{"eagle3_train_config": {"max_seq_len": 4096}}',
        "eagle3_train_config sets max_seq_len=4096, which the role sets itself",
    ),
    (
        "eagle3_train_config_overrides=epochs",
        "eagle3_train_config_overrides=epochs is not a mapping; allowed: a mapping",
    ),
    ('{"eagle3_train_env": ["NCCL_DEBUG=INFO"]}', 'eagle3_train_env=["NCCL_DEBUG=INFO"] is not a mapping'),
    (
        "eagle3_train_plan_memory_gb=lots",
        "eagle3_train_plan_memory_gb=lots is not a number; allowed: a number >= 0",
    ),
    (
        "eagle3_train_plan_margin=1.5",
        "eagle3_train_plan_margin=1.5 is out of range; allowed: a number >= 0 and < 1",
    ),
    ("eagle3_train_min_steps=0", "eagle3_train_min_steps=0 is out of range; allowed: a whole number >= 1"),
    (
        "eagle3_train_health_timeout=10m",
        "eagle3_train_health_timeout=10m is not a whole number; allowed: a whole number >= 1",
    ),
    ("eagle3_train_health_poll=-5", "eagle3_train_health_poll=-5 is out of range"),
    ("eagle3_train_stall_timeout=1.5", "eagle3_train_stall_timeout=1.5 is not a whole number"),
    ("eagle3_train_stop_timeout=0", "eagle3_train_stop_timeout=0 is out of range"),
    (
        "eagle3_train_restart_sec=-1",
        "eagle3_train_restart_sec=-1 is out of range; allowed: a whole number >= 0",
    ),
    (
        "eagle3_train_lock_wait=forever",
        "eagle3_train_lock_wait=forever is not a whole number; allowed: a whole number >= 0",
    ),
    (
        "eagle3_train_synth_if_mising=true",
        "eagle3_train_synth_if_mising=true is not a variable of the eagle3_train role; did you mean eagle3_train_synth_if_missing?",
    ),
]


def test_train_names_every_bad_variable_with_its_value_and_what_is_allowed(inventory):
    # All at once: one run reports every problem (a user fixes them in one go), each on its own line.
    proc = run("train.yml", inventory, *(extra for extra, _ in BAD_TRAIN_INPUTS))
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    missing = [message for _, message in BAD_TRAIN_INPUTS if message not in out]
    assert not missing, f"not reported: {missing}\n{proc.stdout[-6000:]}"
    assert "Nothing was changed" in out and "is stopped" not in proc.stdout
    assert "argument_spec" not in proc.stdout  # the role's messages, not Ansible's spec dump
    assert out.count("Nothing was changed") == 1  # said once (no [ERROR] block repeating the message)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        case
        for case in BAD_TRAIN_INPUTS
        if case[0].split("=")[0]
        in (
            "eagle3_train_synth_if_missing",
            "eagle3_train_cpu_workers",
            "eagle3_train_plan_memory_gb",
            "eagle3_train_data_dir",
            "eagle3_train_synth_if_mising",
        )
    ],
)
def test_train_rejects_one_bad_variable_before_touching_the_ct(inventory, extra, message):
    proc = run("train.yml", inventory, "max_seq_len=16384", extra)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert message in out and "Nothing was changed" in out
    assert out.count(" allowed: ") + out.count("did you mean") >= 1
    assert "is stopped" not in proc.stdout


def test_train_accepts_boolean_and_number_strings(inventory):
    # What -e gives: strings. Validation lets them through, so the play goes on to ask about the (missing) CT.
    proc = run(
        "train.yml",
        inventory,
        "max_seq_len=AUTO",
        "eagle3_train_synth_if_missing=False",
        "eagle3_train_venv_provided=YES",
        "eagle3_train_allow_unplanned_seq_len=off",
        "eagle3_train_cpu_workers=3",
        "eagle3_train_nproc=2",
        "eagle3_train_plan_memory_gb=1.6",
        "eagle3_train_plan_margin=0",
        "eagle3_train_health_timeout=60",
    )
    assert proc.returncode != 0
    assert "Invalid training input" not in proc.stdout, proc.stdout[-3000:]
    assert "CT 9998 is stopped" in proc.stdout, proc.stdout[-3000:]


@pytest.fixture
def local_target(tmp_path):
    """The training host is this machine (local connection) with every path under tmp_path; the runs use --check,
    so even a validation that let something through could not change anything here."""
    return local_training_inventory(
        tmp_path / "local.yml",
        eagle3_train_prefix=f"{tmp_path}/prefix",
        eagle3_train_config_dir=f"{tmp_path}/etc",
        eagle3_train_run_dir=f"{tmp_path}/run",
        eagle3_train_venv=f"{tmp_path}/venv",
        eagle3_train_venv_provided=False,
    )


@pytest.mark.parametrize("synth", [None, "eagle3_train_synth_if_missing=false", "eagle3_train_synth_if_missing=NO"])
def test_train_fails_on_a_data_dir_without_a_dataset(local_target, tmp_path, synth):
    data_dir = tmp_path / "dta"  # a typo of data/
    extra = [f"eagle3_train_data_dir={data_dir}"] + ([synth] if synth else [])
    proc = run("train.yml", local_target, "max_seq_len=16384", "--check", *extra)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert (
        f"eagle3_train_data_dir={data_dir} holds no dataset on ct-local (the directory does not exist); "
        "allowed: a directory with a dataset" in out
    ), proc.stdout[-3000:]
    assert "-e eagle3_train_synth_if_missing=true" in out and "Nothing was changed" in out
    assert "validate.yml" in proc.stdout  # it stopped in the validation, before the lock
    assert not data_dir.exists() and not (tmp_path / "prefix").exists()


def test_train_says_when_the_directory_exists_but_holds_no_dataset(local_target, tmp_path):
    (tmp_path / "data").mkdir()
    proc = run("train.yml", local_target, "max_seq_len=16384", "--check", f"eagle3_train_data_dir={tmp_path}/data")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert (
        f"eagle3_train_data_dir={tmp_path}/data holds no dataset on ct-local (the directory has no index.json)" in out
    )


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


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/mmdebstrap").exists(), reason="needs root and mmdebstrap")
def test_provision_explains_a_rootfs_that_cannot_be_built(inventory, tmp_path):
    # Port 9 (discard) on loopback: nothing listens, so the mirror refuses at once. No traffic leaves the machine.
    proc = run("provision.yml", inventory, "local_ct_mirror=http://127.0.0.1:9/debian")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "Could not build the CT root file system" in out and "local_ct_mirror=http://127.0.0.1:9/debian" in out
    assert "Nothing was created" in out
    assert not list(tmp_path.glob("rootfs*")) and not any((tmp_path / "lxc").iterdir())
