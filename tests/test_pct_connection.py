"""The pct connection: command construction, quoting that survives a remote shell, and real round trips.

The round trips run the plugin against a `pct` stand-in that executes the command locally, so each string
travels exactly the path it would take on a node: argv -> (ssh: one shell-quoted line -> sh) -> sh -c.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


def test_remote_node_gets_one_quoted_line_that_splits_back_to_the_same_words():
    inner = ["pct", "exec", "129", "--", "/bin/sh", "-c", *NASTY]
    argv = pct.node_argv("pve1.example", "root", "ssh", "-o BatchMode=yes -p 2222", inner)
    assert argv[:6] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "root@pve1.example"]
    assert argv[6] == "--"
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


@pytest.fixture
def fake_ssh(tmp_path):
    """An `ssh` that behaves like the real client: drops options and the host, hands the line to sh -c."""
    script = tmp_path / "ssh"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        args = sys.argv[1:]
        while args[0].startswith("-"):
            args = args[2:] if args[0] in ("-o", "-p", "-i", "-l") else args[1:]
        host, rest = args[0], args[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        os.execvp("/bin/sh", ["/bin/sh", "-c", " ".join(rest)])
        """)
    )
    script.chmod(0o755)
    return script


def make_connection(pct_command, node="", ssh_executable="ssh"):
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
        str(Path(sys.executable).parent / "ansible"), "all", "-i", "ct129,", "-c", "pct", "-m", "ansible.builtin.ping",
        "-e", "pct_vmid=129", "-e", f"pct_command={script}", "-e", f"ansible_python_interpreter={sys.executable}",
    ]  # fmt: skip
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
