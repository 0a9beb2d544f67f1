"""The pct connection: command construction, quoting that survives a remote shell, and real round trips.

The round trips run the plugin against a `pct` stand-in that executes the command locally, so each string
travels exactly the path it would take on a node: argv -> (ssh: one shell-quoted line -> sh) -> sh -c.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ansible.errors import AnsibleError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "connection"))

import pct  # noqa: E402

NASTY = [
    "plain",
    "two words",
    "it's",
    'say "hi"',
    "$HOME and ${PATH} and $(id -u) and `id`",
    "line one\nline two",
    "semi; colon && and || or | pipe > redirect",
    "back\\slash",
    "*glob?[x]",
    "",
]


def test_pct_exec_argv_puts_vmid_and_separator():
    assert pct.pct_exec_argv("pct", 129, ["/bin/sh", "-c", "true"]) == [
        "pct",
        "exec",
        "129",
        "--",
        "/bin/sh",
        "-c",
        "true",
    ]


def test_pct_command_may_carry_arguments():
    argv = pct.pct_exec_argv("/opt/bin/pct-local --lxcpath '/var/lib/my lxc'", 7, ["id"])
    assert argv == ["/opt/bin/pct-local", "--lxcpath", "/var/lib/my lxc", "exec", "7", "--", "id"]


@pytest.mark.parametrize("node", ["", "localhost", "local", "127.0.0.1"])
def test_local_node_runs_argv_unchanged(node):
    argv = ["pct", "exec", "129", "--", "echo", "a b"]
    assert pct.node_argv(node, "root", "ssh", "-o BatchMode=yes", argv) == argv


@pytest.mark.parametrize(
    ("node", "user", "named"),
    [
        ("-oProxyCommand=touch /tmp/x", "", "pct_node"),
        ("pve1", "-oProxyCommand=id", "pct_node_user"),
        ("pve1 -p 22", "root", "pct_node"),
        ("pve1", "root@evil", "pct_node_user"),
        ("-pve", "root", "pct_node"),
    ],
)
def test_a_node_or_user_that_ssh_would_read_as_an_option_is_refused_naming_it(node, user, named):
    with pytest.raises(AnsibleError, match=f"^{named}="):
        pct.node_argv(node, user, "ssh", "", ["pct", "status", "129"])


def test_remote_node_gets_one_quoted_line_that_splits_back_to_the_same_words():
    inner = ["pct", "exec", "129", "--", "/bin/sh", "-c", *NASTY]
    argv = pct.node_argv("pve1.example", "root", "ssh", "-o BatchMode=yes -p 2222", inner)
    assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "--", "root@pve1.example"]
    # The node's shell splits the single command string: it must give back the exact argv.
    assert shlex.split(argv[7]) == inner


@pytest.fixture
def fake_pct(tmp_path):
    """A `pct` that runs `exec VMID -- CMD...` on this machine and records each argv it got."""
    log = tmp_path / "calls.log"
    script = tmp_path / "pct"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, json
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        assert sys.argv[1] == "exec" and sys.argv[3] == "--", sys.argv
        os.execvp(sys.argv[4], sys.argv[4:])
        """)
    )
    script.chmod(0o755)
    return script, log


@pytest.fixture(autouse=True)
def own_home(tmp_path_factory, monkeypatch):
    """A HOME of the test's own: the ssh control socket folder (~/.ansible/cp) is created there, not in the real one."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def fake_ssh(tmp_path):
    """An `ssh` that behaves like the real client: drops options and the host, hands the line to sh -c.

    Each argv it got is logged as a JSON line in tmp_path/ssh.log."""
    script = tmp_path / "ssh"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        with open({str(tmp_path / "ssh.log")!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        args = sys.argv[1:]
        while args[0].startswith("-") and args[0] != "--":
            args = args[2:] if args[0] in ("-o", "-p", "-i", "-l") else args[1:]
        if args[:1] == ["--"]:  # the end of the options: the destination follows, whatever it looks like
            args = args[1:]
        host, rest = args[0], args[1:]
        os.execvp("/bin/sh", ["/bin/sh", "-c", " ".join(rest)])
        """)
    )
    script.chmod(0o755)
    return script


