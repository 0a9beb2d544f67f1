"""GPU facts and memory from NVML (nvidia-ml-py) or ``nvidia-smi``, every call bounded (standard library only).

nvidia-smi can hang after an Xid error and NVML calls can block in the driver, so both run with a timeout:
nvidia-smi as a child process, NVML in a daemon thread that is abandoned when it overruns.

PIDs reported by NVML or nvidia-smi are host PIDs inside a container (the driver has no PID-namespace
support), so this module deliberately returns none: GPU data is for counting and memory checks only.
"""

from __future__ import annotations

import csv
import shutil
import threading
import time

from .run_bounded import CommandTimeout, run_bounded

# "100 % util at 250 W of 600 W": kernels (NCCL busy-waits) are resident but the SMs are mostly idle.
STARVED_MIN_UTILIZATION_PCT = 90.0
STARVED_MAX_POWER_FRACTION = 0.5

# nvidia-ml-py error classes that mean "no NVIDIA GPU or driver here" rather than a failure.
NO_GPU_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NotFound")

SMI_FIELDS = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "power.draw",
    "power.limit",
    "driver_version",
)


class GpuQueryError(Exception):
    """NVML and nvidia-smi are present but gave no answer (hang, driver mismatch, ...)."""


class GpuQueryTimeout(GpuQueryError):
    """NVML or nvidia-smi did not answer in time ('... timed out after N s')."""


def _number(text: str) -> float | None:
    """A CSV value as a number; None for '[N/A]', '[Not Supported]' and friends.

    >>> _number(" 81559"), _number("[N/A]"), _number("249.13")
    (81559.0, None, 249.13)
    """
    try:
        return float(text.strip())
    except ValueError:
        return None


def is_starved(utilization_pct: float | None, power_draw_w: float | None, power_limit_w: float | None) -> bool:
    """High utilisation at low power: the GPU is waiting (all-reduce over PCIe, data stalls), not computing.

    >>> is_starved(100, 250, 600), is_starved(100, 476, 600), is_starved(20, 90, 600), is_starved(100, None, 600)
    (True, False, False, False)
    """
    if utilization_pct is None or power_draw_w is None or not power_limit_w:
        return False
    return utilization_pct >= STARVED_MIN_UTILIZATION_PCT and power_draw_w < STARVED_MAX_POWER_FRACTION * power_limit_w


def gpu_record(
    index: int,
    name: str,
    uuid: str,
    memory_total_mib: float | None,
    memory_used_mib: float | None,
    utilization_pct: float | None,
    power_draw_w: float | None,
    power_limit_w: float | None,
) -> dict:
    """One GPU as the modules return it (memory in MiB, power in W, utilisation in %)."""
    return {
        "index": index,
        "name": name,
        "uuid": uuid,
        "memory_total_mib": memory_total_mib,
        "memory_used_mib": memory_used_mib,
        "utilization_pct": utilization_pct,
        "power_draw_w": power_draw_w,
        "power_limit_w": power_limit_w,
        "starved": is_starved(utilization_pct, power_draw_w, power_limit_w),
    }


def parse_smi_csv(text: str) -> tuple[list[dict], str | None]:
    """Parse ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits``.

    >>> gpus, driver = parse_smi_csv("0, NVIDIA RTX PRO 6000, GPU-1a, 97887, 40754, 100, 250.10, 600.00, 580.65.06\\n")
    >>> driver, gpus[0]["memory_used_mib"], gpus[0]["starved"]
    ('580.65.06', 40754.0, True)
    """
    gpus, driver = [], None
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        if len(row) != len(SMI_FIELDS):
            raise GpuQueryError(f"unexpected nvidia-smi line {','.join(row)!r} (want {len(SMI_FIELDS)} fields)")
        values = dict(zip(SMI_FIELDS, (c.strip() for c in row), strict=True))
        driver = values["driver_version"]
        gpus.append(
            gpu_record(
                int(values["index"]),
                values["name"],
                values["uuid"],
                _number(values["memory.total"]),
                _number(values["memory.used"]),
                _number(values["utilization.gpu"]),
                _number(values["power.draw"]),
                _number(values["power.limit"]),
            )
        )
    return gpus, driver


