"""Helpers for the pipeline tests: a cached tiny synthetic dataset and a trainer subprocess runner.

Subprocesses are started by these helpers and reaped by PID (never by name); every wait is bounded.
The bounds are hang guards, never speed checks: a loaded 2-core machine runs the trainer several times slower
than an idle one, so no wait here gives up before WAIT_FLOOR_S, whatever smaller bound a caller passes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

TRAINING_ROOT = Path(__file__).resolve().parents[1]
WAIT_FLOOR_S = 240.0


def rendezvous_port() -> int:
    """A free 127.0.0.1 port for a torchrun c10d store, below the kernel's ephemeral range.

    The port is closed again before torchrun binds it. Inside the ephemeral range any outgoing connection on the
    machine (the controller tier runs alongside) may be given it in between; below it only an explicit bind can
    take it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = random.sample(range(10000, low), min(200, max(0, low - 10000)))
    for port in [*candidates, 0]:  # 0: the kernel's choice, if nothing below the range is free
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def synth_dataset(base: Path, name: str = "synth_small", **options) -> Path:
    """Create (once per pytest session base dir) a tiny synthetic dataset; returns its directory."""
    from eagle3.synth import SynthConfig, synthesize

    out = base / name
    if not (out / "index.json").is_file():
        cfg = SynthConfig(**{"num_samples": 160, "max_len": 400, **options})
        synthesize(out, cfg, log=lambda *a, **k: None)
    return out


def write_config(path: Path, **values) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(TRAINING_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    # glibc adds a malloc arena (64 MiB of address space) whenever threads contend for one, so under an
    # address-space limit (memory_limit_gb on CPU) how much is left would depend on the machine's load.
    env["MALLOC_ARENA_MAX"] = "2"
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def start_trainer(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m eagle3 ARGS` in its own session, output appended to log_path; `env` adds variables."""
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "eagle3", *args],
        cwd=TRAINING_ROOT,
        env=trainer_env(**(env or {})),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_trainer(
    args: list[str], log_path: Path, timeout: float = WAIT_FLOOR_S, env: dict[str, str] | None = None
) -> int:
    proc = start_trainer(args, log_path, env)
    try:
        return proc.wait(timeout=max(timeout, WAIT_FLOOR_S))
    finally:
        reap(proc)


def reap(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Make sure a process we started is gone: TERM its own group, then KILL, always wait on its PID."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the group we created with start_new_session
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=grace)


def read_status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == kind]


def read_samples(run_dir: Path, rank: int = 0) -> list[dict]:
    path = run_dir / f"samples_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    """Poll `predicate` until it holds (True) or the bound passes (False); the bound is at least WAIT_FLOOR_S."""
    deadline = time.monotonic() + max(timeout, WAIT_FLOOR_S)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def chats(path: Path, files: list[Path]) -> Path:
    """Conversations from Python sources: the user gives eight lines of a file, the assistant continues it."""
    with path.open("w") as f:
        for p in files:
            lines = p.read_text(errors="replace").splitlines()
            for start in range(0, min(len(lines), 90), 30):
                head, tail = "\n".join(lines[start : start + 8]), "\n".join(lines[start + 8 : start + 24])
                if head.strip() and tail.strip():
                    turns = [{"role": "user", "content": head}, {"role": "assistant", "content": tail}]
                    f.write(json.dumps({"messages": turns}) + "\n")
    return path


@dataclass(frozen=True)
class TinyDrafter:
    target: Path  # the tiny target (eagle3.tiny_target, cached)
    run_dir: Path  # 100 steps of `eagle3 train` on data generated from it
    export_dir: Path  # its best checkpoint, `eagle3 export`ed
    held: Path  # held-out conversations (prompts)


def train_tiny_drafter(base: Path) -> TinyDrafter:
    """Generate data from the tiny target, train a drafter on it for 100 steps and export it (about 20 s idle).
    Its attention has the target's shape (2 query heads, 1 key/value head of 32), which vLLM's CPU build serves;
    the trainer's default for hidden 64 would be heads of 16."""
    from eagle3.cli import main as eagle3_main
    from eagle3.generate import generate
    from eagle3.tiny_target import cached

    target = cached(log=lambda *a, **k: None)
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = chats(base / "train.jsonl", stdlib[9::10][:16])
    held = chats(base / "held.jsonl", stdlib[4::10][:2])
    generate(target, train, base / "data", max_len=512, draft_vocab=512, shard_samples=16, log=lambda *a, **k: None)
    options = (
        "--max_seq_len 1024 --max_steps 100 --warmup_steps 10 --lr 3e-3 --ttt_steps 3 --checkpoint_every 100 "
        "--device cpu --dtype fp32 --num_threads 2 --num_heads 2 --num_kv_heads 1 --head_dim 32"
    )
    args = ["train", "--data_dir", str(base / "data"), "--run_dir", str(base / "run"), *options.split()]
    rc = run_trainer(args, base / "train.log", timeout=600)
    assert rc == 0, (base / "train.log").read_text()[-2000:]
    assert eagle3_main(["export", str(base / "run"), str(base / "export")]) == 0
    return TinyDrafter(target, base / "run", base / "export", held)
