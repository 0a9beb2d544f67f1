"""The run lock: target_lock (module_utils/run_lock.py) on the target, the run_lock role's controller lookup, and
the role end to end through ansible-playbook on localhost.

No two owners ever (also when contenders race to take over the same stale lock), renew and release only by the
owner, a lease that ran out is stale, a dead controller process on the same host is broken and a live one or
another host's is not, check mode leaves nothing, and a failure names the holder.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_train_control import load, run_module

from module_utils import run_lock

ROOT = Path(__file__).resolve().parents[1]
LOOKUP = ROOT / "roles" / "run_lock" / "lookup_plugins" / "run_lock_controller.py"


controller = load(LOOKUP, "run_lock_controller_lookup")


def record(owner="other-run", renewed_ago=0.0, ttl=300, **kw) -> dict:
    now = time.time()
    rec = {
        "version": 2,
        "owner": owner,
        "user": "alice",
        "host": "ctl-b",
        "pid": 4242,
        "pid_start": 1,
        "playbook": "train.yml",
        "purpose": "train.yml max_seq_len=16384",
        "since": now - renewed_ago - 60,
        "renewed": now - renewed_ago,
        "ttl": ttl,
    }
    rec.update(kw)
    return rec


def write(path: Path, rec: dict) -> None:
    path.write_text(json.dumps(rec))


def owner_of(path) -> str | None:
    rec = run_lock.read_record(str(path))
    return rec and rec["owner"]


# --- the module: take, renew, release -----------------------------------------------------------------------


def test_lock_is_taken_released_and_only_by_its_owner(tmp_path, capsys):
    lock = tmp_path / "lock"
    me = {"user": "root", "host": "ctl", "pid": 77, "pid_start": 12345, "boot_id": "b", "pidns": "pid:[1]"}
    res, rc = run_module(
        "target_lock",
        {
            "path": str(lock),
            "owner": "run-a",
            "purpose": "train.yml",
            "playbook": "train.yml",
            "controller": me,
        },
        capsys,
    )
    rec = json.loads(lock.read_text())
    assert rc == 0 and res["acquired"] and res["outcome"] == "taken"
    assert {k: rec[k] for k in me} == me and rec["owner"] == "run-a" and rec["ttl"] == 300
    assert rec["since"] == rec["renewed"] and rec["playbook"] == "train.yml"
    # Taking it again in the same run renews it.
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a"}, capsys)
    assert rc == 0 and res["outcome"] == "held" and owner_of(lock) == "run-a"
    # Another owner can neither release nor renew it...
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "state": "released"}, capsys)
    assert rc == 0 and not res["changed"] and res["holder"]["owner"] == "run-a" and lock.exists()
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "state": "renewed"}, capsys)
    assert rc == 1 and "no longer held by this run (run-b)" in res["msg"] and "run-a" in res["msg"]
    # ...the owner can; the release leaves no file behind (record and guard).
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a", "state": "released"}, capsys)
    assert rc == 0 and res["changed"] and list(tmp_path.iterdir()) == []


def test_renewal_moves_the_lease_and_may_set_a_longer_ttl(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="run-a", renewed_ago=100))
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a", "state": "renewed", "ttl": 900}, capsys)
    rec = json.loads(lock.read_text())
    assert rc == 0 and res["overdue"] == 0 and rec["ttl"] == 900 and time.time() - rec["renewed"] < 5
    # Renewed after its lease ran out (nobody took it): renewed, with a warning.
    write(lock, record(owner="run-a", renewed_ago=400, ttl=300))
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a", "state": "renewed"}, capsys)
    assert rc == 0 and res["overdue"] >= 99 and "after its lease ran out" in res["_warnings_text"]
    assert json.loads(lock.read_text())["ttl"] == 300  # kept when not given


def test_renewing_a_lock_that_is_gone_fails(tmp_path):
    with pytest.raises(run_lock.LockError, match="released or broken meanwhile"):
        run_lock.renew(str(tmp_path / "lock"), "run-a")
    assert list(tmp_path.iterdir()) == []


def test_second_run_waits_then_fails_naming_the_holder(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="alice@ctl-b:4242:abc", renewed_ago=10))
    t0 = time.monotonic()
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 1}, capsys)
    assert rc == 1 and time.monotonic() - t0 >= 1 and res["busy"] and not res["acquired"]
    msg = res["msg"]
    for part in (
        "alice@ctl-b",
        "ansible-playbook pid 4242",
        "playbook train.yml",
        "'train.yml max_seq_len=16384'",
        "since ",
        "last renewed ",
        "lease 300 s",
        "-e run_lock_break=alice@ctl-b:4242:abc",
        "Let it finish",
    ):
        assert part in msg, (part, msg)
    assert re.search(r"last renewed [^,]* \(1[0-3] s ago\)", msg), msg
    assert owner_of(lock) == "alice@ctl-b:4242:abc"


def test_busy_lock_can_be_reported_instead_of_failing(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(renewed_ago=10))
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 0, "fail_on_busy": False}, capsys)
    assert rc == 0 and res["busy"] and not res["expired"] and res["holder"]["owner"] == "other-run"


def test_second_run_gets_the_lock_when_the_first_releases_it(tmp_path, capsys):
    lock = str(tmp_path / "lock")
    run_lock.acquire_once(lock, "run-a")
    timer = threading.Timer(0.7, run_lock.release, [lock, "run-a"])
    timer.start()
    try:
        res, rc = run_module("target_lock", {"path": lock, "owner": "run-b", "wait": 10}, capsys)
    finally:
        timer.join()
    assert rc == 0 and res["outcome"] == "taken" and res["waited"] >= 0.5 and owner_of(lock) == "run-b"


# --- staleness ---------------------------------------------------------------------------------------------


def test_a_lease_not_renewed_within_its_ttl_is_taken_over_with_a_warning(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="dead-run", renewed_ago=301, ttl=300))
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 0}, capsys)
    assert rc == 0 and res["outcome"] == "stale" and res["holder"]["owner"] == "dead-run"
    assert owner_of(lock) == "run-b" and "took over the stale lock" in res["_warnings_text"]


def test_a_lease_within_its_ttl_is_not_stale_however_old_the_lock(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="long-run", renewed_ago=290, ttl=300, since=time.time() - 10_000))
    _, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 0}, capsys)
    assert rc == 1 and owner_of(lock) == "long-run"


def test_a_first_version_lock_counts_as_stale_after_1800_s(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, {"owner": "old-run", "since": time.time() - 1000, "pid": 1})
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 0}, capsys)
    assert rc == 1 and owner_of(lock) == "old-run"
    write(lock, {"owner": "old-run", "since": time.time() - 2000, "pid": 1})
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 0}, capsys)
    assert rc == 0 and res["outcome"] == "stale" and owner_of(lock) == "run-b"


def test_a_holder_the_controller_saw_alive_is_never_taken_over(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="slow-run", renewed_ago=1000, ttl=300))
    args = {"path": str(lock), "owner": "run-b", "wait": 0, "fail_on_busy": False}
    res, rc = run_module("target_lock", {**args, "live_owner": "slow-run"}, capsys)
    assert rc == 0 and res["busy"] and res["expired"] and owner_of(lock) == "slow-run"
    # take_stale=false (the role's first try) reports an expired lease instead of taking it.
    res, rc = run_module("target_lock", {**args, "take_stale": False}, capsys)
    assert rc == 0 and res["busy"] and res["expired"] and owner_of(lock) == "slow-run"


def test_break_owner_removes_only_that_exact_owner(tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="run-new", renewed_ago=1))
    args = {"path": str(lock), "owner": "run-b", "wait": 0, "fail_on_busy": False}
    res, rc = run_module("target_lock", {**args, "break_owner": "run-gone"}, capsys)
    assert rc == 0 and res["busy"] and owner_of(lock) == "run-new"
    res, rc = run_module("target_lock", {**args, "break_owner": "run-new"}, capsys)
    assert rc == 0 and res["outcome"] == "broken" and owner_of(lock) == "run-b"
    assert "broke the lock" in res["_warnings_text"]


# --- check mode --------------------------------------------------------------------------------------------


def test_check_mode_takes_renews_and_releases_nothing_and_leaves_no_file(tmp_path, capsys):
    lock = tmp_path / "sub" / "lock"
    check = {"_ansible_check_mode": True}
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a", **check}, capsys)
    assert rc == 0 and not res["acquired"] and res["outcome"] == "taken" and "a real run would take it" in res["msg"]
    assert list(tmp_path.iterdir()) == []
    for state in ("renewed", "released"):
        res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a", "state": state, **check}, capsys)
        assert rc == 0 and not res["changed"]
    assert list(tmp_path.iterdir()) == []
    # A holder is reported, not waited for, and its record is untouched.
    (tmp_path / "sub").mkdir()
    write(lock, record(owner="run-x", renewed_ago=5))
    before = lock.read_text()
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-a", "wait": 30, **check}, capsys)
    assert rc == 0 and res["busy"] and "held by alice@ctl-b" in res["msg"] and res["waited"] < 5
    res, rc = run_module("target_lock", {"path": str(lock), "owner": "run-x", "state": "released", **check}, capsys)
    assert rc == 0 and lock.read_text() == before and sorted(p.name for p in lock.parent.iterdir()) == ["lock"]


# --- races: no two owners, ever ------------------------------------------------------------------------------


def race(path: str, contenders: int, rounds: int, slow_read: float = 0.0, guard=None) -> list[list[str]]:
    """Each round: a stale lock, then `contenders` threads released at once to take it over. The winners per round.

    slow_read widens the window between reading the record and replacing it (as a busy machine would).
    """
    winners_per_round = []
    real_read = run_lock.read_record

    def slow(p):
        rec = real_read(p)
        time.sleep(slow_read)
        return rec

    patches = contextlib.ExitStack()
    if slow_read:
        patches.enter_context(_patched(run_lock, "read_record", slow))
    if guard is not None:
        patches.enter_context(_patched(run_lock, "guarded", guard))
    with patches:
        for _ in range(rounds):
            run_lock.write_record(path, record(owner="dead", renewed_ago=1000))
            barrier = threading.Barrier(contenders)
            results: dict[str, str] = {}

            def contend(name, barrier=barrier, results=results):
                barrier.wait()
                results[name] = run_lock.acquire_once(path, name, ttl=60)[0]

            threads = [threading.Thread(target=contend, args=(f"c{i}",)) for i in range(contenders)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            winners = sorted(n for n, outcome in results.items() if outcome != "busy")
            assert len(results) == contenders
            winners_per_round.append(winners)
            if len(winners) == 1:
                assert owner_of(path) == winners[0]
    return winners_per_round


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@pytest.mark.slow
def test_contenders_racing_for_a_stale_lock_get_exactly_one_owner(tmp_path):
    path = str(tmp_path / "lock")
    for winners in race(path, contenders=4, rounds=150):
        assert len(winners) == 1, winners
    for winners in race(path, contenders=3, rounds=10, slow_read=0.02):
        assert len(winners) == 1, winners


def test_the_race_test_sees_two_owners_without_the_flock(tmp_path):
    """The control: the same race with the guard removed (the old unlink + create) crowns several owners."""
    rounds = race(str(tmp_path / "lock"), contenders=3, rounds=5, slow_read=0.02, guard=contextlib.nullcontext)
    assert any(len(winners) > 1 for winners in rounds)


def _contend_in_process(path: str, name: str, start_at: float, queue) -> None:
    time.sleep(max(start_at - time.time(), 0))
    queue.put((name, run_lock.acquire_once(path, name, ttl=60)[0]))


@pytest.mark.slow
def test_processes_racing_for_a_stale_lock_get_exactly_one_owner(tmp_path):
    path = str(tmp_path / "lock")
    ctx = multiprocessing.get_context("fork")
    for _ in range(15):
        run_lock.write_record(path, record(owner="dead", renewed_ago=1000))
        queue = ctx.Queue()
        start_at = time.time() + 0.3
        procs = [ctx.Process(target=_contend_in_process, args=(path, f"p{i}", start_at, queue)) for i in range(3)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        winners = [n for n, outcome in results.items() if outcome != "busy"]
        assert len(winners) == 1 and owner_of(path) == winners[0], results


def test_a_release_racing_contenders_never_leaves_two_owners(tmp_path):
    """The releaser unlinks the guard under its flock; a contender that locked the old guard retries on the new one."""
    path = str(tmp_path / "lock")
    for i in range(60):
        run_lock.acquire_once(path, f"a{i}")
        barrier = threading.Barrier(3)
        out = {}

        def take(name, i=i, barrier=barrier, out=out):
            barrier.wait()
            while True:  # until it is taken, by this contender or another one
                outcome, holder = run_lock.acquire_once(path, name)
                if outcome != "busy" or holder["owner"] != f"a{i}":
                    out[name] = outcome
                    return

        def rel(i=i, barrier=barrier, out=out):
            barrier.wait()
            out["released"] = run_lock.release(path, f"a{i}")[0]

        threads = [
            threading.Thread(target=take, args=(f"b{i}",)),
            threading.Thread(target=take, args=(f"c{i}",)),
        ]
        threads.append(threading.Thread(target=rel))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [n for n in (f"b{i}", f"c{i}") if out[n] == "taken"]
        assert out["released"] and len(winners) == 1 and owner_of(path) == winners[0], out
        assert run_lock.release(path, winners[0])[0]
    assert list(tmp_path.iterdir()) == []


# --- the controller: this run's ansible-playbook, and whether a holder's run is gone ----------------------------


def fake_proc(root: Path, pid: int, ppid: int, argv: list[str], start: int = 100, state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    fields = [state, str(ppid), *["0"] * 17, str(start), "0"]
    (d / "stat").write_text(f"{pid} (a (b) c) " + " ".join(fields) + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_the_run_is_the_topmost_process_sharing_the_workers_command_line(tmp_path):
    """A worker (forked, same command line) -> its ansible-playbook; a nested ansible-playbook is its own run."""
    outer = ["/venv/bin/python", "/venv/bin/ansible-playbook", "-i", "inv", "verify.yml"]
    inner = ["/venv/bin/python", "/venv/bin/ansible-playbook", "-i", "inv", "train.yml"]
    fake_proc(tmp_path, 10, 1, ["bash"])
    fake_proc(tmp_path, 20, 10, outer)  # the user's ansible-playbook
    fake_proc(tmp_path, 21, 20, outer)  # its worker
    fake_proc(tmp_path, 30, 21, ["/usr/bin/python3", "AnsiballZ_command.py"])  # a task's module
    fake_proc(tmp_path, 40, 30, inner)  # a nested ansible-playbook run by that task
    fake_proc(tmp_path, 41, 40, inner)  # its worker
    assert controller.playbook_process(21, proc=str(tmp_path)) == 20
    assert controller.playbook_process(20, proc=str(tmp_path)) == 20
    assert controller.playbook_process(41, proc=str(tmp_path)) == 40
    assert controller.playbooks_in([*inner, "-e", "x.yml", "--check"]) == "train.yml"


def _report_playbook_process(queue) -> None:
    queue.put((os.getpid(), controller.playbook_process()))


def test_a_forked_worker_names_its_parent_as_the_run():
    """Ansible's workers are forked from ansible-playbook: a lookup evaluated in one names the parent."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_report_playbook_process, args=(queue,))
    child.start()
    child_pid, found = queue.get(timeout=30)
    child.join(30)
    assert child_pid != os.getpid() and found == controller.playbook_process()


