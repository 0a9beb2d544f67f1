"""Facts stated in more than one place are held to their one source: a copy that drifts fails here.

- The restart record's file name: module_utils/restart_backoff.STATE_FILE; the unit template and the role name it.
- The launcher's report of an escalated stop: eagle3.launch.LAST_STOP_FILE; train_report and gpu_cleanup's default
  read it.
- The TensorBoard folder in the run directory: eagle3.observe.TENSORBOARD_DIR; train_report counts its event files.
- Exit codes: training/eagle3/errors.py is the source. module_utils/train_status.py (the target side is stdlib only
  and cannot import the trainer), eagle3.launch's error-kind map and the unit template's RestartPreventExitStatus=
  must agree with it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from module_utils import restart_backoff, train_status

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

from eagle3 import errors, launch  # noqa: E402  (the trainer's package; errors and launch need no torch)


def test_exit_codes_of_the_target_side_are_the_trainers():
    names = [n for n in dir(errors) if n.startswith("EXIT_")]
    assert names, "eagle3.errors defines no EXIT_* codes"
    for name in names:
        assert getattr(train_status, name, None) == getattr(errors, name), (
            f"module_utils/train_status.{name} drifted"
        )
    extra = {n for n in dir(train_status) if n.startswith("EXIT_")} - set(names)
    assert not extra, f"module_utils/train_status defines exit codes the trainer does not: {extra}"


def test_launch_maps_every_error_kind_with_its_own_exit_code():
    assert {
        "config": errors.EXIT_CONFIG,
        "oom": errors.EXIT_OOM,
        "hang": errors.EXIT_HANG,
        **dict.fromkeys(errors.STORAGE_KINDS.values(), errors.EXIT_STORAGE),
    } == launch.EXIT_BY_ERROR_KIND
    assert set(train_status.STORAGE_ERROR_KINDS) == set(errors.STORAGE_KINDS.values())
    # status's "stopped without a restart" kinds are exactly those whose exit the unit never restarts
    no_restart = {k for k, code in launch.EXIT_BY_ERROR_KIND.items() if code in train_status.NO_RESTART_EXITS}
    assert set(train_status.NO_RESTART_KINDS) == no_restart


def test_the_unit_never_restarts_exactly_the_exits_a_restart_cannot_fix():
    template = (ROOT / "roles/eagle3_train/templates/eagle3-train.service.j2").read_text()
    line = re.search(r"^RestartPreventExitStatus=(.*)$", template, re.M)
    assert line, "the unit template lost RestartPreventExitStatus="
    assert sorted(int(v) for v in line.group(1).split()) == sorted(train_status.NO_RESTART_EXITS)
    # A hang or a crash must restart (from the last checkpoint): never in the list.
    assert (
        errors.EXIT_HANG not in train_status.NO_RESTART_EXITS
        and errors.EXIT_CRASH not in train_status.NO_RESTART_EXITS
    )


def test_the_unit_and_the_role_use_the_restart_records_one_name():
    for path in (
        "roles/eagle3_train/templates/eagle3-train.service.j2",
        "roles/eagle3_train/tasks/service.yml",
    ):
        text = (ROOT / path).read_text()
        named = set(re.findall(r"(?:run_dir|state_dir)(?: \}\}| ~ ')/([\w.-]+\.json)", text)) - {
            "status.json"
        }
        assert restart_backoff.STATE_FILE in named, f"{path} names {named}"
        assert named <= {restart_backoff.STATE_FILE, launch.LAST_STOP_FILE}, f"{path} names {named}"


def test_the_launchers_stop_report_has_one_name():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_report", ROOT / "library" / "train_report.py")
    source = spec.loader.get_source("train_report")
    assert f'LAST_STOP_FILE = "{launch.LAST_STOP_FILE}"' in source
    defaults = (ROOT / "roles" / "gpu_cleanup" / "defaults" / "main.yml").read_text()
    assert re.search(rf"^gpu_cleanup_stop_report: \S+/{re.escape(launch.LAST_STOP_FILE)}$", defaults, re.M)


def test_the_tensorboard_folder_has_one_name():
    # eagle3.observe imports torch (absent from this venv): its declaration is read as text.
    declared = re.search(
        r'^TENSORBOARD_DIR = "([^"]+)"$', (ROOT / "training/eagle3/observe.py").read_text(), re.M
    )
    assert declared, "eagle3.observe no longer declares TENSORBOARD_DIR"
    source = (ROOT / "library" / "train_report.py").read_text()
    assert f'TENSORBOARD_DIR = "{declared.group(1)}"' in source
