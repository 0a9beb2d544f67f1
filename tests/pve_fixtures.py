"""Helpers for the Proxmox tests: run a module's main() the ansible-core way, seed fakepve.

The modules import `ansible.module_utils.pve`, which Ansible resolves from the project's
module_utils/ at run time; here the project's module_utils directory is added to that package's
search path so the same import works under plain pytest.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import pathlib
import sys
import threading

import ansible.module_utils
import pytest
from ansible.module_utils.testing import patch_module_args

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))

TEMPLATE_FILE = "debian-12-standard_12.7-1_amd64.tar.zst"
TEMPLATE = f"local:vztmpl/{TEMPLATE_FILE}"
GPU_NODES = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def load_file_module(name, path):
    """Import a module from a file path (library/*.py, role-embedded modules and plugins)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_module(module, args, capsys, check_mode=False, diff=True):
    """Call module.main() with args; returns the parsed result (failed results included)."""
    args = dict(args, _ansible_check_mode=check_mode, _ansible_diff=diff)
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    out = capsys.readouterr().out
    return json.loads(out)


def api_args(pve, cafile, **extra):
    """Module arguments that reach the fake with root@pam's password ticket."""
    args = dict(
        api_host=pve.host,
        api_port=pve.port,
        api_user="root@pam",
        api_password=pve.password,
        ca_path=cafile,
        timeout=5,
    )
    args.update(extra)
    return args


def ct_spec(**extra):
    """The CT 129 spec the provision role sends, with the stand-in GPU nodes."""
    spec = dict(
        vmid=129,
        node="pve1",
        template=TEMPLATE,
        hostname="train129",
        cores=8,
        memory=16384,
        swap=0,
        rootfs="local-lvm:32",
        net=["name=eth0,bridge=vmbr0,ip=dhcp"],
        features={"nesting": True},
        onboot=True,
        devices=list(GPU_NODES),
    )
    spec.update(extra)
    return spec


def seed_template(pve):
    """Put the OS template on storage 'local', as `pveam download local ...` would."""
    pve.store_file("local", TEMPLATE_FILE, 129 * 1024**2, content="vztmpl")


# ------------------------------------------------------------------ TOTP: fakepve answers NeedTFA, not the code


def totp_pve_class():
    """A FakePve whose root@pam has TOTP on: fakepve's own `tfa` switch answers the password with NeedTFA and a
    challenge ticket; this subclass also answers the second step (POST /access/ticket with tfa-challenge and
    password 'totp:<code>') as PVE does: a full ticket for the right code, 401 otherwise."""
    import secrets

    from fakepve import FakePve
    from fakepve.server import params

    class TotpPve(FakePve):
        code = "123456"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tfa = True
            self.challenges = set()
            self.second_factor_attempts = []

        async def _ticket(self, request):
            form = await params(request)
            challenge = form.get("tfa-challenge")
            if challenge is None:
                response = await super()._ticket(request)
                if self.tfa and response.status == 200:
                    body = json.loads(response.text)
                    body["data"]["ticket"] = "PVE:root@pam:65F00000::!tfa!%7B%22totp%22%3Atrue%7D" + secrets.token_hex(
                        4
                    )
                    self.challenges.add(body["data"]["ticket"])
                    response.text = json.dumps(body)
                return response
            from aiohttp import web

            self.second_factor_attempts.append(form.get("password"))
            if challenge in self.challenges and form.get("password") == f"totp:{self.code}":
                self.challenges.discard(challenge)
                ticket, csrf = self.issue_ticket(str(form.get("username")))
                return web.json_response({"data": {"ticket": ticket, "CSRFPreventionToken": csrf}})
            return web.json_response({"data": None, "message": "authentication failure\n"}, status=401)

    return TotpPve


@contextlib.contextmanager
def serve(pve, certdir):
    """Serve a FakePve (or subclass) on 127.0.0.1 with a fresh self-signed certificate; yields the CA file."""
    from fakepve import settle
    from fakepve.certs import make_cert

    certfile, keyfile, _ = make_cert(str(certdir), hosts=("127.0.0.1",))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fakepve-totp", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(pve.start(certfile, keyfile), loop).result(30)
        yield certfile
    finally:
        try:
            asyncio.run_coroutine_threadsafe(settle(), loop).result(30)
            asyncio.run_coroutine_threadsafe(pve.stop(), loop).result(30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()


def node_clock_pve_class():
    """A FakePve whose GET /nodes/{node}/time reads the fake node's clock (fakepve answers a fixed schema sample),
    node_clock_ahead seconds ahead of this machine's: tasks it started look that much older to the node."""
    import time

    from fakepve import FakePve

    class NodeClockPve(FakePve):
        node_clock_ahead = 0

        async def synthesise(self, match, method, info, user, values):
            if method == "GET" and match.template == "/nodes/{node}/time":
                now = int(time.time() + self.node_clock_ahead)
                return {"time": now, "localtime": now, "timezone": "UTC"}
            return await super().synthesise(match, method, info, user, values)

    return NodeClockPve
