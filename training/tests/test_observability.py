"""What a run shows outside its log, from one short real CPU run: the report page (PNG + sidecar, HTML, two runs
compared, a truncated metrics line), the Prometheus textfile (parsed by prometheus_client), the GPU telemetry
saying "no GPU", TensorBoard off without the package, and the progress line with its ETA."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import struct
import zlib

import pytest
from eagle3.gpu_telemetry import TELEMETRY_FILE, GpuSampler
from eagle3.observe import PROM_FILE, Observer, prom_text
from eagle3.progress import Progress
from eagle3.report import PANELS
from pipeline_support import read_status, run_trainer, synth_dataset, write_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Six steps at max_seq_len 512 with a validation at step 3 and 6; returns (run_dir, log text)."""
    base = tmp_path_factory.mktemp("obs")
    data = synth_dataset(tmp_path_factory.getbasetemp())
    cfg = write_config(
        base / "train.yaml",
        data_dir=str(data),
        run_dir=str(base / "run"),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=6,
        warmup_steps=1,
        log_every=1,
        val_every=3,
        val_max_batches=2,
        checkpoint_every=1000,
        num_threads=1,
        prometheus_textfile_dir=str(base / "textfile"),
    )
    assert run_trainer(["train", "--config", str(cfg)], base / "log.txt") == 0, (base / "log.txt").read_text()
    return base / "run", (base / "log.txt").read_text()


def png_text_chunks(data: bytes) -> dict[str, str]:
    """tEXt/iTXt chunks of a PNG, checking every chunk's CRC on the way (a valid PNG, not only its magic)."""
    assert data[:8] == PNG_MAGIC
    pos, chunks, kinds = 8, {}, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        kinds.append(kind)
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            value = rest[2:].split(b"\0", 2)[2]
            chunks[key.decode("latin-1")] = value.decode("utf-8")
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    return chunks


def report(args, tmp_path):
    return run_trainer(["report", *args], tmp_path / "report.log"), (tmp_path / "report.log").read_text()