def make_connection(pct_command, node="", ssh_executable="ssh", **more_vars):
    from ansible.playbook.play_context import PlayContext
    from ansible.plugins.loader import connection_loader

    # Through the loader, as Ansible does: it registers the options from DOCUMENTATION.
    connection_loader.add_directory(str(ROOT / "plugins" / "connection"))
    conn = connection_loader.get("pct", PlayContext(), None)
    conn.set_options(
        var_options={
            "pct_vmid": 129,
            "pct_node": node,
            "pct_command": str(pct_command),
            "pct_ssh_executable": str(ssh_executable),
            **more_vars,
        }
    )
    return conn


@pytest.mark.parametrize("node", ["", "pve1"])
@pytest.mark.parametrize("text", NASTY)
def test_exec_command_round_trip(fake_pct, fake_ssh, node, text):
    script, _log = fake_pct
    conn = make_connection(script, node=node, ssh_executable=fake_ssh)
    # What Ansible sends: a shell command line; the CT's sh must see the literal text.
    rc, out, err = conn.exec_command(f"printf %s {shlex.quote(text)}")
    assert (rc, err) == (0, b"")
    assert out.decode() == text


@pytest.mark.parametrize("node", ["", "pve1"])
def test_put_and_fetch_file_through_the_channel(fake_pct, fake_ssh, tmp_path, node):
    script, log = fake_pct
    conn = make_connection(script, node=node, ssh_executable=fake_ssh)
    src = tmp_path / "in.bin"
    src.write_bytes(bytes(range(256)) * 64)
    dest = tmp_path / "dir with space" / "it's $x.bin"
    dest.parent.mkdir()
    conn.put_file(str(src), str(dest))
    assert dest.read_bytes() == src.read_bytes()
    back = tmp_path / "back.bin"
    conn.fetch_file(str(dest), str(back))
    assert back.read_bytes() == src.read_bytes()
    # Every transfer went through `pct exec 129 --`, nothing was staged on the node.
    assert all(line.startswith('["exec", "129", "--"') for line in log.read_text().splitlines())


def test_stdin_reaches_the_command(fake_pct):
    script, _ = fake_pct
    conn = make_connection(script)
    rc, out, _ = conn.exec_command("cat", in_data=b"pipelined module source\n")
    assert (rc, out) == (0, b"pipelined module source\n")


def test_failing_command_keeps_its_exit_code(fake_pct):
    script, _ = fake_pct
    rc, _out, _err = make_connection(script).exec_command("exit 42")
    assert rc == 42


def test_missing_pct_binary_is_a_connection_failure(tmp_path):
    from ansible.errors import AnsibleConnectionFailure

    conn = make_connection(tmp_path / "no-such-pct")
    with pytest.raises(AnsibleConnectionFailure, match="cannot run"):
        conn.exec_command("true")


def test_pct_local_rejects_non_integer_vmid():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "pct-local"), "exec", "12x", "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, "PCT_LOCAL_LXCPATH": "/nonexistent"},
    )
    assert proc.returncode == 2
    assert "vmid must be an integer" in proc.stderr


@pytest.mark.parametrize(("pipelining", "max_calls"), [(None, 1), ("false", None)])
def test_a_module_task_is_one_pct_exec_when_pipelining(fake_pct, tmp_path, pipelining, max_calls):
    """A real ansible run through the plugin: pipelined by default (one exec per task), several execs without."""
    script, log = fake_pct
    argv = [
        str(Path(sys.executable).parent / "ansible"),
        "all",
        "-i",
        "ct129,",
        "-c",
        "pct",
        "-m",
        "ansible.builtin.ping",
        "-e",
        "pct_vmid=129",
        "-e",
        f"pct_command={script}",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
    ]
    if pipelining is not None:
        argv += ["-e", f"ansible_pipelining={pipelining}"]
    env = {
        **os.environ,
        "ANSIBLE_CONNECTION_PLUGINS": str(ROOT / "plugins" / "connection"),
        "ANSIBLE_REMOTE_TMP": str(tmp_path / "remote-tmp"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "local-tmp"),
    }
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")
    env["ANSIBLE_CONFIG"] = str(tmp_path / "ansible.cfg")
    env.pop("ANSIBLE_PIPELINING", None)
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert '"ping": "pong"' in run.stdout
    calls = log.read_text().splitlines()
    if max_calls is not None:
        assert len(calls) == max_calls, calls
    else:
        assert len(calls) >= 3, calls  # mkdir the remote tmp, copy the module, run it (and clean up)


