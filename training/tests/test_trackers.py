"""The run's curves where people look at them, read back with each tool's own reader: TensorBoard's
EventAccumulator over a real tiny run that died past its checkpoint and resumed (one curve per tag, no doubled
stretch, the values of the start that counts), GPU samples as TensorBoard scalars, an MLflow file store through
MLflow's client and an offline W&B run through W&B's protobuf records (the same metrics at the same steps as
metrics.jsonl, the config, the export as an artifact), and a missing tracker package refused at start."""

from __future__ import annotations

import json
import shutil
import struct
import zlib

import pytest
from eagle3 import checkpoint as ckpt
from eagle3.gpu_telemetry import gpu_sample
from eagle3.observe import TENSORBOARD_DIR, Observer, tb_values
from pipeline_support import read_metrics, run_trainer, synth_dataset, write_config

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is in requirements/train.txt; scripts/setup.sh installs it",
)


def scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard shows for the folder: tag -> {step: value} (after its purges)."""
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step shown twice {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


@pytest.mark.slow
def test_tensorboard_curves_continue_across_a_resume_without_the_steps_trained_again(tmp_path):
    """The same run also logs to MLflow: the resumed start continues the first start's MLflow run."""
    data = synth_dataset(tmp_path)
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "train.yaml",
        data_dir=str(data),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=4,
        warmup_steps=1,
        log_every=1,
        val_every=2,
        val_max_batches=1,
        checkpoint_every=2,
        num_threads=1,
        telemetry_every_s=0,
        tracker="mlflow",
    )
    assert run_trainer(["train", "--config", str(cfg)], tmp_path / "a.txt", timeout=180) == 0
    first = {r["step"]: r for r in read_metrics(run)}
    assert sorted(first) == [1, 2, 3, 4]
    # As if the first start had died after logging steps 3 and 4 but before its step-4 checkpoint was complete.
    shutil.rmtree(ckpt.checkpoints_dir(run) / "step_00000004")
    log = tmp_path / "b.txt"
    first_mlflow = json.loads((run / "tracker.json").read_text())
    assert run_trainer(["train", "--config", str(cfg)], log, timeout=180) == 0
    assert "(curves continue after step 2)" in log.read_text()
    assert (
        f"tracker: mlflow, continuing {first_mlflow['tracking_uri']}, run {first_mlflow['run_id']}" in log.read_text()
    )
    assert json.loads((run / "tracker.json").read_text()) == first_mlflow
    assert len(list((run / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2  # one file per start

    shown = scalars(run / TENSORBOARD_DIR)
    train = read_metrics(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 3, 4]
    latest = {r["step"]: r for r in train}  # the records of the start that counts, step by step
    assert latest[3] is not first[3] and latest[3]["step_time_s"] != first[3]["step_time_s"]
    for step, record in latest.items():
        for tag, value in tb_values(record).items():
            assert shown[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)
    for tag in (
        "train/loss",
        "train/full_acc_0",
        "train/full_acc_1",
        "train/tokens_per_s",
        "train/time_split/fwd",
        "train/peak_mem_gb",
        "train/lr",
    ):
        assert sorted(shown[tag]) == [1, 2, 3, 4], tag
    vals = read_metrics(run, "val")
    assert {r["step"] for r in vals} == {2, 4}
    assert shown["val/acceptance_length"][4] == pytest.approx(vals[-1]["acceptance_length"], rel=1e-6)

    from eagle3.trackers import mlflow_client

    client = mlflow_client(first_mlflow["tracking_uri"])
    assert client.get_run(first_mlflow["run_id"]).info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(first_mlflow["run_id"], "train/loss")]
    assert [step for step, _ in history] == [
        1,
        2,
        3,
        4,
        3,
        4,
    ]  # append-only: both values of a step trained again
    assert {a.path for a in client.list_artifacts(first_mlflow["run_id"], "config")} == {
        "config/start-1.yaml",
        "config/start-2.yaml",
    }


def test_gpu_power_and_utilisation_reach_tensorboard(tmp_path):
    from eagle3.config import TrainConfig

    cfg = TrainConfig(data_dir="d", run_dir=str(tmp_path / "run"), max_seq_len=512, telemetry_every_s=0)
    obs = Observer(cfg, "cpu", lambda line: None).start(lambda: 0)
    obs.on_status({"phase": "training", "step": 0, "resumed_from_step": None})
    gpu = gpu_sample(
        index=0,
        power_w=250.0,
        power_limit_w=600.0,
        util_pct=100.0,
        sm_clock_mhz=1500.0,
        memory_used_bytes=2.0**33,
        memory_total_bytes=2.0**37,
    )
    obs.on_sample({"step": 5, "gpus": [gpu]})
    obs.close()
    shown = scalars(tmp_path / "run" / TENSORBOARD_DIR)
    assert shown["gpu0/power_w"] == {5: 250.0} and shown["gpu0/util_pct"] == {5: 100.0}
    assert shown["gpu0/starved"] == {5: 1.0}


def tiny_tracked_run(tmp_path, tracker: str):
    """Three logged steps and a validation of a real tiny run with `tracker`, then its export: (run_dir, log)."""
    data = synth_dataset(tmp_path)
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "train.yaml",
        data_dir=str(data),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=3,
        warmup_steps=1,
        log_every=1,
        val_every=3,
        val_max_batches=1,
        checkpoint_every=1000,
        num_threads=1,
        telemetry_every_s=0,
        tensorboard=False,
        tracker=tracker,
        tracker_project="tiny",
    )
    assert run_trainer(["train", "--config", str(cfg)], tmp_path / "train.txt", timeout=240) == 0
    verifier = ["--verifier", "org/target", "--verifier-arch", "LlamaForCausalLM"]
    out = tmp_path / "export"
    assert run_trainer(["export", str(run), str(out), *verifier], tmp_path / "export.txt", timeout=240) == 0
    return run, (tmp_path / "train.txt").read_text() + (tmp_path / "export.txt").read_text()


def expected_scalars(run) -> dict[str, dict[int, float]]:
    """What metrics.jsonl says, as tracker series: tag -> {step: value}."""
    out: dict[str, dict[int, float]] = {}
    for kind in ("train", "val"):
        for record in read_metrics(run, kind):
            for tag, value in tb_values(record).items():
                out.setdefault(tag, {})[record["step"]] = value
    return out


@pytest.mark.slow
def test_an_mlflow_file_store_run_holds_the_metrics_the_config_and_the_export(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow-skinny is in requirements/train.txt; scripts/setup.sh installs it")
    from eagle3.trackers import mlflow_client

    run, log = tiny_tracked_run(tmp_path, "mlflow")
    record = json.loads((run / "tracker.json").read_text())
    assert record["tracking_uri"] == (run / "mlruns").as_uri()
    assert f"tracker: mlflow, {record['tracking_uri']}, run {record['run_id']}" in log
    assert f"tracker: the export is attached to the mlflow run {record['run_id']}" in log
    client = mlflow_client(record["tracking_uri"])
    mlrun = client.get_run(record["run_id"])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert client.get_experiment(mlrun.info.experiment_id).name == "tiny"
    assert mlrun.data.params["max_seq_len"] == "512" and mlrun.data.params["tracker"] == "mlflow"
    expected = expected_scalars(run)
    assert set(mlrun.data.metrics) == set(expected)
    for tag, series in expected.items():
        history = {m.step: m.value for m in client.get_metric_history(record["run_id"], tag)}
        assert history == pytest.approx(series, rel=1e-6), tag
    assert sorted(expected["train/loss"]) == [1, 2, 3] and "val/acceptance_length" in expected
    artifacts = {a.path for folder in ("config", "export") for a in client.list_artifacts(record["run_id"], folder)}
    assert {"config/start-1.yaml", "export/config.json", "export/model.safetensors"} <= artifacts


def wandb_records(path):
    """The records of a W&B transaction log (run-ID.wandb), decoded by W&B's own protobuf classes.

    W&B 0.31 ships no Python reader of the file (its Go core reads it), so this frames it: LevelDB's log format, as
    W&B writes it (a 7-byte file header `:W&B`, magic 0xBEE1, version 0; 32 KiB blocks; each chunk a 7-byte header
    of CRC-32, length and type FULL/FIRST/MIDDLE/LAST; a block's tail under 7 bytes is padding).
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad CRC at {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir) -> list[dict]:
    """The history rows of the offline W&B run(s) under run_dir."""
    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in requirements/train.txt; scripts/setup.sh installs it")
    run, log = tiny_tracked_run(tmp_path, "wandb")
    record = json.loads((run / "tracker.json").read_text())
    assert f"tracker: wandb, offline run {record['dir']} (upload: wandb sync {record['dir']})" in log
    assert f"tracker: the export is attached to the wandb run {record['run_id']}" in log
    expected = expected_scalars(run)
    logged: dict[str, dict[int, float]] = {}
    for row in wandb_history(run):
        for tag, value in row.items():
            if not tag.startswith("_"):
                logged.setdefault(tag, {})[row["_step"]] = value
    assert set(logged) == set(expected)
    for tag, series in expected.items():
        assert logged[tag] == pytest.approx(series, rel=1e-6), tag
    configs = [
        r.run.config
        for p in run.glob("wandb/offline-run-*/run-*.wandb")
        for r in wandb_records(p)
        if r.WhichOneof("record_type") == "run"
    ]
    values = {item.key: json.loads(item.value_json) for c in configs for item in c.update}
    artifacts = [
        r.artifact
        for p in run.glob("wandb/offline-run-*/run-*.wandb")
        for r in wandb_records(p)
        if r.WhichOneof("record_type") == "artifact"
    ]
    assert sorted(a.type for a in artifacts) == ["config", "export"]
    assert values["max_seq_len"] == 512 and values["tracker"] == "wandb"


def test_a_tracker_whose_package_is_missing_is_a_config_error_naming_it(monkeypatch):
    import importlib.util

    from eagle3.errors import ConfigError
    from eagle3.trackers import check_available

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(
        ConfigError,
        match=r"tracker='wandb' but the wandb package is not installed in .*pip install "
        r"wandb into the training venv, or set tracker: none",
    ):
        check_available("wandb")
