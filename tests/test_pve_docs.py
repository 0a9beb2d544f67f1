"""ansible-doc renders every module's documentation (library/ and the roles' own), and pve_lxc's documents
its real options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pve_fixtures import ROOT, load_file_module

MODULES = {
    "pve_lxc": ROOT / "library",
    "pve_lxc_raw": ROOT / "library",
    "gpu_cleanup": ROOT / "library",
    "gpu_facts": ROOT / "library",
    "train_health": ROOT / "library",
    "target_lock": ROOT / "library",
    "local_lxc": ROOT / "library",
    "pve_gpu_host_facts": ROOT / "roles/pve_gpu_host/library",
    "nvidia_userspace_facts": ROOT / "roles/gpu_userspace/library",
}


def test_ansible_doc_renders_every_module():
    env = dict(os.environ, ANSIBLE_LIBRARY=":".join(sorted({str(p) for p in MODULES.values()})))
    cmd = [os.path.join(os.path.dirname(sys.executable), "ansible-doc"), "--json", *MODULES]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert sorted(docs) == sorted(MODULES)
    for name, doc in docs.items():
        assert doc["doc"]["short_description"], name
        assert doc["examples"] and doc["return"], name


def test_pve_lxc_documents_exactly_its_argument_spec():
    import yaml

    pve_lxc = load_file_module("pve_lxc_doc", ROOT / "library" / "pve_lxc.py")
    documented = yaml.safe_load(pve_lxc.DOCUMENTATION)["options"]
    spec = pve_lxc.argument_spec()
    assert sorted(documented) == sorted(spec)
    for name, option in spec.items():
        assert documented[name]["type"] == option.get("type", "str"), name
        assert documented[name].get("default") == option.get("default"), name
        assert documented[name].get("choices") == option.get("choices"), name
