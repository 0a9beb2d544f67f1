"""The hang watchdog: its bound, its firing (stacks, status, exit 4) and a real trainer that hangs and is restarted."""

from __future__ import annotations

import doctest
import signal
import threading
import time

import pytest
import torch
from eagle3 import watchdog as wd
from eagle3.config import load_config
from eagle3.errors import EXIT_CRASH, EXIT_HANG, ConfigError
from pipeline_support import TRAINING_ROOT, read_status, reap, synth_dataset, trainer_env, write_config


def test_docstring_examples():
    result = doctest.testmod(wd)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------------------------ the bound
def test_bound_is_the_floor_for_fast_steps_and_a_multiple_of_the_median_for_slow_ones():
    assert wd.step_bound([0.2] * 5, floor_s=300, factor=10) == 300
    assert wd.step_bound([40.0] * 5, floor_s=300, factor=10) == 400
    # One slow step (a checkpoint's page-cache flush, a straggler) barely moves the median.
    assert wd.step_bound([40.0, 41.0, 39.0, 40.0, 900.0], floor_s=300, factor=10) == 400
    assert wd.step_bound([], floor_s=300, factor=10) == 300


def test_first_step_has_its_own_bound_then_measured_steps_decide():
    dog = wd.Watchdog(floor_s=300, factor=10, first_step_s=1800, checkpoint_s=900)
    assert dog.bound() == 1800  # nothing measured yet: model build, resume, compile
    for _ in range(3):
        dog.step_times.append(50.0)
    assert dog.bound() == 500
    for _ in range(wd.HISTORY):
        dog.step_times.append(4.0)  # the slow early steps age out of the window
    assert dog.bound() == 300


def test_defaults_never_fire_on_a_slow_cpu_run():
    cfg = load_config(None, ["--data-dir", "/d", "--run-dir", "/r"])
    # The local demo runs ~4 s per step on a busy machine: bound 300 s, 75 x the step time.
    assert wd.step_bound([4.0] * 10, cfg.watchdog_floor_s, cfg.watchdog_factor) == 300
    assert cfg.watchdog_first_step_s >= 1800 and cfg.watchdog_checkpoint_s >= 1800
    assert cfg.collective_timeout_s == 600


@pytest.mark.parametrize(
    ("override", "words"),
    [
        (["--watchdog-factor", "0.5"], ["watchdog_factor=0.5"]),
        (["--watchdog-floor-s", "-1"], ["watchdog_floor_s=-1"]),
        (["--watchdog-first-step-s", "0"], ["watchdog_first_step_s=0"]),
        (["--collective-timeout-s", "0"], ["collective_timeout_s=0"]),
    ],
)
def test_watchdog_keys_are_validated(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--data-dir", "/d", "--run-dir", "/r", *override])
    for word in words:
        assert word in str(info.value)


# ------------------------------------------------------------------------------------------ firing, in process
class Exits:
    def __init__(self):
        self.codes = []
        self.event = threading.Event()

    def __call__(self, code):
        self.codes.append(code)
        self.event.set()


def _dog(tmp_path, **kw):
    stream = (tmp_path / "stderr.txt").open("w")
    exits = Exits()
    hangs = []
    values = dict(floor_s=0.5, factor=2, first_step_s=2.0, checkpoint_s=3.0, on_hang=hangs.append)
    values.update(kw)
    dog = wd.Watchdog(**values, stream=stream, backstop=False, exit_fn=exits)
    return dog, exits, hangs, stream


def _a_stuck_step_for_the_stack_dump(event, seconds):
    event.wait(seconds)


def test_fires_with_stacks_status_message_and_exit_4(tmp_path):
    dog, exits, hangs, stream = _dog(tmp_path)
    dog.start()
    try:
        for _ in range(5):
            time.sleep(0.02)
            dog.step_done(0.02)  # median 0.02 s: the floor (0.5 s) is the bound
        stuck = threading.Thread(
            target=_a_stuck_step_for_the_stack_dump, args=(exits.event, 30), name="stuck", daemon=True
        )
        stuck.start()
        assert exits.event.wait(20)
    finally:
        dog.stop()
        stream.close()
    assert exits.codes == [EXIT_HANG]
    assert len(hangs) == 1 and hangs[0].startswith("no step for ")
    assert "(expected about 0.0 s; bound 0.5 s)" in hangs[0]
    text = (tmp_path / "stderr.txt").read_text()
    assert f"hang: {hangs[0]}" in text and "then exit 4" in text
    assert "most recent call first" in text and "_a_stuck_step_for_the_stack_dump" in text


@pytest.mark.slow
def test_steps_on_time_and_a_long_checkpoint_within_its_bound_do_not_fire(tmp_path):
    # Bounds with seconds of slack: a loaded machine may deschedule this test for a while, and a test that says
    # "does not fire" must not fire then either.
    dog, exits, hangs, stream = _dog(tmp_path, floor_s=3.0, checkpoint_s=12.0)
    dog.start()
    try:
        for _ in range(10):
            time.sleep(0.05)
            dog.step_done(0.05)
        with dog.phase("checkpoint at step 10", 12.0):
            time.sleep(4.5)  # past the step bound (3 s), within the checkpoint's
        for _ in range(5):
            time.sleep(0.05)
            dog.touch("validation at step 10")
    finally:
        dog.stop()
        stream.close()
    time.sleep(3.5)  # past any step bound: stopped means stopped
    assert exits.codes == [] and hangs == []


def test_a_checkpoint_past_its_bound_fires_and_says_so(tmp_path):
    dog, exits, hangs, stream = _dog(tmp_path, checkpoint_s=0.3)
    dog.start()
    try:
        dog.step_done(0.01)
        with dog.phase("checkpoint at step 1", 0.3):
            assert exits.event.wait(20)
    finally:
        dog.stop()
        stream.close()
    assert exits.codes == [EXIT_HANG]
    assert "checkpoint at step 1 did not finish within its bound of 0.3 s" in hangs[0]


def test_exits_even_when_recording_the_hang_fails_or_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "ON_HANG_GRACE_S", 0.3)
    release = threading.Event()

    def blocked(message):
        release.wait(30)  # a status.json write on a hung filesystem

    dog, exits, _hangs, stream = _dog(tmp_path, first_step_s=0.2, on_hang=blocked)
    dog.start()
    try:
        assert exits.event.wait(20)
        assert exits.codes == [EXIT_HANG]
    finally:
        release.set()
        dog.stop()
        stream.close()


