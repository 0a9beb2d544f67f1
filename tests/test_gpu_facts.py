"""library/gpu_facts.py main(): facts from a fake nvidia-smi, and no GPU at all."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args

ROOT = Path(__file__).resolve().parent.parent
FAKEBIN = Path(__file__).resolve().parent / "fakebin"

spec = importlib.util.spec_from_file_location("gpu_facts_module", ROOT / "library" / "gpu_facts.py")
gpu_facts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_facts)


def run(args, capsys):
    with patch_module_args(args), pytest.raises(SystemExit):
        gpu_facts.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def smi(monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKEBIN}:{os.environ['PATH']}")
    return lambda mode: monkeypatch.setenv("FAKE_SMI_MODE", mode)


def test_no_gpu_gives_empty_list_not_an_error(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    out = run({}, capsys)
    assert not out.get("failed") and out["changed"] is False
    assert out["ansible_facts"] == {
        "gpus": [],
        "nvidia_driver_version": None,
        "gpu_query": {"source": None, "error": None},
    }


def test_starved_gpu_is_flagged(capsys, smi):
    smi("starved")
    facts = run({}, capsys)["ansible_facts"]
    assert facts["nvidia_driver_version"] == "580.65.06"
    assert facts["gpus"][0]["starved"] is True and facts["gpus"][0]["utilization_pct"] == 100


def test_idle_gpus_are_not_starved(capsys, smi):
    smi("idle")
    facts = run({}, capsys)["ansible_facts"]
    assert [g["starved"] for g in facts["gpus"]] == [False, False]


def test_hanging_tool_is_reported_and_can_fail(capsys, smi):
    smi("hang")
    out = run({"timeout": 0.5}, capsys)
    assert out["ansible_facts"]["gpus"] == [] and "did not answer" in out["ansible_facts"]["gpu_query"]["error"]
    out = run({"timeout": 0.5, "fail_on_error": True}, capsys)
    assert out["failed"] is True and out["msg"].startswith("cannot read the GPUs: nvidia-smi timed out after 0.5 s")


def test_bad_timeout_is_named(capsys):
    out = run({"timeout": 0}, capsys)
    assert out["failed"] is True and "timeout=0 must be a positive" in out["msg"]