def run_ansible(tmp_path, *args, env_extra=None):
    """`ansible all -i ct129, -c pct ARGS...` with the project's connection plugin and nothing else configured."""
    argv = [str(Path(sys.executable).parent / "ansible"), "all", "-i", "ct129,", "-c", "pct", *args]
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")
    env = {
        **os.environ,
        "ANSIBLE_CONNECTION_PLUGINS": str(ROOT / "plugins" / "connection"),
        "ANSIBLE_REMOTE_TMP": str(tmp_path / "remote-tmp"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "local-tmp"),
        "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"),
        **(env_extra or {}),
    }
    env.pop("ANSIBLE_PIPELINING", None)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


# --- ssh: a shared connection per node, a bounded connect, and ssh's own failure as UNREACHABLE ---------------


def ssh_calls(tmp_path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "ssh.log").read_text().splitlines()]


def test_ssh_gets_a_control_path_and_a_connect_timeout_by_default(fake_pct, fake_ssh, tmp_path, own_home):
    script, _ = fake_pct
    conn = make_connection(script, node="pve1", ssh_executable=fake_ssh)
    assert conn.exec_command("true")[0] == 0
    (argv,) = ssh_calls(tmp_path)
    folder = own_home / ".ansible" / "cp"
    timeout = conn.get_option("ssh_connect_timeout")
    assert timeout > 0
    # After the user's ssh_args (ssh keeps the first value of an option, so the user's own settings win).
    assert argv[:6] == ["-o", "BatchMode=yes", "-o", "ControlMaster=auto", "-o", "ControlPersist=60s"]
    socket = folder / pct.control_socket_name("root", "pve1", conn.get_option("ssh_args"))
    assert argv[6:10] == ["-o", f"ControlPath={socket}", "-o", f"ConnectTimeout={timeout}"]
    assert argv[10:12] == ["--", "root@pve1"]
    # ssh does not create the socket's folder; the plugin does, private to the user.
    assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700
    # Short even under this long test HOME: ssh adds 17 characters while it creates it, a socket path has < 108.
    assert len(f"{socket}.XXXXXXXXXXXXXXXX") < 108, socket
    # One socket per node and user (and ssh_args).
    assert len({pct.control_socket_name(u, n, "") for u in ("root", "admin") for n in ("pve1", "pve2")}) == 4


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"pct_ssh_connect_timeout": 3}, ["-o", "ControlPath={cp}/{socket}", "-o", "ConnectTimeout=3"]),
        ({"pct_ssh_connect_timeout": 0, "pct_ssh_control_path": "none"}, []),
        (
            {"pct_ssh_control_path": "/run/cp/%h", "pct_ssh_connect_timeout": 5},
            ["-o", "ControlPath=/run/cp/%h", "-o", "ConnectTimeout=5"],
        ),
        (
            {"pct_ssh_control_path_dir": "{tmp}/sockets", "pct_ssh_connect_timeout": 5},
            ["-o", "ControlPath={tmp}/sockets/{socket}", "-o", "ConnectTimeout=5"],
        ),
    ],
)
def test_ssh_control_path_and_timeout_are_options(fake_pct, fake_ssh, tmp_path, own_home, extra, expected):
    script, _ = fake_pct
    fill = {
        "cp": str(own_home / ".ansible" / "cp"),
        "tmp": str(tmp_path),
        "socket": pct.control_socket_name("root", "pve1", "-o BatchMode=yes"),
    }
    extra = {k: v.format(**fill) if isinstance(v, str) else v for k, v in extra.items()}
    conn = make_connection(script, node="pve1", ssh_executable=fake_ssh, pct_ssh_args="-o BatchMode=yes", **extra)
    assert conn.exec_command("true")[0] == 0
    (argv,) = ssh_calls(tmp_path)
    assert argv[2:-3] == [part.format(**fill) for part in expected]


@pytest.fixture
def dead_ssh(tmp_path):
    """An `ssh` whose node does not answer: ssh's own failure, exit code 255."""
    script = tmp_path / "dead-ssh"
    script.write_text("#!/bin/sh\necho 'ssh: connect to host pve1 port 22: Connection timed out' >&2\nexit 255\n")
    script.chmod(0o755)
    return script


def test_ssh_failure_is_a_connection_failure_for_every_operation(fake_pct, dead_ssh, tmp_path):
    from ansible.errors import AnsibleConnectionFailure

    script, _ = fake_pct
    conn = make_connection(script, node="pve1", ssh_executable=dead_ssh)
    src = tmp_path / "src"
    src.write_text("x")
    for call in (
        lambda: conn.exec_command("true"),
        lambda: conn.put_file(str(src), "/tmp/x"),
        lambda: conn.fetch_file("/etc/hostname", str(tmp_path / "back")),
    ):
        with pytest.raises(AnsibleConnectionFailure, match=r"ssh to root@pve1 failed \(exit 255\).*timed out"):
            call()


