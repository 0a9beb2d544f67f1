"""`python -m eagle3 train`: the entry point. Reads the config, sets up the process (signals, stand-in device,
observer, process group, watchdog, memory limit), runs eagle3.loop.Trainer, and turns how it ended into the exit
code and status.json's error record:

    0 done or stopped cleanly, 2 bad config/data, 3 out of memory, 4 hang (watchdog), 5 a run_dir that refuses
    writes (full, read-only, no permission; the previous checkpoints intact), 1 anything else
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml

from eagle3 import checkpoint as ckpt
from eagle3 import distributed as dist_utils
from eagle3.config import TrainConfig, dump_config, load_config
from eagle3.errors import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_OOM,
    EXIT_STORAGE,
    STATUS_FILE_ENV,
    STORAGE_KINDS,
    ConfigError,
    StorageError,
)
from eagle3.files import atomic_write_json
from eagle3.loop import Trainer, check_run_dir_shared
from eagle3.metrics import (
    RunFiles,
)
from eagle3.nodes import gather_hosts
from eagle3.observe import Observer
from eagle3.process import StopRequested, apply_memory_limit, is_oom
from eagle3.standin import hold_standin_device
from eagle3.trackers import check_available as check_tracker
from eagle3.watchdog import Watchdog


def _config_error_status(status_file: str | None, message: str, max_seq_len: int | None) -> None:
    """Record a config error in status.json, keeping what the file says of earlier runs (their last step and
    checkpoint stay visible). `status_file`: from the config's run_dir when it could be read, else where the
    launcher said (eagle3.errors.STATUS_FILE_ENV), else nowhere."""
    if not status_file or dist_utils.env_rank()[0] != 0:
        return
    path = Path(status_file)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    old = old if isinstance(old, dict) else {}
    error = {"kind": "config", "message": message, "max_seq_len": max_seq_len or old.get("max_seq_len") or 0}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            path,
            {
                **old,
                **_previous_run(old),
                "phase": "failed",
                "error": error,
                "pid": os.getpid(),
                "updated": time.time(),
            },
        )


def _previous_run(old: dict) -> dict:
    """What an earlier run's status.json said of itself, kept under `previous_run` by the next start.

    >>> _previous_run({"phase": "training", "step": 40, "epoch": 1, "updated": 5.0, "error": None})
    {'previous_run': {'phase': 'training', 'step': 40, 'epoch': 1, 'updated': 5.0, 'error_kind': None}}
    >>> _previous_run({"phase": "failed", "step": 0, "previous_run": {"step": 40}})  # a run that did no step
    {'previous_run': {'step': 40}}
    >>> _previous_run({})
    {}
    """
    if not old:
        return {}
    if not old.get("step") and old.get("previous_run"):
        return {"previous_run": old["previous_run"]}
    fields = {k: old.get(k) for k in ("phase", "step", "epoch", "updated")}
    return {"previous_run": {**fields, "error_kind": (old.get("error") or {}).get("kind")}}


def _carry_over(files: RunFiles) -> None:
    """Rank 0 at a start: the newest complete checkpoint on disk and the previous run's last step, so that a start
    that fails before resuming still shows them."""
    with contextlib.suppress(OSError, ValueError):
        old = json.loads((files.run_dir / "status.json").read_text())
        files.status.update(_previous_run(old if isinstance(old, dict) else {}))
    valid = ckpt.list_valid(files.run_dir)
    if valid:
        files.status["last_checkpoint_step"] = valid[-1][0]
        files.status["last_checkpoint_time"] = ckpt.checkpoint_time(valid[-1][1])


def _raw_value(argv: list[str], config_path: str | None, key: str) -> str | None:
    """Best effort: a key's raw value when the config failed validation (to place status.json). Never raises:
    the file may be the very thing that could not be parsed."""
    flag = "--" + key.replace("_", "-")
    for i, arg in enumerate(argv):
        if arg in (flag, "--" + key) and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith((flag + "=", f"--{key}=")):
            return arg.split("=", 1)[1]
    if config_path:
        try:
            data = yaml.safe_load(Path(config_path).read_text())
        except (OSError, ValueError, yaml.YAMLError):
            return None
        if isinstance(data, dict) and data.get(key) is not None:
            return str(data[key])
    return None


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """`--config FILE` (or `--config=FILE`) and the rest, the `--key value` overrides.

    >>> split_config_arg(["--config", "t.yaml", "--max-seq-len", "8192"])
    ('t.yaml', ['--max-seq-len', '8192'])
    >>> split_config_arg(["--lr=1e-4", "--config=t.yaml"])
    ('t.yaml', ['--lr=1e-4'])
    """
    config_path, rest, value_of_config = None, [], False
    for i, arg in enumerate(argv):
        if value_of_config:
            value_of_config = False
        elif arg == "--config" and i + 1 < len(argv):
            config_path, value_of_config = argv[i + 1], True
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        else:
            rest.append(arg)  # an override, or a --config without its value: the config loader names it
    return config_path, rest


def main(argv: list[str]) -> int:
    """`python -m eagle3 train --config FILE [--key value ...]`: returns the process exit code."""
    config_path, rest = split_config_arg(argv)
    try:
        cfg = load_config(config_path, rest)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        raw_len = _raw_value(rest, config_path, "max_seq_len")
        run_dir = _raw_value(rest, config_path, "run_dir")
        _config_error_status(
            str(Path(run_dir) / "status.json") if run_dir else os.environ.get(STATUS_FILE_ENV),
            str(e),
            int(raw_len) if (raw_len or "").isdigit() else None,
        )
        return EXIT_CONFIG
    return Run(cfg).run()


class Run:
    """One start of the trainer process on one rank: set-up in the order that keeps GPU memory untouched until the
    data is known good, the training, and how it ended (the exit code and status.json's error record)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank = dist_utils.env_rank()[0]
        self.files = RunFiles(cfg.run_dir, enabled=self.rank == 0)
        self.files.status["max_seq_len"] = cfg.max_seq_len
        self.started_at = time.time()
        self.info: dist_utils.DistInfo | None = None
        self.watchdog: Watchdog | None = None
        self.observer: Observer | None = None

    def run(self) -> int:
        stop = StopRequested(lambda name: _second_signal(self.files, name, self.rank))
        stop.install()
        try:
            trainer = self.set_up(stop)
            trainer.build_model()
            return trainer.train()
        except BaseException as e:
            return self.ended_by(e)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.observer is not None:
                before = self.observer.tracker_state
                self.observer.close()
                # the tracker failed at its finish (after the last status.json write): status.json says so
                if self.observer.tracker_state is not before:
                    with contextlib.suppress(Exception):
                        self.files.update_status()
            if self.info is not None:
                with contextlib.suppress(Exception):
                    dist_utils.shutdown(self.info)

    def set_up(self, stop: StopRequested) -> Trainer:
        """Everything before the model: bad input exits 2 before CUDA or the process group take GPU memory."""
        cfg, files, rank = self.cfg, self.files, self.rank
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        check_tracker(cfg.tracker)  # a missing MLflow or W&B package: exit 2 on every rank, before any GPU work
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        dist_utils.set_cuda_alloc_conf()
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA device; use device: auto or cpu")
        describe = dist_utils.describe(cfg.device)
        host_malloc = dist_utils.keep_freed_host_memory(describe.device.type)
        hold_standin_device(cfg.standin_gpu_devices, rank)
        if rank == 0:
            ckpt.remove_stale(cfg.run_dir)
            dump_config(cfg, cfg.run_dir)
            _carry_over(files)
            files.update_status(phase="starting")
        trainer = Trainer(cfg, describe, files, stop)
        if host_malloc:
            trainer.log(host_malloc)
        if rank == 0:  # GPU telemetry, the Prometheus textfile, TensorBoard (eagle3.observe)
            self.observer = Observer(cfg, describe.device.type, trainer.log)
            files.observer = self.observer.start(lambda: files.status.get("step", 0))
            files.update_status()
        trainer.check_data()  # bad data exits 2 here, before CUDA or the process group take GPU memory
        self.join_ranks(trainer, describe)
        return trainer

    def join_ranks(self, trainer: Trainer, describe: dist_utils.DistInfo) -> None:
        """The process group, the nodes' shared run_dir, the hang watchdog and the memory limit."""
        cfg = self.cfg
        self.info = info = dist_utils.init(describe, timeout_s=cfg.collective_timeout_s)
        trainer.hosts = gather_hosts(info)  # each rank's host, for the per-node lines of status.json
        # More than one node: run_dir must be one shared directory (exit 2 naming the node that cannot see it).
        nodes_of = check_run_dir_shared(cfg, info)
        if trainer.run_options.hsdp:
            dist_utils.check_hsdp_groups(nodes_of, trainer.run_options.shard_ranks, trainer.log)
        # Every rank: from here on, no finished step within the bound ends the process with EXIT_HANG.
        self.watchdog = Watchdog(
            floor_s=cfg.watchdog_floor_s,
            factor=cfg.watchdog_factor,
            first_step_s=cfg.watchdog_first_step_s,
            checkpoint_s=cfg.watchdog_checkpoint_s,
            on_hang=lambda message: self.record_error("hang", message),
        ).start()
        trainer.watchdog = self.watchdog
        apply_memory_limit(cfg.memory_limit_gb, info.device)
        if info.device.type == "cuda" and dist_utils.expandable_segments_active() is False:
            trainer.log("warning: expandable_segments is not active in the CUDA allocator (PYTORCH_ALLOC_CONF)")

    def ended_by(self, e: BaseException) -> int:
        """The exit code for an exception out of the set-up or the loop, its record in status.json."""
        cfg = self.cfg
        if isinstance(e, ConfigError):
            print(f"config error: {e}", file=sys.stderr, flush=True)
            self.record_error("config", str(e))
            return EXIT_CONFIG
        if isinstance(e, StorageError):
            print(f"{e.kind}: {e}", file=sys.stderr, flush=True)
            self.record_error(e.kind, str(e), errno=e.errno_name, path=e.path)
            return EXIT_STORAGE
        if isinstance(e, SystemExit | KeyboardInterrupt) and not is_oom(e):
            raise e
        if is_oom(e):
            detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            message = f"out of memory at max_seq_len={cfg.max_seq_len}: {detail}"
            e.__traceback__ = None  # drop the exception's frames (they pin tensors) before touching memory again
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            print(f"OOM: {message}; lower max_seq_len or enable activation_checkpointing", file=sys.stderr, flush=True)
            self.record_error("oom", message)
            return EXIT_OOM
        traceback.print_exception(e)
        errno_name = ckpt.storage_errno(e)
        if errno_name:  # a write into run_dir outside a checkpoint (status, metrics): a restart cannot help either
            path = str(getattr(e, "filename", None) or cfg.run_dir)
            record = f"{path}: {errno_name}: {e}"[:2000]
            self.record_error(STORAGE_KINDS[errno_name], record, errno=errno_name, path=path)
            return EXIT_STORAGE
        self.record_error("crash", f"{type(e).__name__}: {e}"[:2000])
        return EXIT_CRASH

    def record_error(self, kind: str, message: str, **detail) -> None:
        """Any rank may record an OOM or a hang (the others only see a broken or waiting collective); rank 0
        records the rest. A crash or hang that follows another rank's OOM is its symptom, not recorded."""
        files, rank = self.files, self.rank
        if rank != 0 and kind not in ("oom", "hang"):
            return
        if kind == "crash" and rank == 0 and any(sign in message for sign in PEER_LOST):
            # Only a symptom: another rank ended first, and if it ran out of memory its record may still be on the
            # way (a loaded machine delays it). Give it a moment, so that the cause, not the symptom, is recorded.
            deadline = time.monotonic() + PEER_RECORD_WAIT_S
            while time.monotonic() < deadline and not _recent_oom(files, since=self.started_at):
                time.sleep(0.1)
        if kind in ("crash", "hang") and _recent_oom(files, since=self.started_at):
            return
        if rank != 0:  # keep rank 0's progress fields, add the error
            with contextlib.suppress(OSError, ValueError):
                files.status.update(json.loads((files.run_dir / "status.json").read_text()))
        files.enabled = True
        try:
            files.update_status(
                phase="failed",
                error={"kind": kind, "message": message, "max_seq_len": self.cfg.max_seq_len, **detail},
            )
        except OSError as e:  # a full disk: the journal still has the message
            print(f"status.json not updated ({e.strerror or e}): {kind}: {message}", file=sys.stderr, flush=True)


# A collective's error when another rank has gone (gloo, NCCL): the cause is that rank's, not this one's.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
PEER_RECORD_WAIT_S = 5.0


def _recent_oom(files: RunFiles, since: float) -> bool:
    """Whether another rank of this run already recorded an OOM in status.json."""
    try:
        status = json.loads((files.run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return False
    error = status.get("error") or {}
    return error.get("kind") == "oom" and status.get("updated", 0) >= since


def _second_signal(files: RunFiles, name: str, rank: int) -> None:
    print(f"second {name}: exiting at once without a checkpoint", flush=True)
    if rank == 0:
        with contextlib.suppress(Exception):
            files.update_status(
                phase="failed",
                error={
                    "kind": "crash",
                    "message": f"second {name}: exited at once without a checkpoint",
                    "max_seq_len": files.status.get("max_seq_len", 0),
                },
            )
