"""pve_lxc against fakepve: a fake PVE 9 API that validates every request against the real schema.

Each test is one story a user could tell: create CT 129 with GPUs, re-run and see nothing change,
edit a device on a running CT, try with an API token, race another editor, and so on.
"""

from __future__ import annotations

import asyncio
import socket
import time

import ansible.module_utils.pve_ct as pve_ct
import pytest
from pve_fixtures import (
    GPU_NODES,
    ROOT,
    TEMPLATE,
    api_args,
    ct_spec,
    load_file_module,
    node_clock_pve_class,
    run_module,
    seed_template,
    serve,
    totp_pve_class,
)

pve_lxc = load_file_module("pve_lxc", ROOT / "library" / "pve_lxc.py")


def writes(pve):
    """The changing requests the fake received (logins left out)."""
    return [(m, p) for m, p, _ in pve.requests if m in ("POST", "PUT", "DELETE") and not p.endswith("/access/ticket")]


def run(pve, cafile, capsys, check_mode=False, auth=None, **spec):
    args = dict(auth if auth is not None else api_args(pve, cafile))
    args.update(ct_spec(**spec))
    return run_module(pve_lxc, args, capsys, check_mode=check_mode)


@pytest.fixture
def pve(fakepve):
    seed_template(fakepve)
    return fakepve


@pytest.fixture
def running_ct(pve, fakepve_cafile, capsys):
    """CT 129 created and started by the module, as provision.yml leaves it."""
    result = run(pve, fakepve_cafile, capsys, state="started")
    assert result["changed"] and not result.get("failed"), result
    return pve.ct(129)


def dev_paths(config):
    return {k: v for k, v in config.items() if k.startswith("dev") and k[3:].isdigit()}


# ----------------------------------------------------------------- create, idempotence


def test_create_starts_ct_with_every_gpu_node_then_rerun_changes_nothing(pve, fakepve_cafile, capsys):
    first = run(pve, fakepve_cafile, capsys, state="started")
    assert first["changed"] and first["created"] and first["status"] == "running"
    ct = pve.ct(129)
    assert ct.status == "running"
    assert dev_paths(ct.config) == {f"dev{n}": path for n, path in enumerate(GPU_NODES)}
    assert ct.config["memory"] == 16384 and ct.config["features"] == "nesting=1"
    assert first["config"]["hostname"] == "train129"
    writes_after_first = len(writes(pve))

    second = run(pve, fakepve_cafile, capsys, state="started")
    assert second["changed"] is False, second
    assert second["restart_required"] is False and second["tasks"] == []
    assert len(writes(pve)) == writes_after_first, "an idempotent run must not write"


def test_present_creates_a_stopped_ct(pve, fakepve_cafile, capsys):
    result = run(pve, fakepve_cafile, capsys, state="present")
    assert result["created"] and result["status"] == "stopped"
    assert pve.ct(129).status == "stopped"


# ----------------------------------------------------------------- updates and restarts


def test_device_edit_on_running_ct_restarts_it_with_restart_auto(running_ct, pve, fakepve_cafile, capsys):
    started = running_ct.started_at
    time.sleep(0.01)
    devices = [
        "/dev/nvidia1",
        "/dev/nvidiactl",
        {"path": "/dev/nvidia-uvm", "mode": "0666"},
        "/dev/nvidia-uvm-tools",
    ]
    result = run(pve, fakepve_cafile, capsys, state="started", devices=devices, memory=32768)
    assert result["changed"] and result["restarted"] and not result["restart_required"]
    assert result["deleted"] == ["dev0"] and "dev3" in result["updated"] and "memory" in result["updated"]
    # /dev/nvidia1 keeps dev1: a re-run never renumbers devices.
    assert dev_paths(running_ct.config) == {
        "dev1": "/dev/nvidia1",
        "dev2": "/dev/nvidiactl",
        "dev3": "/dev/nvidia-uvm,mode=0666",
        "dev4": "/dev/nvidia-uvm-tools",
    }
    assert running_ct.pending == {} and running_ct.started_at > started


