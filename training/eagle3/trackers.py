"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases, each through its own library.

`tracker: mlflow` logs to `mlflow_tracking_uri` (empty: a file store in run_dir/mlruns, which `mlflow ui
--backend-store-uri` opens); `tracker: wandb` writes an offline W&B run under run_dir/wandb that the user
uploads later with `wandb sync` (the trainer never sends anything anywhere). Rank 0's `Observer` feeds the tracker
the same scalars as TensorBoard (`eagle3.observe.tb_values`) and the GPU samples; a failing tracker is reported
once and training goes on, like every other sink.

The tracker run's id is kept in run_dir/tracker.json: a resumed start continues the same tracker run (the
config of each start is attached to it as an artifact), and `eagle3 export` attaches the export it writes.
A missing package is a config error at start, on every rank, before any GPU memory is taken. `python -m eagle3
check-tracker --config FILE` imports the package (check_importable) without torch, so that the Ansible role can ask
before it touches a run: exit 2 naming the tracker, the venv's Python and the fix, 0 when it imports.

A tracker that fails once training runs (its package breaks on import, or its init, a log call or its finish
raises) never stops training: rank 0 logs it once and status.json's `tracker` says so from then on:
{"name": "wandb", "ok": false, "error": "ImportError: ...", "at": "start" | "log" | "finish"} (ok true, error and
at null, while it works; null with `tracker: none`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.files import atomic_write_text
from eagle3.options import TRACKERS

# tracker -> (the module it imports, how to install it)
PACKAGES = {
    "mlflow": ("mlflow", "pip install mlflow-skinny (or mlflow) into the training venv"),
    "wandb": ("wandb", "pip install wandb into the training venv"),
}
RECORD_FILE = "tracker.json"
# How a run ended, as MLflow's run status.
MLFLOW_END = {"done": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def check_available(tracker: str) -> None:
    """A config error naming the package when `tracker` needs one this Python cannot import.

    >>> check_available("none")
    >>> check_available("nosuch")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: tracker='nosuch' is not one of none, mlflow, wandb
    """
    if tracker == "none":
        return
    if tracker not in PACKAGES:
        raise ConfigError(f"tracker={tracker!r} is not one of {', '.join(TRACKERS)}")
    module, how = PACKAGES[tracker]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"tracker={tracker!r} but the {module} package is not installed in {sys.executable}; {how}, "
            "or set tracker: none"
        )


def check_importable(tracker: str) -> str:
    """Import `tracker`'s package in this Python, as the trainer will (`eagle3 check-tracker`, for the Ansible role
    before it touches a run): a one-line description when it works, else ConfigError naming the tracker, this
    Python and the fix. Any exception at import counts (a broken install raises more than ImportError).

    >>> check_importable("none")
    'tracker: none (nothing to import)'
    >>> check_importable("nosuch")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: tracker='nosuch' is not one of none, mlflow, wandb
    """
    check_available(tracker)  # the tracker's name, and a package that is not there at all
    if tracker == "none":
        return "tracker: none (nothing to import)"
    module, how = PACKAGES[tracker]
    try:
        imported = importlib.import_module(module)
    except BaseException as e:  # SystemExit or any error in the package's own import code; never Ctrl-C
        if isinstance(e, KeyboardInterrupt):
            raise
        detail = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}".rstrip(": ")
        raise ConfigError(
            f"tracker={tracker!r} cannot be used: import {module} fails in {sys.executable} ({detail}); {how} "
            f"({sys.prefix}), or set tracker: none"
        ) from None
    version = getattr(imported, "__version__", "version unknown")
    return f"tracker: {tracker} ({module} {version}) imports in {sys.executable}"


def flat_params(config: dict) -> dict[str, str]:
    """The config as tracker parameters: one string per key, lists and mappings as JSON.

    >>> flat_params({"max_seq_len": 512, "standin_gpu_devices": ["/dev/nvidia0"], "init_from": ""})
    {'max_seq_len': '512', 'standin_gpu_devices': '["/dev/nvidia0"]', 'init_from': ''}
    """
    return {k: json.dumps(v) if isinstance(v, list | dict) else str(v) for k, v in config.items()}