def test_exit_255_is_an_ordinary_result_on_a_local_node(fake_pct):
    script, _ = fake_pct
    rc, _out, _err = make_connection(script).exec_command("exit 255")
    assert rc == 255


def test_unreachable_node_is_reported_unreachable_by_ansible(fake_pct, dead_ssh, tmp_path):
    script, _ = fake_pct
    run = run_ansible(
        tmp_path,
        "-m",
        "ansible.builtin.ping",
        "-e",
        "pct_vmid=129",
        "-e",
        "pct_node=pve1",
        "-e",
        f"pct_ssh_executable={dead_ssh}",
        "-e",
        f"pct_command={script}",
    )
    assert run.returncode == 4, run.stdout + run.stderr  # 4: a host was unreachable
    assert "UNREACHABLE!" in run.stdout and "Connection timed out" in run.stdout, run.stdout


# --- files: streamed in, fetched atomically -------------------------------------------------------------------


def test_put_file_leaves_the_controller_file_alone(tmp_path):
    """lxc-attach (pct exec) fchmods its standard streams: handed the source file itself as stdin, it would make
    the controller's file mode 0700 (seen with the role's own module_utils files). A stand-in does the same."""
    script = tmp_path / "pct"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import os, stat, sys
        if stat.S_ISREG(os.fstat(0).st_mode):
            os.fchmod(0, 0o700)  # what lxc-attach does to a regular file on its stdin
        os.execvp(sys.argv[4], sys.argv[4:])
        """)
    )
    script.chmod(0o755)
    conn = make_connection(script)
    src = tmp_path / "gpu_guard.py"
    src.write_bytes(b"print('guard')\n" * 1000)
    src.chmod(0o644)
    dest = tmp_path / "copy.py"
    conn.put_file(str(src), str(dest))
    assert dest.read_bytes() == src.read_bytes()
    assert oct(src.stat().st_mode & 0o7777) == "0o644"


@pytest.mark.slow
def test_put_file_streams_a_file_larger_than_the_memory_cap(fake_pct, tmp_path):
    """A 1 GiB file is put by a process whose address space may grow by only 256 MiB: nothing reads it whole."""
    script, log = fake_pct
    big = tmp_path / "NVIDIA-Linux.run"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    child = textwrap.dedent(f"""\
        import resource, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_pct_connection import make_connection
        conn = make_connection({str(script)!r})
        conn._connect()
        with open("/proc/self/status") as f:
            vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, ((vm_kib << 10) + (256 << 20), resource.RLIM_INFINITY))
        try:
            bytearray(512 << 20)
        except MemoryError:
            pass
        else:
            sys.exit("the memory cap does not hold")
        conn.put_file({str(big)!r}, "/dev/null")
        print("put", flush=True)
        """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and run.stdout == "put\n", run.stdout + run.stderr
    assert json.loads(log.read_text().splitlines()[-1])[2:] == ["--", "/bin/sh", "-c", "cat > /dev/null"]


@pytest.mark.parametrize("node", ["", "pve1"])
def test_failed_fetch_leaves_no_partial_file(fake_pct, fake_ssh, tmp_path, node):
    from ansible.errors import AnsibleError

    script, _ = fake_pct
    conn = make_connection(script, node=node, ssh_executable=fake_ssh)
    dest_dir = tmp_path / "fetched"
    dest_dir.mkdir()
    # cat fails in the CT: a new destination must not appear, an existing one must not be truncated.
    with pytest.raises(AnsibleError, match="failed to read"):
        conn.fetch_file("/nonexistent/half", str(dest_dir / "new.log"))
    (dest_dir / "old.log").write_text("the previous fetch\n")
    with pytest.raises(AnsibleError, match="failed to read"):
        conn.fetch_file("/nonexistent/half", str(dest_dir / "old.log"))
    # No destination created, the earlier one untouched, no temporary file left behind.
    assert sorted(p.name for p in dest_dir.iterdir()) == ["old.log"]
    assert (dest_dir / "old.log").read_text() == "the previous fetch\n"


def test_fetch_replaces_the_destination_in_one_step(fake_pct, tmp_path):
    script, _ = fake_pct
    conn = make_connection(script)
    src = tmp_path / "remote.txt"
    src.write_text("new content\n")
    dest = tmp_path / "local.txt"
    dest.write_text("old content\n")
    before = dest.stat().st_ino
    os.chmod(dest, 0o600)
    conn.fetch_file(str(src), str(dest))
    assert dest.read_text() == "new content\n"
    # A new file renamed over the old one (a reader sees the old or the new content, never a mix), with the old
    # one's mode (a private file stays private).
    assert dest.stat().st_ino != before
    assert dest.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".local.txt")] == []
    fresh = tmp_path / "fresh.txt"
    conn.fetch_file(str(src), str(fresh))
    assert fresh.read_text() == "new content\n"
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- environment and users ------------------------------------------------------------------------------------


def test_local_pct_does_not_get_the_controllers_secrets(fake_pct, monkeypatch):
    """Real pct exec keeps its environment: a local pct must not be handed the controller's whole one."""
    script, _ = fake_pct
    monkeypatch.setenv("PROXMOX_TOKEN_SECRET", "s3cret-token")
    monkeypatch.setenv("VAULT_PASSWORD", "s3cret-vault")
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    rc, out, _ = make_connection(script).exec_command("env")
    assert rc == 0
    env = dict(line.split("=", 1) for line in out.decode().splitlines() if "=" in line)
    assert "s3cret" not in out.decode()
    assert env["LC_TIME"] == "C.UTF-8" and env["PATH"] == os.environ["PATH"] and env["HOME"] == os.environ["HOME"]


