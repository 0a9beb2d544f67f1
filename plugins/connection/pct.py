# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run tasks inside a Proxmox VE container with ``pct exec``, on the container's node.

Every command becomes ``pct exec <vmid> -- /bin/sh -c <cmd>``. When the node is the controller itself the
argv runs locally; otherwise it runs over ssh on the node, as one shell-quoted command line. Files travel
through the same channel (``cat`` on stdin/stdout), so no temporary copy on the node is needed.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: pct
short_description: Run tasks inside a Proxmox VE container through C(pct exec) on its node
description:
  - Runs every command as C(pct exec <vmid> -- /bin/sh -c <cmd>) on the Proxmox VE node that hosts the
    container, over ssh, or locally when the node is the controller.
  - Transfers files through the same channel, so nothing is staged on the node.
  - C(pct exec) wraps C(lxc-attach); the project's C(bin/pct-local) stand-in maps it onto a local LXC
    container so the same plugin drives the embedded default CT.
author: eagle3-pve contributors
version_added: "0.1.0"
options:
  vmid:
    description: The container's VMID.
    type: int
    vars:
      - name: pct_vmid
      - name: ansible_pct_vmid
    required: true
  node:
    description:
      - Host name or address of the Proxmox VE node that runs the container.
      - Empty, C(localhost) or C(local) runs C(pct) on the controller itself.
    type: str
    default: ''
    vars:
      - name: pct_node
      - name: ansible_pct_node
  node_user:
    description: The ssh user on the node (C(pct) needs root).
    type: str
    default: root
    vars:
      - name: pct_node_user
  ssh_executable:
    description: The ssh client used to reach the node.
    type: str
    default: ssh
    vars:
      - name: pct_ssh_executable
  ssh_args:
    description: Extra arguments for ssh (a string, split like a shell would).
    type: str
    default: '-o BatchMode=yes -o ControlMaster=auto -o ControlPersist=60s'
    vars:
      - name: pct_ssh_args
  pct_command:
    description:
      - The C(pct) command on the node, with any leading arguments (a string, split like a shell would).
      - The embedded default sets it to the project's C(bin/pct-local --lxcpath DIR).
    type: str
    default: pct
    vars:
      - name: pct_command
  pipelining:
    description:
      - Send each module to the container on stdin and run it there in one C(pct exec), instead of creating a
        temporary folder, copying the module into it, running it and removing it (four or five C(pct exec)s).
      - Every C(pct exec) starts an C(lxc-attach); on a busy node pipelining makes a play several times faster.
    type: bool
    default: true
    env:
      - name: ANSIBLE_PIPELINING
    ini:
      - section: connection
        key: pipelining
    vars:
      - name: ansible_pipelining
  command_timeout:
    description:
      - Seconds to wait for one command before giving up (0 waits forever, as ssh does for a running command).
      - Long tasks (training health waits, cleanups) are bounded by their own timeouts.
    type: int
    default: 0
    vars:
      - name: pct_command_timeout
"""

import os
import shlex
import subprocess

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

display = Display()

LOCAL_NODES = ("", "localhost", "local", "127.0.0.1", "::1")


def pct_exec_argv(pct_command: str, vmid: int, argv: list[str]) -> list[str]:
    """The argv that runs ``argv`` inside the container.

    >>> pct_exec_argv("pct", 129, ["/bin/sh", "-c", "echo $HOME"])
    ['pct', 'exec', '129', '--', '/bin/sh', '-c', 'echo $HOME']
    """
    return [*shlex.split(pct_command), "exec", str(int(vmid)), "--", *argv]


def node_argv(node: str, user: str, ssh_executable: str, ssh_args: str, argv: list[str]) -> list[str]:
    """Wrap ``argv`` so that it runs on the node: unchanged when local, one quoted command line over ssh.

    ssh hands the remote shell a single string, so the argv is joined with POSIX quoting and the node's
    shell splits it back into exactly the same words (spaces, quotes, ``$`` and newlines included).

    >>> node_argv("pve1", "root", "ssh", "-o BatchMode=yes", ["pct", "exec", "129", "--", "echo", "a b"])
    ['ssh', '-o', 'BatchMode=yes', 'root@pve1', '--', "pct exec 129 -- echo 'a b'"]
    """
    if node in LOCAL_NODES:
        return list(argv)
    target = f"{user}@{node}" if user else node
    return [ssh_executable, *shlex.split(ssh_args), target, "--", shlex.join(argv)]


class Connection(ConnectionBase):
    """Tasks inside a Proxmox VE container, through ``pct exec`` on its node."""

    transport = "pct"
    has_pipelining = True
    # The container is a separate root file system: the remote tmp dir lives inside it.
    default_user = "root"

    def _connect(self):
        if not self._connected:
            display.vvv(
                f"PCT: vmid {self.get_option('vmid')} on node {self.get_option('node') or 'localhost'}",
                host=self._play_context.remote_addr,
            )
            self._connected = True
        return self

    def _argv(self, inner: list[str]) -> list[str]:
        return node_argv(
            self.get_option("node") or "",
            self.get_option("node_user"),
            self.get_option("ssh_executable"),
            self.get_option("ssh_args"),
            pct_exec_argv(self.get_option("pct_command"), self.get_option("vmid"), inner),
        )

    def _run(self, inner: list[str], in_data: bytes | None = None, stdout=subprocess.PIPE):
        argv = self._argv(inner)
        display.vvvv(f"PCT EXEC {argv!r}", host=self._play_context.remote_addr)
        timeout = self.get_option("command_timeout") or None
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE)
        except OSError as e:
            raise AnsibleConnectionFailure(f"pct: cannot run {argv[0]!r}: {e}") from e
        try:
            out, err = proc.communicate(in_data, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.communicate()
            raise AnsibleConnectionFailure(
                f"pct: command timed out after {timeout}s: {shlex.join(inner)}"
            ) from e
        return proc.returncode, out or b"", err or b""

    def exec_command(self, cmd, in_data=None, sudoable=True):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        rc, out, err = self._run(["/bin/sh", "-c", to_text(cmd, errors="surrogate_or_strict")], in_data)
        if rc == 255 and self.get_option("node") not in LOCAL_NODES:
            display.vvv(f"PCT: ssh to the node failed: {to_text(err)}")
        return rc, out, err

    def put_file(self, in_path, out_path):
        super().put_file(in_path, out_path)
        display.vvv(f"PUT {in_path} TO {out_path}", host=self._play_context.remote_addr)
        if not os.path.exists(to_bytes(in_path, errors="surrogate_or_strict")):
            raise AnsibleFileNotFound(f"file or module does not exist: {in_path}")
        with open(to_bytes(in_path, errors="surrogate_or_strict"), "rb") as f:
            data = f.read()
        rc, _out, err = self._run(["/bin/sh", "-c", f"cat > {shlex.quote(out_path)}"], data)
        if rc != 0:
            raise AnsibleError(
                f"pct: failed to write {out_path} in CT {self.get_option('vmid')}: {to_text(err)}"
            )

    def fetch_file(self, in_path, out_path):
        super().fetch_file(in_path, out_path)
        display.vvv(f"FETCH {in_path} TO {out_path}", host=self._play_context.remote_addr)
        with open(to_bytes(out_path, errors="surrogate_or_strict"), "wb") as f:
            rc, _out, err = self._run(["cat", "--", in_path], None, stdout=f)
        if rc != 0:
            raise AnsibleError(
                f"pct: failed to read {in_path} in CT {self.get_option('vmid')}: {to_text(err)}"
            )

    def close(self):
        self._connected = False
