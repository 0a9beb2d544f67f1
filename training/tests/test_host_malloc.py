"""eagle3.distributed.keep_freed_host_memory: on CPU a step's tensors up to 32 MiB come from glibc's heap and the
heap keeps them after they are freed (nothing to page in again next step); on CUDA, or where the user chose malloc's
settings, nothing changes. Read from glibc's own accounting (mallinfo2), in a fresh interpreter per case."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
from pipeline_support import TRAINING_ROOT, trainer_env

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 33),
    reason="glibc >= 2.33 (mallinfo2) only",
)

SCRIPT = r"""
import ctypes, json, sys
import torch
from eagle3 import distributed

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
said = distributed.keep_freed_host_memory(sys.argv[1])
before = libc.mallinfo2()
x = torch.ones(4 << 20)  # 16 MiB of float32: over glibc's initial mmap threshold (128 KiB), under its ceiling
during = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(json.dumps({"said": said, "mapped": during.hblkhd - before.hblkhd, "kept_free": after.fordblks}))
"""

MIB = 2**20


def run_case(device: str, **env) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, device],
        cwd=TRAINING_ROOT,
        env={**trainer_env(), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_on_cpu_a_large_tensor_comes_from_the_heap_and_stays_there_when_freed():
    r = run_case("cpu")
    assert "kept for the next step" in r["said"]
    assert r["mapped"] == 0, r  # not a mapping of its own
    assert r["kept_free"] >= 16 * MIB, r  # freed into the heap, not trimmed away


def test_on_cuda_and_by_default_a_large_tensor_is_its_own_mapping():
    r = run_case("cuda")
    assert r["said"] == ""
    assert r["mapped"] >= 16 * MIB, r


def test_malloc_settings_the_user_chose_are_left_alone():
    r = run_case("cpu", MALLOC_MMAP_THRESHOLD_="131072")
    assert r["said"] == "host malloc left as set (MALLOC_MMAP_THRESHOLD_)"
    assert r["mapped"] >= 16 * MIB, r