def test_hot_pluggable_change_does_not_restart(running_ct, pve, fakepve_cafile, capsys):
    result = run(pve, fakepve_cafile, capsys, state="started", memory=24576, cores=12)
    assert result["changed"] and not result["restarted"] and not result["restart_required"]
    assert running_ct.config["memory"] == 24576 and running_ct.config["cores"] == 12
    assert not any("/status/reboot" in p for _, p in writes(pve))


def test_restart_never_reports_pending_until_a_later_run_may_restart(running_ct, pve, fakepve_cafile, capsys):
    devices = [*GPU_NODES[:-1], {"path": "/dev/nvidia-uvm-tools", "mode": "0660"}]
    first = run(pve, fakepve_cafile, capsys, state="started", devices=devices, restart="never")
    assert first["changed"] and first["restart_required"] and not first["restarted"]
    assert first["pending"] == ["dev4"]
    assert running_ct.pending == {"dev4": "/dev/nvidia-uvm-tools,mode=0660"}

    again = run(pve, fakepve_cafile, capsys, state="started", devices=devices, restart="never")
    assert again["changed"] is False and again["restart_required"] is True

    applied = run(pve, fakepve_cafile, capsys, state="started", devices=devices)
    assert applied["changed"] and applied["restarted"] and not applied["restart_required"]
    assert running_ct.config["dev4"] == "/dev/nvidia-uvm-tools,mode=0660" and running_ct.pending == {}


def test_stopped_then_absent(running_ct, pve, fakepve_cafile, capsys):
    stopped = run(pve, fakepve_cafile, capsys, state="stopped")
    assert stopped["changed"] and stopped["status"] == "stopped" and running_ct.status == "stopped"
    assert run(pve, fakepve_cafile, capsys, state="stopped")["changed"] is False
    run(pve, fakepve_cafile, capsys, state="started")
    gone = run(pve, fakepve_cafile, capsys, state="absent")
    assert gone["changed"] and pve.ct(129) is None
    assert run(pve, fakepve_cafile, capsys, state="absent")["changed"] is False


# ----------------------------------------------------------------- check mode and diff


def test_check_mode_on_missing_ct_creates_nothing(pve, fakepve_cafile, capsys):
    result = run(pve, fakepve_cafile, capsys, check_mode=True, state="started")
    assert result["changed"] and result["created"] and result["status"] == "running"
    assert "dev0: /dev/nvidia0\n" in result["diff"]["after"] and result["diff"]["before"] == ""
    assert pve.ct(129) is None and writes(pve) == []


def test_check_mode_diff_names_the_change_and_predicts_the_restart(running_ct, pve, fakepve_cafile, capsys):
    digest = running_ct.digest()
    devices = GPU_NODES[1:]
    result = run(pve, fakepve_cafile, capsys, check_mode=True, state="started", devices=devices, memory=8192)
    assert result["changed"] and result["deleted"] == ["dev0"] and result["updated"] == ["memory"]
    assert result["diff"]["before"] == "dev0: /dev/nvidia0\nmemory: 16384\n"
    assert result["diff"]["after"] == "memory: 8192\n"
    # Removing a device from a running CT needs a restart (PVE 9 only hot-adds); restart=auto would do it.
    assert result["restarted"] and not result["restart_required"]
    assert running_ct.digest() == digest and writes(pve)[-1][1].endswith("/status/start")


def test_check_mode_with_restart_never_predicts_restart_required(running_ct, pve, fakepve_cafile, capsys):
    result = run(pve, fakepve_cafile, capsys, check_mode=True, state="started", devices=GPU_NODES[1:], restart="never")
    assert result["restart_required"] and result["pending"] == ["dev0"] and not result["restarted"]


def predicted(result):
    """What a check-mode result and a real run's result must agree on."""
    keys = ("changed", "restarted", "restart_required", "status", "pending", "updated", "deleted")
    return {k: result[k] for k in keys}


