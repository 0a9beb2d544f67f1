"""Checkpoint directories, status.json and stand-in devices, each checked on the files a user would look at."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading

import pytest
import torch
from eagle3 import checkpoint as ckpt
from eagle3.errors import ConfigError
from eagle3.metrics import STAT_KEYS, RunFiles, StatAccumulator, console_line, summarize
from eagle3.standin import hold_standin_device


def _save(run_dir, step, keep=3, weight=1.0):
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, weight)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tmp = ckpt.tmp_dir_for(run_dir, step)
    tmp.mkdir(parents=True)
    ckpt.write_rng(tmp, 0)
    state = ckpt.TrainerState(
        step=step, epoch=0, step_in_epoch=step, samples_seen=step, world_size=1, max_seq_len=128, seed=0
    )
    ckpt.write_main(tmp, ckpt.trainable_state(model), opt.state_dict(), sched, state, {"seed": 0})
    return ckpt.finalize(run_dir, step, keep)


def test_checkpoint_is_complete_and_old_ones_are_pruned(tmp_path):
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep=2, weight=step)
    assert [s for s, _ in ckpt.list_valid(tmp_path)] == [30, 40]
    newest = ckpt.newest_valid(tmp_path)
    assert newest.name == "step_00000040"
    assert sorted(p.name for p in newest.iterdir()) == [
        "COMPLETE",
        "config.json",
        "model.safetensors",
        "optimizer.pt",
        "rng_rank0.pt",
        "trainer_state.json",
    ]
    assert ckpt.load_model_state(newest)["weight"].eq(40).all()
    assert ckpt.read_state(newest).step == 40


def test_unmarked_and_temporary_directories_are_ignored_then_removed(tmp_path):
    _save(tmp_path, 5)
    unmarked = ckpt.checkpoints_dir(tmp_path) / ckpt.step_dir_name(9)
    unmarked.mkdir()
    (unmarked / "model.safetensors").write_bytes(b"half")
    ckpt.tmp_dir_for(tmp_path, 12).mkdir()
    assert ckpt.newest_valid(tmp_path).name == "step_00000005"
    assert sorted(ckpt.remove_stale(tmp_path)) == [".tmp_step_00000012", "step_00000009"]
    assert [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()] == ["step_00000005"]


def test_best_is_a_complete_copy_that_survives_pruning(tmp_path):
    first = _save(tmp_path, 1, keep=1, weight=1)
    ckpt.save_best(tmp_path, first)
    _save(tmp_path, 2, keep=1, weight=2)
    assert not first.exists()
    best = ckpt.checkpoints_dir(tmp_path) / ckpt.BEST
    assert (best / ckpt.MARKER).is_file()
    assert ckpt.load_model_state(best)["weight"].eq(1).all()
    assert ckpt.newest_valid(tmp_path).name == "step_00000002"  # best is not a step directory


def test_rng_round_trip(tmp_path):
    torch.manual_seed(7)
    tmp = tmp_path / "c"
    tmp.mkdir()
    ckpt.write_rng(tmp, 3)
    expected = torch.rand(3)
    torch.manual_seed(99)
    assert ckpt.restore_rng(tmp, 3)
    assert torch.equal(torch.rand(3), expected)
    assert not ckpt.restore_rng(tmp, 4)


def test_stats_accumulate_and_summarize():
    acc = StatAccumulator(ttt_steps=2)
    one = {k: torch.zeros(2, dtype=torch.float64) for k in STAT_KEYS}
    one["count"] = torch.tensor([10.0, 10.0], dtype=torch.float64)
    one["loss_sum"] = torch.tensor([20.0, 30.0], dtype=torch.float64)
    one["full_acc_sum"] = torch.tensor([5.0, 2.0], dtype=torch.float64)
    one["cond_acc_sum"] = torch.tensor([5.0, 2.0], dtype=torch.float64)
    one["cond_acc_count"] = torch.tensor([10.0, 5.0], dtype=torch.float64)
    acc.add_stats(one)
    acc.add_stats(one)
    s = summarize(acc.stats)
    assert s["loss"] == [2.0, 3.0]
    assert s["full_acc"] == [0.5, 0.2]
    assert s["cond_acc"] == [0.5, 0.4]
    assert s["cond_acc_true"] == [None, None]  # no positions counted: no rate, not zero


def test_console_line_is_dense_and_has_units():
    line = console_line(
        {
            "step": 120,
            "max_steps": 1000,
            "epoch": 0,
            "loss_per_step": [1.5, 2.0],
            "full_acc": [0.6, 0.3],
            "full_acc_true": [0.58, 0.29],
            "tokens_per_s": 24000.0,
            "tokens_per_s_per_rank": 12000.0,
            "step_time_s": 0.25,
            "time_split": {"fetch": 0.01, "fwd": 0.09, "bwd": 0.14, "opt": 0.01},
            "peak_mem_gb": 1.5,
            "mem_kind": "rss",
            "eta_s": 220.0,
        }
    )
    assert "step 120/1000" in line and "24,000 tok/s" in line and "250 ms/step" in line
    assert "fwd 36%" in line and "mem 1.50 GB rss" in line and "eta 3m40s" in line


def test_status_json_is_replaced_atomically(tmp_path):
    files = RunFiles(tmp_path)
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            try:
                json.loads((tmp_path / "status.json").read_text())
            except FileNotFoundError:
                pass
            except ValueError as e:  # a torn read would show up here
                bad.append(e)

    files.update_status(phase="training")
    t = threading.Thread(target=reader)
    t.start()
    for step in range(300):
        files.update_status(
            step=step, loss=1.0 / (step + 1), time_split={"fetch": 0.1, "fwd": 0.2, "bwd": 0.3, "opt": 0.0}
        )
    stop.set()
    t.join()
    assert not bad
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["step"] == 299 and status["phase"] == "training" and status["pid"] == os.getpid()
    assert not [p for p in tmp_path.iterdir() if p.name != "status.json"]  # no temporary files left


HOLDER = """
import sys, time
from eagle3.standin import hold_standin_device
print(hold_standin_device(sys.argv[2:], int(sys.argv[1])), flush=True)
time.sleep(60)
"""


def test_standin_device_shows_in_fd_and_maps(tmp_path):
    devices = [tmp_path / "nvidia0", tmp_path / "nvidia1"]
    for d in devices:
        d.write_bytes(b"")  # empty, as a freshly created stand-in
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "3", *map(str, devices)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ckpt.Path(__file__).resolve().parents[1])},
    )
    try:
        assert proc.stdout.readline().strip() == str(devices[1])  # rank 3 % 2 devices
        fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        maps = (ckpt.Path(f"/proc/{proc.pid}/maps")).read_text()
        assert str(devices[1]) in fds and str(devices[1]) in maps
        assert str(devices[0]) not in fds
        assert devices[1].stat().st_size == mmap.PAGESIZE
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_missing_standin_device_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"nvidia7.*cannot be opened"):
        hold_standin_device([str(tmp_path / "nvidia7")], 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_standin_character_node_is_held_with_o_path(tmp_path):
    node = tmp_path / "nvidia0"
    os.mknod(node, 0o600 | 0o020000, os.makedev(195, 0))  # S_IFCHR: no driver behind it, open() gives ENXIO
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "0", str(node)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ckpt.Path(__file__).resolve().parents[1])},
    )
    try:
        assert proc.stdout.readline().strip() == str(node)
        fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        assert str(node) in fds
    finally:
        proc.kill()
        proc.wait(timeout=10)
