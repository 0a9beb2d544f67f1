"""What an identity other than root@pam may change on CT 129, decided before anything is sent to PVE.

The API is a stand-in that answers GET /access/permissions only: these stories are about the decision, the
fakepve tests in test_pve_lxc.py about the same decisions end to end.
"""

from __future__ import annotations

import ansible.module_utils.pve_rights as pve_rights
import pytest
from ansible.module_utils.pve_errors import PveError


class Permissions:
    """GET /access/permissions?path=...: {path: {privilege: 1}}, or an exception when the identity may not ask."""

    def __init__(self, held=None, fails=False):
        self.held, self.fails, self.asked = held or {}, fails, []
        self.access = self
        self.permissions = self

    def get(self, path):
        self.asked.append(path)
        if self.fails:
            raise RuntimeError("403 Permission check failed (/access, Sys.Audit)")
        return {path: dict.fromkeys(self.held.get(path, ()), 1)}


def test_root_pam_needs_no_permission_lookup():
    api = Permissions()
    pve_rights.Rights(api, "root@pam").check(129, {}, {"dev0": "/dev/nvidia0", "memory": "4096"}, [], True)
    assert api.asked == []


def test_unreadable_permissions_leave_privileges_to_pve_but_never_devices():
    rights = pve_rights.Rights(Permissions(fails=True), "ops@pve!ci")
    rights.check(129, {}, {"memory": "4096", "cores": "8"}, [], True)  # PVE itself will decide
    with pytest.raises(PveError, match=r"ops@pve!ci may not change dev0: PVE only lets root@pam itself"):
        rights.check(129, {}, {"dev0": "/dev/nvidia0"}, [], True)


def test_privileges_on_the_pool_count_for_the_ct():
    api = Permissions({"/pool/gpu": ["VM.Config.Memory"]})
    pve_rights.Rights(api, "ops@pve").check(129, {}, {"memory": "8192"}, [], True, pool="gpu")
    with pytest.raises(PveError) as failed:
        pve_rights.Rights(api, "ops@pve").check(129, {}, {"cores": "8"}, [], True, pool="gpu")
    assert str(failed.value).startswith("ops@pve lacks VM.Config.CPU on /vms/129 (to change cores) (nor on its pool")


def test_a_refusal_pve_sends_anyway_is_worded_with_the_way_out():
    rights = pve_rights.Rights(Permissions(), "root@pam!ansible")
    text = "403 Permission check failed (changing the hookscript is only allowed for root@pam)"
    message = rights.refusal(text, ["hookscript"])
    assert message.startswith("root@pam!ansible may not change hookscript ('changing the hookscript")
    assert "api_backend=local" in message
    assert rights.refusal("500 got timeout", ["memory"]) is None