def test_check_mode_sees_pending_changes_already_on_the_ct_and_predicts_the_reboot(
    running_ct, pve, fakepve_cafile, capsys
):
    # An earlier run with restart=never (or a `pct set` by hand) left a device edit pending.
    devices = [*GPU_NODES[:-1], {"path": "/dev/nvidia-uvm-tools", "mode": "0660"}]
    run(pve, fakepve_cafile, capsys, state="started", devices=devices, restart="never")
    assert running_ct.pending == {"dev4": "/dev/nvidia-uvm-tools,mode=0660"}
    before = len(writes(pve))

    check = run(pve, fakepve_cafile, capsys, check_mode=True, state="started", devices=devices)
    assert len(writes(pve)) == before and running_ct.pending, "check mode must not change anything"
    real = run(pve, fakepve_cafile, capsys, state="started", devices=devices)
    assert real["changed"] and real["restarted"] and running_ct.pending == {}
    assert predicted(check) == predicted(real)


def test_check_mode_keeps_pending_changes_it_does_not_touch_with_restart_never(running_ct, pve, fakepve_cafile, capsys):
    devices = [*GPU_NODES[:-1], {"path": "/dev/nvidia-uvm-tools", "mode": "0660"}]
    run(pve, fakepve_cafile, capsys, state="started", devices=devices, restart="never")
    spec = dict(state="started", devices=devices, memory=24576, restart="never")
    check = run(pve, fakepve_cafile, capsys, check_mode=True, **spec)
    assert check["pending"] == ["dev4"] and check["restart_required"] and not check["restarted"]
    real = run(pve, fakepve_cafile, capsys, **spec)
    assert predicted(check) == predicted(real)


def test_check_mode_knows_that_setting_a_pending_key_back_clears_it(running_ct, pve, fakepve_cafile, capsys):
    # The pending edit of dev4 is undone by asking for the value the running CT already has: PVE drops
    # the pending entry, so nothing waits and nothing restarts.
    devices = [*GPU_NODES[:-1], {"path": "/dev/nvidia-uvm-tools", "mode": "0660"}]
    run(pve, fakepve_cafile, capsys, state="started", devices=devices, restart="never")
    check = run(pve, fakepve_cafile, capsys, check_mode=True, state="started")
    assert check["updated"] == ["dev4"] and not check["restarted"] and check["pending"] == []
    real = run(pve, fakepve_cafile, capsys, state="started")
    assert predicted(check) == predicted(real)
    assert running_ct.pending == {} and running_ct.config["dev4"] == "/dev/nvidia-uvm-tools"


# ----------------------------------------------------------------- the root@pam rule


def test_api_token_may_not_set_devices_and_the_message_names_the_ways_out(pve, fakepve_cafile, capsys):
    pve.apitokens["root@pam!ansible"] = "token-secret-value"
    pve.grant("audit@pve", "/", "VM.Audit")  # permissions on: PVE now checks every privilege
    auth = dict(
        api_host=pve.host,
        api_port=pve.port,
        api_token_id="root@pam!ansible",
        api_token_secret="token-secret-value",
        ca_path=fakepve_cafile,
    )
    result = run(pve, fakepve_cafile, capsys, auth=auth, state="started")
    assert result["failed"]
    msg = result["msg"]
    assert "root@pam!ansible" in msg and "only allowed for root@pam" in msg
    assert "api_password" in msg and "api_backend=local" in msg
    assert pve.ct(129) is None and writes(pve) == []
    assert "token-secret-value" not in capsys.readouterr().out + str(result)


def test_api_token_may_change_what_is_not_a_device(running_ct, pve, fakepve_cafile, capsys):
    pve.apitokens["root@pam!ansible"] = "s3"
    pve.grant("audit@pve", "/", "VM.Audit")
    auth = dict(
        api_host=pve.host,
        api_port=pve.port,
        api_token_id="ansible",
        api_token_secret="s3",
        ca_path=fakepve_cafile,
    )
    result = run(pve, fakepve_cafile, capsys, auth=auth, state="started", cores=16)
    assert result["changed"] and not result.get("failed"), result
    assert result["identity"] == "root@pam!ansible" and running_ct.config["cores"] == 16


