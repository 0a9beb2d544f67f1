"""module_utils/nvml.py: nvidia-smi parsing and timeouts (fake nvidia-smi), NVML through a fake pynvml."""

from __future__ import annotations

import doctest
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from module_utils import nvml

FAKE_SMI = str(Path(__file__).resolve().parent / "fakebin" / "nvidia-smi")


def test_docstring_examples_hold():
    assert doctest.testmod(nvml).failed == 0


@pytest.fixture
def smi_mode(monkeypatch):
    return lambda mode: monkeypatch.setenv("FAKE_SMI_MODE", mode)


def test_nvidia_smi_reports_memory_and_starved_gpu(smi_mode):
    smi_mode("starved")
    out = nvml.query_gpus(timeout=10, smi=FAKE_SMI, pynvml=None)
    assert out["source"] == "nvidia-smi" and out["error"] is None and out["driver_version"] == "580.65.06"
    (gpu,) = out["gpus"]
    assert (gpu["memory_used_mib"], gpu["power_draw_w"], gpu["power_limit_w"], gpu["starved"]) == (
        40754,
        250,
        600,
        True,
    )
    assert nvml.memory_used(out) == [{"index": 0, "used_mib": 40754.0}]


def test_hanging_nvidia_smi_is_cut_off(smi_mode):
    smi_mode("hang")
    started = time.monotonic()
    out = nvml.query_gpus(timeout=0.5, smi=FAKE_SMI, pynvml=None)
    assert time.monotonic() - started < 15  # the fake never answers: only the timeout ends the call
    assert out["gpus"] == [] and "nvidia-smi timed out after 0.5 s" in out["error"]
    assert nvml.memory_used(out) is None


def test_no_devices_is_no_error_but_mismatch_is(smi_mode):
    smi_mode("nodev")
    assert nvml.query_gpus(smi=FAKE_SMI, pynvml=None) == {
        "source": "nvidia-smi",
        "gpus": [],
        "driver_version": None,
        "error": None,
    }
    smi_mode("mismatch")
    out = nvml.query_gpus(smi=FAKE_SMI, pynvml=None)
    assert "Driver/library version mismatch" in out["error"]


def test_no_tool_at_all_gives_no_gpus():
    out = nvml.query_gpus(smi="/nonexistent/nvidia-smi", pynvml=None)
    assert out == {"source": None, "gpus": [], "driver_version": None, "error": None}


def test_unexpected_smi_output_is_named():
    with pytest.raises(nvml.GpuQueryError, match=r"unexpected nvidia-smi line '0, x' \(want 9 fields\)"):
        nvml.parse_smi_csv("0, x\n")


class FakeNVMLError(Exception):
    pass


class NVMLError_DriverNotLoaded(FakeNVMLError):  # named like pynvml's class
    pass


def fake_pynvml(hang: float = 0.0, init_error: Exception | None = None):
    """A stand-in for nvidia-ml-py with two GPUs; GPU 1 does not support power readings."""

    def init():
        if init_error:
            raise init_error
        time.sleep(hang)

    def unsupported(h):
        raise FakeNVMLError("Not Supported")

    return SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"580.65.06",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=141 * 2**30, used=(h * 1000 + 1) * 2**20),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=100 if h else 0),
        nvmlDeviceGetPowerUsage=lambda h: 100_000 if h == 0 else unsupported(h),
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
    )


def test_nvml_is_preferred_and_unsupported_readings_are_null():
    out = nvml.query_gpus(timeout=5, smi=FAKE_SMI, pynvml=fake_pynvml())
    assert out["source"] == "nvml" and out["driver_version"] == "580.65.06"
    assert [g["memory_used_mib"] for g in out["gpus"]] == [1.0, 1001.0]
    assert out["gpus"][1]["power_draw_w"] is None and out["gpus"][1]["starved"] is False


def test_hanging_nvml_is_abandoned_without_trying_nvidia_smi(smi_mode):
    smi_mode("idle")
    started = time.monotonic()
    out = nvml.query_gpus(timeout=0.3, smi=FAKE_SMI, pynvml=fake_pynvml(hang=60))
    assert time.monotonic() - started < 20  # abandoned at 0.3 s, not waited for (60 s)
    assert out["source"] == "nvml" and "NVML timed out after 0.3 s" in out["error"]


def test_nvml_without_driver_means_no_gpu():
    out = nvml.query_gpus(smi="/nonexistent", pynvml=fake_pynvml(init_error=NVMLError_DriverNotLoaded("x")))
    assert out["gpus"] == [] and out["error"] is None