# --------------------------------------------------------------------------------------------- report
@pytest.mark.slow  # the module's real training run
def test_report_of_a_real_run_is_a_png_with_every_panel(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "r" / "report.png"
    rc, log = report([str(run_dir), "-o", str(out)], tmp_path)
    assert rc == 0, log
    text = png_text_chunks(out.read_bytes())
    sidecar = json.loads(out.with_suffix(".json").read_text())
    for title in PANELS:
        assert title in text["Description"]
    assert sidecar["panels"] == list(PANELS)
    assert len(PANELS) == 8
    (info,) = sidecar["runs"]
    assert (info["phase"], info["step"], info["max_seq_len"]) == ("done", 6, 512)
    assert info["train_records"] == 6 and info["val_records"] == 2
    assert info["planned_peak_gb"] > 0  # the planner's prediction for the run's own config
    assert sidecar["skipped"] == []
    assert f"wrote {out}" in log


@pytest.mark.slow  # the module's real training run
def test_report_skips_a_truncated_line_and_names_it(run, tmp_path):
    run_dir, _ = run
    copy = tmp_path / "cut"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(2, "not json at all\n")
    (copy / "metrics.jsonl").write_text("".join(lines) + lines[-2][: len(lines[-2]) // 2])  # killed mid-write
    out = tmp_path / "cut.png"
    rc, log = report([str(copy), "-o", str(out)], tmp_path)
    assert rc == 0, log
    png_text_chunks(out.read_bytes())
    skipped = json.loads(out.with_suffix(".json").read_text())["skipped"]
    n = len(lines) + 1
    assert skipped == [
        "cut: metrics.jsonl line 3 skipped: truncated or not JSON (Expecting value: line 1 column 1 (char 0))",
        next(s for s in skipped if s.startswith(f"cut: metrics.jsonl line {n} skipped: truncated or not JSON")),
    ]
    assert "report: cut: metrics.jsonl line 3 skipped" in log and f"metrics.jsonl line {n} skipped" in log


@pytest.mark.slow  # the module's real training run
def test_two_runs_on_one_page_and_html(run, tmp_path):
    run_dir, _ = run
    empty = tmp_path / "starting"
    empty.mkdir()
    (empty / "status.json").write_text(json.dumps({"phase": "starting", "step": 0, "max_seq_len": 1024}))
    out = tmp_path / "both.html"
    rc, log = report([str(run_dir), str(empty), "--label", "msl512", "--label", "msl1024", "-o", str(out)], tmp_path)
    assert rc == 0, log
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
    for title in PANELS:
        assert title in page
    assert "msl512: max_seq_len 512, done" in page and "msl1024: max_seq_len 1024, starting" in page
    assert "metrics.jsonl has no records yet" in page


def test_report_refuses_a_missing_run_dir(tmp_path):
    rc, log = report([str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")], tmp_path)
    assert rc == 2 and "is not a directory" in log


# --------------------------------------------------------------------------------------------- the run's sinks
@pytest.mark.slow  # the module's real training run
def test_prometheus_textfile_parses_and_carries_the_run(run):
    from prometheus_client.parser import text_string_to_metric_families

    run_dir, _ = run
    text = (run_dir.parent / "textfile" / PROM_FILE).read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value: dict[str, dict] = {}
    for family in families.values():
        for sample in family.samples:
            value.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value

    def one(name, **labels):
        return value[name][tuple(sorted({"run": "run", **labels}.items()))]

    assert one("eagle3_train_step") == 6 and one("eagle3_train_max_steps") == 6
    assert one("eagle3_train_state", state="done") == 1 and one("eagle3_train_state", state="training") == 0
    assert one("eagle3_train_last_checkpoint_step") == 6
    assert one("eagle3_train_tokens_per_second") > 0 and one("eagle3_train_loss") > 0
    assert 0 <= one("eagle3_train_full_accuracy_ratio", ttt_step="1") <= 1
    assert one("eagle3_train_peak_memory_bytes", rank="0", kind="rss") > 2**20
    assert one("eagle3_train_acceptance_length_tokens") >= 1
    assert families["eagle3_train_tokens"].type == "counter"  # the parser strips _total from a counter's name
    assert one("eagle3_train_tokens_total") > 0
    assert not any(name.startswith("eagle3_gpu_") for name in families)  # no GPU: nothing made up
    assert not list((run_dir.parent / "textfile").glob(".*"))  # the temp file was renamed, not left behind


@pytest.mark.slow  # the module's real training run
def test_cpu_run_records_no_gpu_and_says_what_is_off(run):
    run_dir, log = run
    (record,) = [json.loads(line) for line in (run_dir / TELEMETRY_FILE).read_text().splitlines()]
    assert record["gpus"] == [] and record["note"] == "no GPU"
    assert "gpu telemetry: no GPU (device cpu)" in log
    assert not [line for line in log.splitlines() if line.startswith("warning:")]  # every sink wrote
    assert "progress: step 1/6 (16.7%)" in log and "eta" in log
    if importlib.util.find_spec("tensorboard") is None:
        assert "tensorboard: off (the tensorboard package is not installed" in log
        assert not (run_dir / "tensorboard").exists()
    else:
        assert "tensorboard: event files in" in log
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert read_status(run_dir)["phase"] == "done"


def test_gpu_samples_carry_the_starvation_flag_into_the_textfile(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    gpus = [
        {
            "index": 0,
            "power_w": 200.0,
            "power_limit_w": 600.0,
            "util_pct": 99.0,
            "sm_clock_mhz": 1980.0,
            "memory_used_bytes": 2.0**34,
            "memory_total_bytes": 2.0**37,
        }
    ]
    from eagle3.gpu_telemetry import gpu_sample

    sampler = GpuSampler(tmp_path, 0, lambda: 7, lambda: [gpu_sample(**g) for g in gpus], "nvml")
    sample = sampler.sample_once()
    assert json.loads((tmp_path / TELEMETRY_FILE).read_text())["gpus"][0]["starved"] is True
    text = prom_text({"phase": "training", "step": 7}, None, None, sample, 0.0, "r")
    values = {(s.name, s.labels.get("gpu")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values[("eagle3_gpu_starved", "0")] == 1
    assert values[("eagle3_gpu_utilization_ratio", "0")] == pytest.approx(0.99)
    assert values[("eagle3_gpu_sm_clock_hertz", "0")] == pytest.approx(1.98e9)


def test_a_failing_sink_is_reported_once_and_training_goes_on(tmp_path):
    from eagle3.config import TrainConfig

    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = TrainConfig(
        data_dir="d",
        run_dir=str(tmp_path / "run"),
        max_seq_len=512,
        prometheus_textfile_dir=str(blocker / "sub"),
        tensorboard=False,
        telemetry_every_s=0,
    )
    lines = []
    obs = Observer(cfg, "cpu", lines.append).start(lambda: 0)
    obs.on_status({"phase": "training", "step": 1})
    obs.on_status({"phase": "training", "step": 2})
    assert [line for line in lines if line.startswith("warning")] == [
        next(line for line in lines if line.startswith("warning: prometheus textfile not written"))
    ]
    assert "tensorboard: off (tensorboard: false)" in lines


# --------------------------------------------------------------------------------------------- progress bars
class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise():
    t = [0.0]
    plain = io.StringIO()
    p = Progress(20, "synth", stream=plain, clock=lambda: t[0])
    for _ in range(20):
        t[0] += 1
        p.update()
    p.close()
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert lines[0] == "synth: 2/20 (10%), eta 18s" and lines[-1] == "synth: 20/20 (100%) in 20s"
    assert len(lines) == 10  # every 10 % up to 90 %, then the end
    tty = Tty()
    p = Progress(4, "import", stream=tty, clock=lambda: t[0])
    for _ in range(4):
        p.update()
    p.close()
    assert tty.getvalue().count("\r") >= 4 and "import [" in tty.getvalue() and tty.getvalue().endswith("\n")


def test_synth_writes_plain_progress_lines_when_not_on_a_terminal(tmp_path):
    log = tmp_path / "synth.log"
    rc = run_trainer(["synth", str(tmp_path / "d"), "--num-samples", "16", "--max-len", "200"], log)
    text = log.read_text()
    assert rc == 0, text
    assert "\r" not in text
    assert re.search(r"^synth: documents: 16/16 \(100%\) in \S+$", text, re.M), text


def test_nvml_reader_converts_units_and_flags_starvation(monkeypatch):
    """NVML reports milliwatts and MHz; the samples hold watts and MHz, with the starvation flag (a stand-in
    pynvml module: this machine has no GPU)."""
    import sys
    import types

    import torch
    from eagle3.gpu_telemetry import nvml_reader

    fake = types.ModuleType("pynvml")
    fake.NVMLError = type("NVMLError", (Exception,), {})
    fake.NVML_CLOCK_SM = 1
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetPowerUsage = lambda h: [250_000, 500_000][h]
    fake.nvmlDeviceGetEnforcedPowerLimit = lambda h: 600_000
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=100, memory=30)
    fake.nvmlDeviceGetClockInfo = lambda h, kind: 1500 if kind == 1 else 0

    def no_memory(h):
        raise fake.NVMLError("not supported")

    fake.nvmlDeviceGetMemoryInfo = no_memory
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    read, how = nvml_reader()
    assert how == "nvml"
    first, second = read()
    assert (first["power_w"], first["power_limit_w"], first["util_pct"], first["sm_clock_mhz"]) == (
        250.0,
        600.0,
        100.0,
        1500.0,
    )
    assert first["memory_used_bytes"] is None  # not supported: absent, not made up
    assert first["starved"] is True and second["starved"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nvml_reader() == (None, "no GPU")


@pytest.mark.slow  # the module's real training run
def test_the_grafana_dashboard_queries_only_metrics_the_trainer_writes(run):
    """dashboards/eagle3-training.json: every metric name in its queries is one the textfile carries (a real run's
    file, plus the GPU families from a sample, which a CPU run has none of)."""
    from pathlib import Path

    from eagle3.gpu_telemetry import gpu_sample
    from prometheus_client.parser import text_string_to_metric_families

    run_dir, _ = run
    gpu = {
        "gpus": [
            gpu_sample(
                0,
                power_w=250.0,
                power_limit_w=600.0,
                util_pct=99.0,
                sm_clock_mhz=1.0,
                memory_used_bytes=1.0,
                memory_total_bytes=2.0,
            )
        ]
    }
    texts = [(run_dir.parent / "textfile" / PROM_FILE).read_text(), prom_text({}, None, None, gpu, 0.0, "r")]
    written = {s.name for text in texts for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((Path(__file__).parents[2] / "dashboards" / "eagle3-training.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    used = {name for e in exprs for name in re.findall(r"\beagle3_[a-z0-9_]+", e)}
    assert used and used <= written, sorted(used - written)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("loss", "acceptance", "throughput", "gpu power vs utilisation", "restarts", "stall"):
        assert topic in titles, topic