def test_the_api_itself_refuses_devices_to_a_token_with_permissions_on(running_ct, pve, fakepve_cafile):
    """The fake enforces PVE's rule too, so our pre-check mirrors a real refusal, not an invented one."""
    from proxmoxer import ProxmoxAPI
    from proxmoxer.core import ResourceException

    pve.apitokens["root@pam!ansible"] = "s3"
    pve.grant("audit@pve", "/", "VM.Audit")
    api = ProxmoxAPI(
        pve.host,
        port=pve.port,
        user="root@pam",
        token_name="ansible",
        token_value="s3",
        verify_ssl=fakepve_cafile,
    )
    with pytest.raises(ResourceException, match="device passthrough is only allowed for root@pam"):
        api.nodes("pve1").lxc(129).config.put(dev9="/dev/nvidia-caps/nvidia-cap1")


def token_auth(pve, cafile, token="root@pam!ansible", secret="s3"):
    pve.apitokens[token] = secret
    return dict(api_host=pve.host, api_port=pve.port, api_token_id=token, api_token_secret=secret, ca_path=cafile)


def test_token_may_not_change_feature_flags_other_than_nesting_not_even_in_check_mode(
    running_ct, pve, fakepve_cafile, capsys
):
    auth = token_auth(pve, fakepve_cafile)
    pve.grant("audit@pve", "/", "VM.Audit")  # permissions on: PVE now checks every privilege
    before = len(writes(pve))
    for check_mode in (True, False):
        result = run(
            pve,
            fakepve_cafile,
            capsys,
            check_mode=check_mode,
            auth=auth,
            features={"nesting": True, "keyctl": True},
        )
        msg = result.get("msg", "")
        assert result.get("failed"), (check_mode, result)
        assert "root@pam!ansible may not change features" in msg, msg
        assert "changing feature flags (except nesting) is only allowed for root@pam" in msg
        assert "api_password" in msg and "api_backend=local" in msg
    assert len(writes(pve)) == before, "the refusal must come before any request that changes something"


def test_token_may_not_change_feature_flags_of_a_privileged_ct(pve, fakepve_cafile, capsys):
    pve.add_ct(129, "train129", node="pve1", status="stopped", config={"unprivileged": 0, "dev0": "/dev/nvidia0"})
    auth = token_auth(pve, fakepve_cafile)
    pve.grant("audit@pve", "/", "VM.Audit")
    result = run(pve, fakepve_cafile, capsys, check_mode=True, auth=auth, devices=None, unprivileged=None)
    assert result.get("failed") and "for privileged container is only allowed for root@pam" in result["msg"], result


def test_nesting_needs_vm_allocate_and_the_message_names_it(running_ct, pve, fakepve_cafile, capsys):
    running_ct.config["features"] = "keyctl=0,nesting=0"
    pve.users["ops@pve"] = "pw"
    auth = token_auth(pve, fakepve_cafile, token="ops@pve!ci")
    for who in ("ops@pve", "ops@pve!ci"):
        pve.grant(
            who,
            "/vms/129",
            "VM.Audit",
            "VM.Config.Options",
            "VM.Config.Memory",
            "VM.Config.CPU",
            "VM.Config.Network",
            "VM.PowerMgmt",
        )
    spec = dict(state="started", devices=None, features={"nesting": True, "keyctl": False})
    before = len(writes(pve))
    result = run(pve, fakepve_cafile, capsys, check_mode=True, auth=auth, **spec)
    assert result.get("failed"), result
    assert "ops@pve!ci lacks VM.Allocate on /vms/129 (to change features)" in result["msg"], result["msg"]
    for who in ("ops@pve", "ops@pve!ci"):
        pve.grant(who, "/vms/129", "VM.Allocate")
    done = run(pve, fakepve_cafile, capsys, auth=auth, **spec)
    assert done["changed"] and not done.get("failed"), done
    assert running_ct.config["features"] == "keyctl=0,nesting=1" and len(writes(pve)) > before