@pytest.fixture
def fake_lxc(tmp_path, monkeypatch):
    """lxc-info (the CT is running) and an lxc-attach that prints its argv and environment as JSON, on PATH."""
    bindir = tmp_path / "lxcbin"
    bindir.mkdir()
    (bindir / "lxc-info").write_text("#!/bin/sh\necho RUNNING\n")
    (bindir / "lxc-attach").write_text(
        f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps([sys.argv[1:], dict(os.environ)]))\n"
    )
    for f in bindir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")


def pct_local(*args, env=None):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "pct-local"), "--lxcpath", "/l", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=30,
    )
    return proc


@pytest.mark.parametrize(
    ("options", "attach_flag"),
    [
        ([], "--keep-env"),
        (["--keep-env", "1"], "--keep-env"),
        (["--keep-env", "0"], "--clear-env"),
        (["--keep-env", "false"], "--clear-env"),
    ],
)
def test_pct_local_exec_handles_the_environment_as_pct_exec_does(fake_lxc, options, attach_flag):
    """pve-container's `pct exec`: --keep-env (default 1) -> lxc-attach --keep-env, 0 -> --clear-env; it drops
    SSL_CERT_FILE and SSL_CERT_DIR and sets nothing itself."""
    env = {"FROM_CALLER": "kept", "SSL_CERT_FILE": "/x.pem", "SSL_CERT_DIR": "/x"}
    proc = pct_local("exec", "129", *options, "--", "sh", "-c", "echo $HOME", env=env)
    assert proc.returncode == 0, proc.stderr
    argv, seen = json.loads(proc.stdout)
    assert argv == ["-P", "/l", "-n", "129", attach_flag, "--", "sh", "-c", "echo $HOME"]
    assert seen["FROM_CALLER"] == "kept"  # lxc-attach itself applies --clear-env inside the CT
    assert "SSL_CERT_FILE" not in seen and "SSL_CERT_DIR" not in seen
    assert not {"--set-var", "-v"} & set(argv)


def test_pct_local_refuses_a_bad_keep_env_and_a_command_without_separator(fake_lxc):
    bad = pct_local("exec", "129", "--keep-env", "maybe", "--", "true")
    assert bad.returncode == 2 and "not a boolean" in bad.stderr
    unseparated = pct_local("exec", "129", "true")
    assert unseparated.returncode == 2 and "after --" in unseparated.stderr


def test_become_root_runs_nothing_extra_in_the_container(fake_pct, tmp_path):
    """pct exec is root in the CT already: become (to root) adds no sudo there, and the task still works."""
    script, log = fake_pct
    run = run_ansible(
        tmp_path,
        "-m",
        "ansible.builtin.ping",
        "-b",
        "-e",
        "pct_vmid=129",
        "-e",
        f"pct_command={script}",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert '"ping": "pong"' in run.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and "sudo" not in calls[0], calls
