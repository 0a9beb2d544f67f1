# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run tasks inside a Proxmox VE container with ``pct exec``, on the container's node.

Every command becomes ``pct exec <vmid> -- /bin/sh -c <cmd>``. When the node is the controller itself the
argv runs locally; otherwise it runs over ssh on the node, as one shell-quoted command line. Files travel
through the same channel (``cat`` on stdin/stdout), so no temporary copy on the node is needed. See
docs/connection.md for who runs what as which user, and the environment a command sees.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: pct
short_description: Run tasks inside a Proxmox VE container through C(pct exec) on its node
description:
  - Runs every command as C(pct exec <vmid> -- /bin/sh -c <cmd>) on the Proxmox VE node that hosts the
    container, over ssh, or locally when the node is the controller.
  - Transfers files through the same channel, so nothing is staged on the node. A file is streamed from disk to
    the command's stdin (an installer of hundreds of MB is never held in memory); a fetched file is written to a
    temporary name in the destination folder and renamed into place, so a failed fetch leaves no partial file.
  - C(pct exec) wraps C(lxc-attach); the project's C(bin/pct-local) stand-in maps it onto a local LXC
    container so the same plugin drives the embedded default CT.
  - Over ssh, ssh's exit code 255 (it could not reach or log in to the node) makes the host UNREACHABLE
    rather than failing the task. A command in the container that itself exits 255 reads the same over ssh (as
    with Ansible's ssh connection); with a local node an exit code 255 is an ordinary result.
  - "Users and become: C(pct exec) runs the command as root (uid 0) inside the container, whatever
    C(ansible_user) says; the user namespace of an unprivileged container maps that root to an unprivileged host
    uid. On a remote node, ssh logs in as O(node_user), which must be root (C(pct) refuses other users); locally
    C(pct) runs as the user that runs Ansible. C(become) with C(become_user=root), the default, changes nothing
    (Ansible skips it because the connection user is root already); another C(become_user) runs the become
    method (C(su), C(sudo)) inside the container, which must provide it. No become password is ever sent, and
    become never applies to the node."
  - "Environment: C(pct exec) keeps the environment it was started with (pve-container's C(--keep-env), on by
    default) minus C(SSL_CERT_FILE) and C(SSL_CERT_DIR), and C(lxc-attach) adds C(container=lxc). Over ssh
    that is the ssh session's environment on the node (C(PATH), C(HOME), C(USER), C(LOGNAME), C(SHELL), C(SSH_*)
    and whatever the client sends, typically C(LANG) and C(LC_*)). With a local node the plugin starts C(pct)
    with the same kind of environment (C(PATH), C(HOME), C(USER), C(LOGNAME), C(SHELL), C(LANG), C(LANGUAGE),
    C(LC_*), C(PCT_LOCAL_*)), never the whole controller environment, so that tokens and passwords in it
    (C(PROXMOX_TOKEN_SECRET), ...) do not reach the container."
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
    description:
      - Extra arguments for ssh (a string, split like a shell would).
      - They come before the plugin's own C(-o ControlPath) and C(-o ConnectTimeout), and ssh keeps the first
        value it is given for an option, so a C(ControlPath) or C(ConnectTimeout) set here wins.
    type: str
    default: '-o BatchMode=yes -o ControlMaster=auto -o ControlPersist=60s'
    vars:
      - name: pct_ssh_args
  ssh_connect_timeout:
    description:
      - Seconds ssh may take to connect to the node (ssh's C(ConnectTimeout)); a node that does not answer in
        time is UNREACHABLE instead of hanging for the system's TCP timeout.
      - C(0) leaves ssh's own default (no C(ConnectTimeout) is passed).
    type: int
    default: 10
    env:
      - name: ANSIBLE_TIMEOUT
    ini:
      - section: defaults
        key: timeout
    vars:
      - name: pct_ssh_connect_timeout
  ssh_control_path_dir:
    description:
      - Folder of the ssh control sockets (created, mode 0700, when first used); the same folder as Ansible's ssh
        connection uses.
    type: path
    default: ~/.ansible/cp
    env:
      - name: ANSIBLE_SSH_CONTROL_PATH_DIR
    ini:
      - section: ssh_connection
        key: control_path_dir
    vars:
      - name: pct_ssh_control_path_dir
  ssh_control_path:
    description:
      - The ssh C(ControlPath), the socket through which the C(ControlMaster)/C(ControlPersist) of O(ssh_args)
        reuse one ssh connection to a node for every C(pct exec) (without a C(ControlPath) they do nothing).
      - Empty (the default) means C(<ssh_control_path_dir>/pct-<hash>), 10 hex digits of a hash of O(node_user),
        O(node) and O(ssh_args); so one socket per node and way of reaching it, and a path well below the
        108-byte limit of a socket path (as Ansible's ssh connection does).
      - Any other value is passed as it is; ssh expands its C(%) tokens (C(%C), C(%h), ...) and C(~).
      - C(none) passes no C(ControlPath) (each command opens its own ssh connection).
    type: str
    default: ''
    vars:
      - name: pct_ssh_control_path
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
notes:
  - docs/connection.md in the repository describes users, become and the environment in more detail, with sources.
"""

EXAMPLES = r"""
# inventory host_vars of a training CT on a remote node
ansible_connection: pct
pct_vmid: 129
pct_node: pve1.example.com
pct_node_user: root
pct_ssh_connect_timeout: 20
"""

import hashlib
import os
import re
import secrets
import shlex
import subprocess
import threading

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

display = Display()

LOCAL_NODES = ("", "localhost", "local", "127.0.0.1", "::1")
# ssh's own exit code for "could not connect or log in" (a remote command's code is passed through otherwise).
SSH_FAILED = 255
# What a local `pct` gets from the controller's environment: what an ssh login to a node would give it
# (sshd sets PATH, HOME, USER, LOGNAME, SHELL; Debian's ssh client sends LANG and LC_*), plus the stand-in's own.
LOCAL_ENV_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE")
LOCAL_ENV_PREFIXES = ("LC_", "PCT_LOCAL_")


def pct_exec_argv(pct_command: str, vmid: int, argv: list[str]) -> list[str]:
    """The argv that runs ``argv`` inside the container.

    >>> pct_exec_argv("pct", 129, ["/bin/sh", "-c", "echo $HOME"])
    ['pct', 'exec', '129', '--', '/bin/sh', '-c', 'echo $HOME']
    """
    return [*shlex.split(pct_command), "exec", str(int(vmid)), "--", *argv]


def ssh_options(control_path: str, connect_timeout: int) -> list[str]:
    """The plugin's own ssh options, after the user's ssh_args (ssh keeps the first value of an option).

    >>> ssh_options("/root/.ansible/cp/pct-%C", 10)
    ['-o', 'ControlPath=/root/.ansible/cp/pct-%C', '-o', 'ConnectTimeout=10']
    >>> ssh_options("", 0)
    []
    """
    options = []
    if control_path:
        options += ["-o", f"ControlPath={control_path}"]
    if connect_timeout:
        options += ["-o", f"ConnectTimeout={int(connect_timeout)}"]
    return options


# A node is a host name or an IP address, a user a login name: neither may start with "-", where ssh would read it
# as an option (-oProxyCommand=...), and both come after "--" on ssh's command line as well.
NODE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]+\]?")
NODE_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def check_node(node: str, user: str) -> None:
    """Raise AnsibleError naming pct_node or pct_node_user when it is not a host name / login name.

    >>> check_node("pve1", "root"), check_node("10.0.0.5", "")
    (None, None)
    >>> check_node("-oProxyCommand=id", "")
    Traceback (most recent call last):
    ...
    ansible.errors.AnsibleError: pct_node='-oProxyCommand=id' is not a host name or an IP address; allowed: letters, digits, . _ - (not first or last), or an IP address
    """
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        raise AnsibleError(
            f"pct_node={node!r} is not a host name or an IP address; allowed: letters, digits, . _ - (not first "
            "or last), or an IP address"
        )
    if user and not NODE_USER.fullmatch(user):
        raise AnsibleError(
            f"pct_node_user={user!r} is not a login name; allowed: a letter or _, then letters, digits, _ . - "
            "(at most 32), or empty for ssh's own default"
        )


def node_argv(
    node: str, user: str, ssh_executable: str, ssh_args: str, argv: list[str], options: list[str] = ()
) -> list[str]:
    """Wrap ``argv`` so that it runs on the node: unchanged when local, one quoted command line over ssh.

    ssh hands the remote shell a single string, so the argv is joined with POSIX quoting and the node's
    shell splits it back into exactly the same words (spaces, quotes, ``$`` and newlines included). The
    destination comes after ``--``, so ssh never reads it as an option.

    >>> node_argv("pve1", "root", "ssh", "-o BatchMode=yes", ["pct", "exec", "129", "--", "echo", "a b"])
    ['ssh', '-o', 'BatchMode=yes', '--', 'root@pve1', "pct exec 129 -- echo 'a b'"]
    """
    if node in LOCAL_NODES:
        return list(argv)
    check_node(node, user)
    target = f"{user}@{node}" if user else node
    return [ssh_executable, *shlex.split(ssh_args), *options, "--", target, shlex.join(argv)]


def control_socket_name(user: str, node: str, ssh_args: str) -> str:
    """The default control socket's name: 'pct-' and 10 hex digits of a hash of who connects where, and how.

    Short (ssh adds a 17-character suffix while it creates the socket, and a socket path has at most 107 bytes),
    and one per node, user and ssh_args (which may name another port or key).

    >>> control_socket_name("root", "pve1", "-o BatchMode=yes")
    'pct-666b52a2f2'
    """
    digest = hashlib.sha1(f"{user}@{node} {ssh_args}".encode(), usedforsecurity=False).hexdigest()
    return f"pct-{digest[:10]}"


def local_env(environ: dict) -> dict:
    """The environment a local ``pct`` starts with: the login-like part of the controller's, no secrets.

    >>> sorted(local_env({"PATH": "/bin", "LC_ALL": "C", "PROXMOX_TOKEN_SECRET": "x", "HOME": "/root"}))
    ['HOME', 'LC_ALL', 'PATH']
    """
    return {k: v for k, v in environ.items() if k in LOCAL_ENV_NAMES or k.startswith(LOCAL_ENV_PREFIXES)}


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def open_beside(path: bytes) -> tuple[int, bytes]:
    """A new file next to ``path`` (same folder, so a rename into place is atomic), opened for writing.

    It gets the mode of ``path`` when that exists (a private file stays private once replaced), else 0666 minus
    the umask, as a plain ``open(path, "wb")`` would.
    """
    folder, name = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(folder, b"." + name + b"." + secrets.token_hex(4).encode() + b".part")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            try:
                mode = os.stat(path).st_mode & 0o7777
            except FileNotFoundError:
                mode = 0o666 & ~current_umask()
            os.fchmod(fd, mode)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd, tmp
    raise AnsibleError(f"pct: cannot create a temporary file beside {to_text(path)}")


def pump(src, fd: int, chunk: int = 1 << 20) -> None:
    """Copy the open file ``src`` into the pipe ``fd`` in chunks, then close it (a reader that quits early ends it)."""
    try:
        with os.fdopen(fd, "wb") as out:
            while True:
                data = src.read(chunk)
                if not data:
                    break
                out.write(data)
    except BrokenPipeError:
        pass


class Connection(ConnectionBase):
    """Tasks inside a Proxmox VE container, through ``pct exec`` on its node."""

    transport = "pct"
    has_pipelining = True
    # pct exec runs as root in the container, whatever ansible_user says: Ansible compares become_user with this,
    # so become to root is skipped (docs/connection.md).
    default_user = "root"

    def _connect(self):
        if not self._connected:
            display.vvv(
                f"PCT: vmid {self.get_option('vmid')} on node {self.get_option('node') or 'localhost'}",
                host=self._play_context.remote_addr,
            )
            self._connected = True
        return self

    def _remote(self) -> bool:
        return (self.get_option("node") or "") not in LOCAL_NODES

    def _control_path(self) -> str:
        """The ControlPath for ssh ('' for none), its folder created (0700) when it is the default one."""
        path = self.get_option("ssh_control_path") or ""
        if path.lower() == "none":
            return ""
        if not path:
            folder = os.path.expanduser(self.get_option("ssh_control_path_dir"))
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            except OSError as e:
                raise AnsibleError(f"pct: cannot create the ssh control socket folder {folder}: {e}") from e
            path = os.path.join(
                folder,
                control_socket_name(self.get_option("node_user"), self.get_option("node"), self.get_option("ssh_args")),
            )
        return path

    def _argv(self, inner: list[str]) -> list[str]:
        pct_argv = pct_exec_argv(self.get_option("pct_command"), self.get_option("vmid"), inner)
        if not self._remote():
            return pct_argv
        return node_argv(
            self.get_option("node"),
            self.get_option("node_user"),
            self.get_option("ssh_executable"),
            self.get_option("ssh_args"),
            pct_argv,
            ssh_options(self._control_path(), self.get_option("ssh_connect_timeout")),
        )

    def _run(self, inner: list[str], stdin=None, stdout=subprocess.PIPE):
        """Run ``inner`` in the container; ``stdin`` is bytes, an open file (streamed by the child) or None.

        Returns (rc, stdout, stderr). Over ssh, ssh's own failure (exit 255) raises AnsibleConnectionFailure,
        which Ansible reports as UNREACHABLE.
        """
        argv = self._argv(inner)
        display.vvvv(f"PCT EXEC {argv!r}", host=self._play_context.remote_addr)
        timeout = self.get_option("command_timeout") or None
        from_file = stdin is not None and not isinstance(stdin, bytes)
        # A file reaches the child through a pipe that a thread fills, never as the child's own stdin: lxc-attach
        # (what pct exec runs) fchmods its standard streams, which would chmod the controller's file to 0700.
        feed = None
        if from_file:
            read_end, write_end = os.pipe()
            feed = threading.Thread(target=pump, args=(stdin, write_end), daemon=True)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=read_end if from_file else subprocess.PIPE,
                stdout=stdout,
                stderr=subprocess.PIPE,
                env=None if self._remote() else local_env(os.environ),
            )
        except OSError as e:
            if from_file:
                os.close(write_end)
            raise AnsibleConnectionFailure(f"pct: cannot run {argv[0]!r}: {e}") from e
        finally:
            if from_file:
                os.close(read_end)
        if feed is not None:
            feed.start()
        try:
            out, err = proc.communicate(None if from_file else stdin, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.communicate()
            raise AnsibleConnectionFailure(f"pct: command timed out after {timeout}s: {shlex.join(inner)}") from e
        finally:
            if feed is not None:
                feed.join()
        if proc.returncode == SSH_FAILED and self._remote():
            raise AnsibleConnectionFailure(
                f"pct: ssh to {self.get_option('node_user')}@{self.get_option('node')} failed (exit 255): "
                f"{to_text(err, errors='surrogate_or_replace').strip() or 'no message'}"
            )
        return proc.returncode, out or b"", err or b""

    def exec_command(self, cmd, in_data=None, sudoable=True):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        return self._run(["/bin/sh", "-c", to_text(cmd, errors="surrogate_or_strict")], in_data)

    def put_file(self, in_path, out_path):
        super().put_file(in_path, out_path)
        display.vvv(f"PUT {in_path} TO {out_path}", host=self._play_context.remote_addr)
        b_in = to_bytes(in_path, errors="surrogate_or_strict")
        if not os.path.exists(b_in):
            raise AnsibleFileNotFound(f"file or module does not exist: {in_path}")
        # Streamed through a pipe that _run's thread fills from the file in chunks (nothing is held in memory here);
        # the child never gets the controller's file itself as stdin, so `pct exec` cannot change its permissions.
        with open(b_in, "rb") as f:
            rc, _out, err = self._run(["/bin/sh", "-c", f"cat > {shlex.quote(out_path)}"], f)
        if rc != 0:
            raise AnsibleError(f"pct: failed to write {out_path} in CT {self.get_option('vmid')}: {to_text(err)}")

    def fetch_file(self, in_path, out_path):
        super().fetch_file(in_path, out_path)
        display.vvv(f"FETCH {in_path} TO {out_path}", host=self._play_context.remote_addr)
        b_out = to_bytes(out_path, errors="surrogate_or_strict")
        fd, tmp = open_beside(b_out)
        try:
            with os.fdopen(fd, "wb") as f:
                rc, _out, err = self._run(["cat", "--", in_path], None, stdout=f)
                if rc == 0:
                    f.flush()
                    os.fsync(f.fileno())
            if rc != 0:
                raise AnsibleError(f"pct: failed to read {in_path} in CT {self.get_option('vmid')}: {to_text(err)}")
            os.replace(tmp, b_out)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def close(self):
        self._connected = False