def read_record(run_dir: str | os.PathLike) -> dict:
    """run_dir/tracker.json ({} when the run has no tracker run yet, or the file cannot be read)."""
    try:
        record = json.loads((Path(run_dir) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(run_dir: str | os.PathLike, record: dict) -> None:
    atomic_write_text(Path(run_dir) / RECORD_FILE, json.dumps(record, indent=1) + "\n")


def mlflow_client(uri: str):
    """MLflow's client for `uri`. A file store (our default: nothing to set up, beside the run) is in maintenance
    mode since MLflow 3 and refused unless MLFLOW_ALLOW_FILE_STORE says otherwise: for a `file:` URI we say so (a
    user who wants MLflow's newer features sets mlflow_tracking_uri to a database or a server)."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


class MlflowTracker:
    """One MLflow run per training run, through `MlflowClient` (no global active run)."""

    name = "mlflow"

    def __init__(self, config: dict, run_dir: Path, project: str, tracking_uri: str, record: dict):
        self.uri = tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow_client(self.uri)
        self.resumed = record.get("tracker") == "mlflow" and record.get("tracking_uri") == self.uri
        if self.resumed:
            self.run_id = record["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"run_dir": str(run_dir)})
            self.run_id = run.info.run_id
            # Parameters cannot change once logged: the first start's config; each start's is an artifact.
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in flat_params(config).items()]
            for i in range(0, len(params), 100):  # MLflow's limit of parameters per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.record = {"tracker": "mlflow", "run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, values: dict[str, float], step: int, timestamp_ms: int) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, timestamp_ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def attach(self, path: Path, folder: str) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), folder)
        else:
            self.client.log_artifact(self.run_id, str(path), folder)

    def finish(self, phase: str) -> None:
        self.client.set_terminated(self.run_id, status=MLFLOW_END.get(phase, "KILLED"))


class WandbTracker:
    """An offline W&B run under run_dir/wandb; `wandb sync run_dir/wandb/offline-run-*` uploads it later."""

    name = "wandb"

    def __init__(self, config: dict, run_dir: Path, project: str, record: dict):
        import wandb

        self.resumed = record.get("tracker") == "wandb"
        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project=project,
            name=run_dir.name,
            id=record["run_id"] if self.resumed else None,
            resume="allow" if self.resumed else None,
            config=config,
            allow_val_change=True,
            # Our log is the journal's: W&B neither copies the console nor samples the machine on its own.
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.record = {"tracker": "wandb", "run_id": self.run.id, "dir": str(Path(self.run.dir).parent)}

    def log(self, values: dict[str, float], step: int, timestamp_ms: int) -> None:
        # W&B's history is indexed by step and moves forward only: a step trained again after a resume is not
        # logged twice (TensorBoard and MLflow show the new values).
        if step >= (self.run.step or 0):
            self.run.log(values, step=step)

    def attach(self, path: Path, folder: str) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.name}-{folder}".replace("/", "-"), type=folder.split("/")[0])
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self, phase: str) -> None:
        self.run.finish(exit_code=0 if phase == "done" else 1)


def open_tracker(cfg, run_dir: Path, log: Callable[[str], None]):
    """Rank 0's tracker for this start (None when `tracker: none`): the run recorded in tracker.json continued, or
    a new one; the start's resolved config attached as `config/start-N.yaml`."""
    if cfg.tracker == "none":
        return None
    record = read_record(run_dir)
    config = cfg.to_dict()
    if cfg.tracker == "mlflow":
        tracker = MlflowTracker(config, run_dir, cfg.tracker_project, cfg.mlflow_tracking_uri, record)
        where = f"{tracker.uri}, run {tracker.run_id}"
    else:
        tracker = WandbTracker(config, run_dir, cfg.tracker_project, record)
        where = f"offline run {tracker.record['dir']} (upload: wandb sync {tracker.record['dir']})"
    write_record(run_dir, tracker.record)
    config_file = run_dir / "config.yaml"
    if config_file.is_file():
        starts = run_dir / ".tracker"
        starts.mkdir(exist_ok=True)
        staged = starts / f"start-{len(list(starts.glob('start-*.yaml'))) + 1}.yaml"
        staged.write_bytes(config_file.read_bytes())
        tracker.attach(staged, "config")
    log(f"tracker: {tracker.name}, {'continuing ' if tracker.resumed else ''}{where}")
    return tracker


def attach_export(run_dir: str | os.PathLike, out_dir: str | os.PathLike, log: Callable[[str], None]) -> None:
    """`eagle3 export`: attach the export to the run's tracker run, when it has one (a note when it cannot)."""
    record = read_record(run_dir)
    if record.get("tracker") not in PACKAGES:
        return
    try:
        check_available(record["tracker"])
        if record["tracker"] == "mlflow":  # the run's state is the trainer's to set; only the files are added
            mlflow_client(record["tracking_uri"]).log_artifacts(record["run_id"], str(out_dir), "export")
        else:  # an offline W&B run is appended to by another offline start of the same id
            tracker = WandbTracker({}, Path(run_dir), "", record)
            tracker.attach(Path(out_dir), "export")
            with contextlib.suppress(Exception):
                tracker.finish("done")
    except Exception as e:  # the export itself is written: say why the tracker has not got it
        log(f"warning: the export is not attached to the {record['tracker']} run ({type(e).__name__}: {e})")
        return
    log(f"tracker: the export is attached to the {record['tracker']} run {record['run_id']}")