def test_identity_names_user_host_pid_and_start(tmp_path):
    me = controller.identity()
    st = controller.proc_stat(me["pid"])
    assert me["host"] == socket.gethostname() and me["user"] == controller.user_name()
    assert me["pid_start"] == st["start"] and me["boot_id"] and me["pidns"].startswith("pid:")
    assert me["token"].startswith(f"{me['user']}@{me['host']}:{me['pid']}:")
    assert controller.identity()["token"] != me["token"]
    assert abs(me["started"] - time.time()) < 7 * 24 * 3600


def holder_for(pid: int, **kw) -> dict:
    me = controller.identity()
    st = controller.proc_stat(pid)
    rec = record(pid=pid, pid_start=st["start"] if st else 1, host=me["host"], user=me["user"])
    rec.update(boot_id=me["boot_id"], pidns=me["pidns"])
    rec.update(kw)
    return rec


@pytest.fixture
def sleeper():
    """A process this test starts (and reaps)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_a_dead_controller_process_on_this_host_is_gone_and_its_lock_is_broken(tmp_path, sleeper, capsys):
    holder = holder_for(sleeper.pid, owner="dead-run")
    assert controller.holder_gone(holder) == {
        "gone": False,
        "alive": True,
        "reason": f"its ansible-playbook (pid {sleeper.pid} on {holder['host']}) is running",
    }
    sleeper.kill()
    sleeper.wait(30)
    verdict = controller.holder_gone(holder)
    assert verdict["gone"] and not verdict["alive"] and "is gone" in verdict["reason"]
    # What acquire.yml then does: break exactly that owner (its lease has not run out).
    lock = tmp_path / "lock"
    write(lock, holder)
    res, rc = run_module(
        "target_lock",
        {"path": str(lock), "owner": "run-b", "wait": 0, "break_owner": holder["owner"]},
        capsys,
    )
    assert rc == 0 and res["outcome"] == "broken" and owner_of(lock) == "run-b"


def test_a_live_controller_process_is_not_gone_and_is_waited_for(tmp_path, sleeper, capsys):
    holder = holder_for(sleeper.pid, owner="live-run", renewed_ago=1000)  # even past its lease
    verdict = controller.holder_gone(holder)
    assert verdict["alive"] and not verdict["gone"]
    lock = tmp_path / "lock"
    write(lock, holder)
    res, rc = run_module(
        "target_lock", {"path": str(lock), "owner": "run-b", "wait": 0, "live_owner": "live-run"}, capsys
    )
    assert rc == 1 and owner_of(lock) == "live-run" and f"ansible-playbook pid {sleeper.pid}" in res["msg"]


def test_a_reused_pid_or_a_zombie_is_gone(sleeper):
    assert controller.holder_gone(holder_for(sleeper.pid, pid_start=1))["gone"]  # another process's start time
    zombie = subprocess.Popen(["true"])
    try:
        holder = holder_for(zombie.pid)
        for _ in range(500):
            st = controller.proc_stat(zombie.pid)
            if st and st["state"] == "Z":
                break
            time.sleep(0.01)
        assert controller.holder_gone(holder)["gone"]
    finally:
        zombie.wait(30)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"host": "ctl-other"}, "another controller"),
        ({"boot_id": "another-boot"}, "another boot"),
        ({"pidns": "pid:[1]"}, "another pid namespace"),
        ({"pid": None}, "names no controller process"),
    ],
)
def test_a_holder_elsewhere_is_neither_gone_nor_alive_only_its_lease_decides(tmp_path, capsys, change, why):
    dead = subprocess.Popen(["true"])
    dead.wait(30)  # a pid that is gone here: still not grounds to break another controller's lock
    holder = holder_for(dead.pid)
    holder.update(change)
    verdict = controller.holder_gone(holder)
    assert not verdict["gone"] and not verdict["alive"] and why in verdict["reason"], verdict
    lock = tmp_path / "lock"
    write(lock, holder)
    _, rc = run_module("target_lock", {"path": str(lock), "owner": "run-b", "wait": 0}, capsys)
    assert rc == 1 and owner_of(lock) == "other-run"


# --- train_health renews the lease while it waits -------------------------------------------------------------


def test_train_health_renews_the_lease_at_each_poll_and_fails_when_it_is_lost(fake_systemd, tmp_path, capsys):
    lock = tmp_path / "lock"
    write(lock, record(owner="run-a", renewed_ago=200, ttl=300))
    args = {
        "run_dir": str(tmp_path),
        "timeout": 60,
        "poll_for": 0.2,
        "lock_path": str(lock),
        "lock_owner": "run-a",
    }
    res, rc = run_module("train_health", {**args, "_ansible_check_mode": True}, capsys)
    assert rc == 0 and time.time() - json.loads(lock.read_text())["renewed"] >= 199  # check mode renews nothing
    res, rc = run_module("train_health", args, capsys)
    rec = json.loads(lock.read_text())
    assert rc == 0 and res["verdict"] == "waiting" and time.time() - rec["renewed"] < 5 and rec["ttl"] == 300
    write(lock, record(owner="run-x", renewed_ago=1))
    res, rc = run_module("train_health", args, capsys)
    assert rc == 1 and res["verdict"] == "lock_lost" and "now held by alice@ctl-b" in res["msg"]


# --- the role end to end: ansible-playbook on localhost ------------------------------------------------------

PLAY = """
- name: Work under the run lock
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Under the lock
      block:
        - name: Take the lock
          ansible.builtin.include_role:
            name: run_lock
            tasks_from: acquire
          vars:
            run_lock_purpose: e2e test
        - name: Renew it for a step
          ansible.builtin.include_role:
            name: run_lock
            tasks_from: renew
          vars:
            run_lock_renew_for: 60
        - name: Hold it
          ansible.builtin.command: sleep {{ hold | default(0) }}
          changed_when: false
      always:
        - name: Release the lock
          ansible.builtin.include_role:
            name: run_lock
            tasks_from: release