# ----------------------------------------------------------------- two-factor authentication (TOTP)


@pytest.fixture
def totp_pve(tmp_path):
    pve = totp_pve_class()(user="root@pam", password="secret", host="127.0.0.1", port=0)
    with serve(pve, tmp_path) as cafile:
        seed_template(pve)
        pve.cafile = cafile
        yield pve


def test_an_account_with_totp_and_no_code_is_told_so_without_spending_an_attempt(totp_pve, capsys):
    result = run(totp_pve, totp_pve.cafile, capsys, state="started")
    assert result["failed"] and "this account needs a TOTP code" in result["msg"], result
    assert "api_otp" in result["msg"] and "secret" not in result["msg"]
    assert totp_pve.second_factor_attempts == [], "a guessed (empty) code counts towards PVE's TOTP lockout"
    assert totp_pve.ct(129) is None


def test_api_otp_completes_the_login(totp_pve, capsys):
    auth = api_args(totp_pve, totp_pve.cafile, api_otp="123456")
    result = run(totp_pve, totp_pve.cafile, capsys, auth=auth, state="started")
    assert result["created"] and not result.get("failed"), result
    assert totp_pve.ct(129).status == "running" and "123456" not in str(result)


def test_a_wrong_totp_code_is_named_as_such(totp_pve, capsys):
    auth = api_args(totp_pve, totp_pve.cafile, api_otp="000000")
    result = run(totp_pve, totp_pve.cafile, capsys, auth=auth, state="started")
    assert result["failed"] and "TOTP code (api_otp) was refused" in result["msg"], result
    assert "000000" not in str(result)


# ----------------------------------------------------------------- concurrency, locks, failing tasks


def test_stale_digest_is_re_read_and_retried_once(running_ct, pve, fakepve_cafile, capsys, monkeypatch):
    original = pve_ct.CtRun.read_config
    races = []

    def racing_read(self):
        config = original(self)
        if not races:  # another admin edits the CT between our read and our write, once
            races.append(1)
            running_ct.config["description"] = "edited by someone else"
        return config

    monkeypatch.setattr(pve_ct.CtRun, "read_config", racing_read)
    result = run(pve, fakepve_cafile, capsys, state="started", cores=6)
    assert result["changed"] and not result.get("failed"), result
    assert running_ct.config["cores"] == 6 and running_ct.config["description"] == "edited by someone else"


def test_digest_stale_twice_fails_clearly(running_ct, pve, fakepve_cafile, capsys, monkeypatch):
    original = pve_ct.CtRun.read_config

    def always_racing(self):
        config = original(self)
        running_ct.config["description"] = f"edit {time.monotonic()}"
        return config

    monkeypatch.setattr(pve_ct.CtRun, "read_config", always_racing)
    result = run(pve, fakepve_cafile, capsys, state="started", cores=6)
    assert result["failed"] and "changed under us twice" in result["msg"] and "detected modified" in result["msg"]
    assert running_ct.config["cores"] == 8


def test_locked_ct_fails_before_any_change(running_ct, pve, fakepve_cafile, capsys):
    pve.snapshot_lock(129, "backup")
    before = len(writes(pve))
    result = run(pve, fakepve_cafile, capsys, state="started", memory=4096)
    assert result["failed"] and "CT 129 is locked (backup)" in result["msg"] and "pct unlock 129" in result["msg"]
    assert len(writes(pve)) == before and running_ct.config["memory"] == 16384