def test_disabled_with_floor_zero(tmp_path):
    dog, exits, _hangs, stream = _dog(tmp_path, floor_s=0, first_step_s=0.1)
    dog.start()
    time.sleep(0.4)
    dog.stop()
    stream.close()
    assert exits.codes == [] and dog._thread is None


# ------------------------------------------------------------------------------------------ a real trainer
def _config(tmp_path, data, **values):
    base = dict(
        data_dir=str(data),
        run_dir=str(tmp_path / "run"),
        max_seq_len=512,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        val_every=0,
        val_fraction=0.0,
        checkpoint_every=2,
        max_steps=6,
        num_threads=1,
        record_samples=True,
        # A floor of a few seconds keeps the test short; ~0.2 s steps here, x10 is still below it.
        watchdog_floor_s=6,
        watchdog_factor=10,
        watchdog_first_step_s=120,
    )
    base.update(values)
    return write_config(tmp_path / "train.yaml", **base)


def _run(args, log_path, env_extra=None, timeout=180):
    import subprocess
    import sys

    env = {**trainer_env(), **(env_extra or {})}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3", *args],
            cwd=TRAINING_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout=timeout)
    finally:
        reap(proc)


@pytest.mark.slow
def test_a_hung_step_exits_4_with_stacks_and_the_restart_resumes(tmp_path_factory, tmp_path):
    data = synth_dataset(tmp_path_factory.getbasetemp())
    cfg = _config(tmp_path, data)
    run = tmp_path / "run"
    log = tmp_path / "hang.txt"
    started = time.monotonic()
    rc = _run(["train", "--config", str(cfg)], log, {wd.FAULT_HANG_ENV: "4"})
    text = log.read_text()
    assert rc == EXIT_HANG, text
    assert time.monotonic() - started < 120
    assert "fault injection: EAGLE3_FAULT_HANG_AT_STEP=4" in text
    assert "hang: no step for " in text and "then exit 4" in text
    assert "most recent call first" in text and "in injected_hang" in text and "in train" in text
    status = read_status(run)
    assert status["phase"] == "failed" and status["step"] == 3
    assert status["error"]["kind"] == "hang" and status["error"]["message"].startswith("no step for ")
    assert status["last_checkpoint_step"] == 2 and status["last_checkpoint_time"] > 0

    log2 = tmp_path / "restart.txt"
    assert _run(["train", "--config", str(cfg)], log2) == 0, log2.read_text()
    assert "resumed from step 2 (checkpoint " in log2.read_text()
    status = read_status(run)
    assert status["phase"] == "done" and status["error"] is None
    assert status["resumed_from_step"] == 2 and status["step"] == 6 and status["last_checkpoint_step"] == 6


def test_collective_timeout_reaches_init_process_group(tmp_path_factory, tmp_path, monkeypatch):
    from eagle3 import distributed as dist_utils
    from eagle3 import train

    data = synth_dataset(tmp_path_factory.getbasetemp())
    cfg = _config(tmp_path, data, collective_timeout_s=123)
    seen = {}

    def init(info, timeout_s=600.0):
        seen["timeout_s"] = timeout_s
        raise RuntimeError("stop here: the test only wanted the timeout")

    monkeypatch.setattr(dist_utils, "init", init)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main() installs SIGTERM handlers: not in pytest
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # main() sets them; restored after the test
        monkeypatch.setenv(var, dist_utils.ALLOC_CONF)
    threads = torch.get_num_threads()
    try:
        assert train.main(["--config", str(cfg)]) == EXIT_CRASH
    finally:
        torch.set_num_threads(threads)
    assert seen == {"timeout_s": 123.0}
    assert read_status(tmp_path / "run")["error"]["kind"] == "crash"
    assert not [t for t in threading.enumerate() if t.name == "eagle3-watchdog"]  # started later than init