"""


@pytest.fixture
def playbook(tmp_path):
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "hosts").write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    lock = tmp_path / "locks" / "eagle3.lock"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
        ANSIBLE_LIBRARY=str(ROOT / "library"),
        ANSIBLE_MODULE_UTILS=str(ROOT / "module_utils"),
        ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default",
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
        ANSIBLE_REMOTE_TEMP=str(tmp_path / "ansible-tmp"),
        ANSIBLE_NOCOLOR="1",
    )
    cmd = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(tmp_path / "hosts"),
        str(tmp_path / "play.yml"),
        "-e",
        f"run_lock_path={lock}",
    ]

    def run(*args, background=False, **kw):
        if background:
            out = open(tmp_path / "background.out", "w")  # noqa: SIM115 - closed by the test
            return subprocess.Popen(
                [*cmd, *args], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            ), out
        return subprocess.run([*cmd, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    return run, lock


@pytest.mark.slow
def test_role_end_to_end_a_killed_run_is_broken_by_the_next_one(playbook):
    run, lock = playbook
    first, out = run("-e", "hold=300", background=True)
    try:
        deadline = time.time() + 120
        # Wait until it holds the lock and renewed it for its step (ttl 300 + run_lock_renew_for 60).
        while (run_lock.read_record(str(lock)) or {}).get("ttl") != 360 and first.poll() is None:
            assert time.time() < deadline, Path(out.name).read_text()
            time.sleep(0.2)
        rec = run_lock.read_record(str(lock))
        # The record names the ansible-playbook process this test started, with its start time.
        assert rec and rec["pid"] == first.pid, (rec, (Path(out.name)).read_text())
        assert rec["pid_start"] == controller.proc_stat(first.pid)["start"] and rec["host"] == socket.gethostname()
        assert rec["purpose"] == "e2e test" and rec["playbook"] == "play.yml" and rec["renewed"] > rec["since"]

        # A second run waits for the live one, then fails naming it.
        second = run("-e", "run_lock_wait=1")
        assert second.returncode != 0
        assert f"ansible-playbook pid {first.pid}" in second.stdout and "e2e test" in second.stdout
        assert "is running" in second.stdout and run_lock.read_record(str(lock))["owner"] == rec["owner"]

        # Ctrl-C: the first run dies without releasing its lock...
        os.killpg(first.pid, signal.SIGINT)
        first.wait(60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
        out.close()
    assert run_lock.read_record(str(lock))["owner"] == rec["owner"]

    # ...and the next run from this controller breaks it at once (its lease has not run out), then releases.
    third = run()
    assert third.returncode == 0, third.stdout[-3000:]
    assert "(broken)" in third.stdout and f"pid {first.pid} on {rec['host']}) is gone" in third.stdout
    assert list(lock.parent.iterdir()) == []


@pytest.mark.slow
def test_role_end_to_end_check_mode_and_another_controllers_lock(playbook):
    run, lock = playbook
    check = run("--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert "a real run would take it" in check.stdout and not lock.parent.exists()

    # Another controller's live lease is not broken: the run waits, then fails naming it.
    lock.parent.mkdir()
    write(lock, record(owner="bob@ctl-b:77:x", user="bob", host="ctl-b", pid=77, boot_id="b", pidns="pid:[1]"))
    check = run("--check")
    assert check.returncode == 0 and "held by bob@ctl-b (ansible-playbook pid 77)" in check.stdout
    assert "A real run would wait up to 30 s for it" in check.stdout
    real = run("-e", "run_lock_wait=1")
    assert real.returncode != 0 and "bob@ctl-b (ansible-playbook pid 77)" in real.stdout
    assert "another controller" in real.stdout and run_lock.read_record(str(lock))["owner"] == "bob@ctl-b:77:x"
    # Told to break it (the message names how), it does.
    broken = run("-e", "run_lock_break=bob@ctl-b:77:x")
    assert broken.returncode == 0 and list(lock.parent.iterdir()) == []


# --- a lock path that names somebody else's file -----------------------------------------------------------
# -e run_lock_path=/root/victim.txt once took the user's two-day-old file over as "stale, record unreadable",
# wrote the lock's JSON into it and deleted it on release. Only a lock record of this project is ever taken over.
FOREIGN = {
    "a user's text file": b"my notes\n",
    "an empty file": b"",
    "JSON of another program": b'{"hostname": "ct129", "since": 1}',
    "a JSON list": b"[1, 2]",
    "binary data": bytes(range(256)),
}


@pytest.mark.parametrize("content", FOREIGN.values(), ids=FOREIGN.keys())
def test_a_file_that_is_not_a_lock_record_is_refused_and_left_untouched(tmp_path, capsys, content):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(content)
    old = time.time() - 2 * 86400
    os.utime(victim, (old, old))
    for state in ("acquired", "renewed", "released", "query"):
        res, rc = run_module("target_lock", {"path": str(victim), "owner": "run-b", "state": state}, capsys)
        assert rc == 1 and "not a lock record of eagle3-pve" in res["msg"] and "untouched" in res["msg"], state
        assert victim.read_bytes() == content and victim.stat().st_mtime == pytest.approx(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]  # no guard was left beside it


def test_a_lock_path_that_is_a_folder_a_link_or_a_busy_guard_is_refused(tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    (tmp_path / "target").write_text(json.dumps(record(owner="dead-run", renewed_ago=10_000)))
    guarded = tmp_path / "lock"
    (tmp_path / "lock.guard").write_text("somebody's data")
    for path in (folder, link, guarded):
        res, rc = run_module("target_lock", {"path": str(path), "owner": "run-b", "wait": 0}, capsys)
        assert rc == 1 and "not a lock record of eagle3-pve" in res["msg"], path
    assert (folder / "keep").read_text() == "x" and link.is_symlink()
    assert owner_of(tmp_path / "target") == "dead-run" and not guarded.exists()
    assert (tmp_path / "lock.guard").read_text() == "somebody's data"
    # check mode refuses as well (it would otherwise promise a take-over a real run refuses)
    res, rc = run_module("target_lock", {"path": str(link), "owner": "run-b", "_ansible_check_mode": True}, capsys)
    assert rc == 1 and "untouched" in res["msg"]