def test_config_lock_held_by_a_task_fails_with_pves_words(running_ct, pve, fakepve_cafile, capsys):
    # Another task holds the config lock; at time_scale 0 PVE's 10 s lock wait ends at once.
    asyncio.run(pve.hold_config_lock(129, None))
    result = run(pve, fakepve_cafile, capsys, state="started", memory=4096)
    assert result["failed"] and "can't lock file" in result["msg"] and "got timeout" in result["msg"]
    pve.release_config_lock(129)
    assert running_ct.config["memory"] == 16384


def test_failing_start_task_reports_the_task_log(pve, fakepve_cafile, capsys):
    pve.add_ct(129, "train129", node="pve1", status="stopped", config={"dev0": "/dev/nvidia0"})
    pve.ct(129).start_error = "lxc.hook.pre-start for container 129 failed: /dev/nvidia-uvm does not exist"
    result = run(pve, fakepve_cafile, capsys, state="started", devices=["/dev/nvidia0"], features=None, onboot=None)
    assert result["failed"]
    assert "start CT 129" in result["msg"] and "/dev/nvidia-uvm does not exist" in result["msg"]
    assert "TASK ERROR" in result["msg"]


@pytest.mark.fakepve(time_scale=0.02)
def test_slow_start_task_times_out_with_its_upid(pve, fakepve_cafile, capsys):
    pve.add_ct(129, "train129", node="pve1", status="stopped")
    pve.ct(129).start_secs = 3000  # 60 s of wall time at this time scale
    began = time.monotonic()
    result = run(pve, fakepve_cafile, capsys, state="started", devices=None, features=None, onboot=None, task_timeout=1)
    assert result["failed"] and "still running after 1s" in result["msg"] and "vzstart" in result["msg"]
    assert time.monotonic() - began < 30  # gave up after task_timeout=1, never waited the 60 s


def test_task_polls_that_fail_on_the_way_are_retried(pve, fakepve_cafile, capsys):
    pve.add_ct(129, "train129", node="pve1", status="stopped")
    pve.fail("GET", "/status", 502, "Bad Gateway (proxy: connection reset)", times=2)
    result = run(pve, fakepve_cafile, capsys, state="started", devices=None, features=None, onboot=None)
    assert result["changed"] and not result.get("failed"), result
    assert pve.ct(129).status == "running"


def test_a_task_poll_pve_refuses_is_the_modules_own_error(pve, fakepve_cafile, capsys):
    pve.add_ct(129, "train129", node="pve1", status="stopped")
    pve.fail("GET", "/status", 403, "Permission check failed (/nodes/pve1, Sys.Audit)")
    result = run(pve, fakepve_cafile, capsys, state="started", devices=None, features=None, onboot=None)
    assert result["failed"] and "exception" not in result, result
    msg = result["msg"]
    assert msg.startswith("start CT 129: polling task UPID:pve1:") and "403 Permission check failed" in msg, msg
    assert "may still be running on the node" in msg


def test_a_stalled_tasks_age_is_read_on_the_nodes_clock(tmp_path, capsys):
    pve = node_clock_pve_class()(user="root@pam", password="secret", host="127.0.0.1", port=0)
    pve.time_scale = 0.02
    with serve(pve, tmp_path) as cafile:
        pve.add_ct(129, "train129", node="pve1", status="stopped")
        pve.ct(129).start_secs = 3000  # 60 s of wall time at this time scale
        pve.node_clock_ahead = 500  # by the node's clock the task is 500 s older than by ours
        result = run(pve, cafile, capsys, state="started", devices=None, features=None, onboot=None, task_timeout=1)
    msg = result["msg"]
    assert result["failed"] and "still running after 1s" in msg, msg
    age = int(msg.split(" s since it started by the node's clock")[0].rsplit(" ", 1)[-1])
    assert 500 <= age < 560, msg