def query_smi(timeout: float, smi: str = "nvidia-smi") -> tuple[list[dict], str | None]:
    """Ask nvidia-smi; ([], None) when it reports no devices; GpuQueryError when it fails or hangs."""
    cmd = [smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        run = run_bounded(cmd, timeout, what=smi)
    except CommandTimeout as e:
        raise GpuQueryTimeout(f"{e}: it did not answer (hung driver after an Xid?)") from None
    except OSError as e:
        raise GpuQueryError(f"cannot run {smi}: {e.strerror}") from None
    if run.returncode != 0:
        message = (run.stdout + run.stderr).strip()
        if "No devices were found" in message:
            return [], None
        raise GpuQueryError(f"{smi} failed (rc={run.returncode}): {message[:300]}")
    return parse_smi_csv(run.stdout)


def _query_nvml(pynvml) -> tuple[list[dict], str | None]:
    def text(value):
        return value.decode() if isinstance(value, bytes) else value

    def optional(call, *args):
        try:
            return call(*args)
        except pynvml.NVMLError:
            return None

    pynvml.nvmlInit()
    try:
        driver = text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = optional(pynvml.nvmlDeviceGetUtilizationRates, h)
            power = optional(pynvml.nvmlDeviceGetPowerUsage, h)
            limit = optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
            gpus.append(
                gpu_record(
                    index,
                    text(pynvml.nvmlDeviceGetName(h)),
                    text(pynvml.nvmlDeviceGetUUID(h)),
                    mem.total / 2**20,
                    mem.used / 2**20,
                    float(util.gpu) if util is not None else None,
                    power / 1000.0 if power is not None else None,
                    limit / 1000.0 if limit is not None else None,
                )
            )
        return gpus, driver
    finally:
        pynvml.nvmlShutdown()


def query_nvml(timeout: float, pynvml) -> tuple[list[dict], str | None]:
    """Query through nvidia-ml-py in a daemon thread; GpuQueryError on error or when it overruns."""
    box: dict = {}

    def work():
        try:
            box["result"] = _query_nvml(pynvml)
        except Exception as e:  # NVMLError subclasses, e.g. driver/library version mismatch
            box["error"] = e

    worker = threading.Thread(target=work, name="nvml-query", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise GpuQueryTimeout(f"NVML timed out after {timeout:g} s: it did not answer (hung driver after an Xid?)")
    if "error" in box:
        if type(box["error"]).__name__ in NO_GPU_ERRORS:
            return [], None
        raise GpuQueryError(f"NVML failed: {box['error']}")
    return box["result"]


def import_pynvml():
    try:
        import pynvml  # nvidia-ml-py, when the target has it
    except ImportError:
        return None
    return pynvml


def query_gpus(timeout: float = 10.0, smi: str = "nvidia-smi", pynvml="auto") -> dict:
    """GPUs of this machine: {source, gpus, driver_version, error}.

    ``source`` is 'nvml', 'nvidia-smi' or None (neither available: ``gpus`` is [] and that is no error);
    ``error`` is the reason when a tool exists but gave no usable answer.
    """
    module = import_pynvml() if pynvml == "auto" else pynvml
    if module is not None:
        try:
            gpus, driver = query_nvml(timeout, module)
            return {"source": "nvml", "gpus": gpus, "driver_version": driver, "error": None}
        except GpuQueryError as e:
            nvml_error = str(e)
            if isinstance(e, GpuQueryTimeout):
                # A hung driver hangs nvidia-smi too: do not spend a second timeout on it.
                return {"source": "nvml", "gpus": [], "driver_version": None, "error": nvml_error}
    else:
        nvml_error = None
    if shutil.which(smi) is None:
        return {"source": None, "gpus": [], "driver_version": None, "error": nvml_error}
    try:
        gpus, driver = query_smi(timeout, smi)
    except GpuQueryError as e:
        return {"source": "nvidia-smi", "gpus": [], "driver_version": None, "error": str(e)}
    return {"source": "nvidia-smi", "gpus": gpus, "driver_version": driver, "error": None}


def memory_used(query: dict) -> list[dict] | None:
    """[{index, used_mib}] from a ``query_gpus`` answer; None when memory was not measurable.

    >>> memory_used({"source": "nvidia-smi", "error": None, "gpus": [{"index": 0, "memory_used_mib": 3.0}]})
    [{'index': 0, 'used_mib': 3.0}]
    >>> memory_used({"source": None, "error": None, "gpus": []}) is None
    True
    """
    if query["source"] is None or query["error"] or not query["gpus"]:
        return None
    return [{"index": g["index"], "used_mib": g["memory_used_mib"]} for g in query["gpus"]]


def over_tolerance(used: list[dict], tolerance_mib: float) -> list[dict]:
    """GPUs whose used memory is above ``tolerance_mib`` (unknown readings count as over).

    >>> over_tolerance([{"index": 0, "used_mib": 3.0}, {"index": 1, "used_mib": 40754.0}], 1024)
    [{'index': 1, 'used_mib': 40754.0}]
    """
    return [g for g in used if g["used_mib"] is None or g["used_mib"] > tolerance_mib]


MEMORY_HELD = (
    "GPU memory still in use after cleanup ({listed}; tolerance {tolerance} MiB) although no process here holds a "
    "GPU device: a process outside this container, or a context the driver has not freed (zombie with pinned "
    "memory); check nvidia-smi on the Proxmox node"
)


def measure(timeout: float) -> tuple[list[dict] | None, dict]:
    """(used MiB per GPU or None, the whole query): one reading, bounded by ``timeout``."""
    query = query_gpus(timeout=timeout)
    return memory_used(query), query


def verify_memory(before_query: dict, tolerance: int, deadline: float, call_timeout: float) -> dict:
    """Poll GPU memory until every GPU is within ``tolerance`` MiB or ``deadline`` passes.

    The driver frees a context's memory shortly after the process is gone, so one reading is not enough.
    """
    status = {"source": before_query["source"], "tolerance_mib": tolerance, "after": None}
    if before_query["source"] is None:
        return dict(status, status="unverified", message="no NVML and no nvidia-smi on this host")
    if before_query["error"] and "did not answer" in before_query["error"]:
        return dict(status, status="unverified", message=before_query["error"])
    interval = 0.2
    while True:
        # One reading always gets its full call timeout (a loaded host starts nvidia-smi slowly); the deadline
        # bounds how long readings are repeated.
        after, query = measure(call_timeout)
        status["after"] = after
        if after is None:
            return dict(status, status="unverified", message=query["error"] or "no GPU reported")
        over = over_tolerance(after, tolerance)
        if not over:
            return dict(status, status="ok", message=f"every GPU at or below {tolerance} MiB used")
        if time.monotonic() + interval >= deadline:
            listed = ", ".join(f"GPU {g['index']}: {g['used_mib']} MiB" for g in over)
            return dict(status, status="failed", message=MEMORY_HELD.format(listed=listed, tolerance=tolerance))
        time.sleep(interval)
        interval = min(interval * 1.5, 1.0)