# ----------------------------------------------------------------- bad input: clear failure, nothing changed


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        (["nvidia0"], "must start with /dev/"),
        (["/dev/nvidia0", "/dev/nvidia0"], "listed twice"),
        (["/dev/../etc/shadow"], "leaves /dev/"),
        ([{"path": "/dev/nvidia0", "mode": "rw"}], "not an octal mode"),
        ([{"path": "/dev/nvidia0", "gid": "video"}], "not a numeric id"),
    ],
)
def test_bad_devices_fail_before_any_request(pve, fakepve_cafile, capsys, devices, words):
    result = run(pve, fakepve_cafile, capsys, state="started", devices=devices)
    assert result["failed"] and words in result["msg"]
    assert pve.requests == []


@pytest.mark.parametrize("vmid", [99, 1_000_000_000])
def test_vmid_out_of_range(pve, fakepve_cafile, capsys, vmid):
    result = run(pve, fakepve_cafile, capsys, vmid=vmid)
    assert result["failed"] and "out of range" in result["msg"] and "100..999999999" in result["msg"]
    assert pve.requests == []


def test_unknown_node_is_named_with_the_real_ones(pve, fakepve_cafile, capsys):
    result = run(pve, fakepve_cafile, capsys, node="pve9", state="started")
    assert result["failed"] and "'pve9' is not in this cluster; nodes: pve1" in result["msg"]
    assert writes(pve) == []


def test_wrong_password_fails_without_printing_it(pve, fakepve_cafile, capsys):
    auth = api_args(pve, fakepve_cafile, api_password="Wr0ng-Secret!")
    result = run(pve, fakepve_cafile, capsys, auth=auth, state="started")
    assert result["failed"] and "authentication failed" in result["msg"]
    assert "Wr0ng-Secret!" not in str(result)


def test_missing_template_lists_what_is_there(pve, fakepve_cafile, capsys):
    result = run(pve, fakepve_cafile, capsys, template="local:vztmpl/ubuntu-24.04-standard_24.04-2_amd64.tar.zst")
    assert result["failed"] and "is not on storage local" in result["msg"] and TEMPLATE in result["msg"]
    assert "pveam download local ubuntu-24.04" in result["msg"]
    assert pve.ct(129) is None and writes(pve) == []


def test_ct_on_another_node_or_a_vm_with_the_id(pve, fakepve_cafile, capsys):
    pve.add_node("pve2")
    pve.add_ct(129, "train129", node="pve2")
    result = run(pve, fakepve_cafile, capsys, state="started")
    assert result["failed"] and "CT 129 lives on node pve2, not pve1" in result["msg"]
    assert writes(pve) == []


def test_unreachable_api_fails_within_the_timeout(capsys):
    """A listener that accepts TCP but never answers TLS: the bounded timeout must end the wait."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        began = time.monotonic()
        args = dict(ct_spec(), api_host="127.0.0.1", api_port=port, api_password="pw-never-shown", timeout=1)
        result = run_module(pve_lxc, args, capsys)
    elapsed = time.monotonic() - began
    assert result["failed"] and "cannot reach the Proxmox API at https://127.0.0.1" in result["msg"]
    assert "within 1s" in result["msg"] and elapsed < 30  # the silent listener would hold it forever
    assert "pw-never-shown" not in str(result)


def test_no_credentials_is_a_clear_failure(capsys, monkeypatch):
    for name in ("PROXMOX_PASSWORD", "PROXMOX_TOKEN_ID", "PROXMOX_TOKEN_SECRET"):
        monkeypatch.delenv(name, raising=False)
    result = run_module(pve_lxc, dict(ct_spec(), api_host="127.0.0.1"), capsys)
    assert result["failed"] and "no credentials" in result["msg"]


def test_environment_fallbacks_reach_the_api(pve, fakepve_cafile, capsys, monkeypatch):
    monkeypatch.setenv("PROXMOX_HOST", pve.host)
    monkeypatch.setenv("PROXMOX_PORT", str(pve.port))
    monkeypatch.setenv("PROXMOX_PASSWORD", pve.password)
    monkeypatch.setenv("PROXMOX_CA_PATH", fakepve_cafile)
    result = run_module(pve_lxc, ct_spec(state="present"), capsys)
    assert result["created"] and not result.get("failed"), result
