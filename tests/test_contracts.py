"""Facts stated in more than one place are held to their one source: a copy that drifts fails here.

- The restart record's file name: module_utils/restart_backoff.STATE_FILE; the unit template and the role name it.
- The launcher's report of an escalated stop: eagle3.launch.LAST_STOP_FILE; train_report and gpu_cleanup's default
  read it.
- The TensorBoard folder in the run directory: eagle3.observe.TENSORBOARD_DIR; train_report counts its event files.
- Exit codes: training/eagle3/errors.py is the source. module_utils/train_status.py (the target side is stdlib only
  and cannot import the trainer), eagle3.launch's error-kind map and the unit template's RestartPreventExitStatus=
  must agree with it.
- Error kinds: eagle3.errors.ERROR_KINDS is the source; every list of them in the docs and the modules' docs names
  them all.
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
        assert getattr(train_status, name, None) == getattr(errors, name), f"module_utils/train_status.{name} drifted"
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
    # the unit reads the declaration the modules read (module_utils/train_status.py), not a copy of it
    assert line.group(1) == "{{ 'train_status.NO_RESTART_EXITS' | target_constant | join(' ') }}"
    declared_constants = _load("plugins/filter/declared_constants.py", "contract_declared_constants")
    rendered = " ".join(map(str, declared_constants.target_constant("train_status.NO_RESTART_EXITS")))
    assert sorted(int(v) for v in rendered.split()) == sorted(train_status.NO_RESTART_EXITS)
    datagen = (ROOT / "roles/eagle3_datagen/templates/eagle3-datagen.service.j2").read_text()
    assert "RestartPreventExitStatus={{ 'errors.EXIT_CONFIG' | trainer_constant }}" in datagen
    assert declared_constants.trainer_constant("errors.EXIT_CONFIG") == errors.EXIT_CONFIG
    # A hang or a crash must restart (from the last checkpoint): never in the list.
    assert (
        errors.EXIT_HANG not in train_status.NO_RESTART_EXITS and errors.EXIT_CRASH not in train_status.NO_RESTART_EXITS
    )


def test_the_unit_and_the_role_use_the_restart_records_one_name():
    for path in (
        "roles/eagle3_train/templates/eagle3-train.service.j2",
        "roles/eagle3_train/tasks/service.yml",
    ):
        text = (ROOT / path).read_text()
        named = set(re.findall(r"(?:run_dir|state_dir)(?: \}\}| ~ ')/([\w.-]+\.json)", text)) - {"status.json"}
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
    declared = re.search(r'^TENSORBOARD_DIR = "([^"]+)"$', (ROOT / "training/eagle3/observe.py").read_text(), re.M)
    assert declared, "eagle3.observe no longer declares TENSORBOARD_DIR"
    source = (ROOT / "library" / "train_report.py").read_text()
    assert f'TENSORBOARD_DIR = "{declared.group(1)}"' in source


# ------------------------------------------------------------------ facts the controller reads, not copies
# - The GPU device globs: module_utils/procs.DEVICE_GLOBS. gpu_cleanup's default is it (DOCUMENTATION states it for
#   ansible-doc), the gpu_cleanup role's default reads it (target_constant), bench/gpu_check.py imports it.
# - The training unit's name: module_utils/restart_backoff.DEFAULT_UNIT (that file is deployed alone, so the name lives
#   there). train_report, train_health and restart_backoff's post-stop default to it; so does the role.
# - The length block: eagle3.config.SEQ_BLOCK. role_inputs' max_seq_len check and plan.yml (trainer_constant) read it.


def _load(path: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented_default(module, option: str):
    import yaml

    return yaml.safe_load(module.DOCUMENTATION)["options"][option]["default"]


def test_the_gpu_device_globs_have_one_declaration():
    from module_utils import procs

    gpu_cleanup = _load("library/gpu_cleanup.py", "contract_gpu_cleanup")
    assert gpu_cleanup.argument_spec()["devices"]["default"] is gpu_cleanup.procs.DEVICE_GLOBS
    assert gpu_cleanup.procs.DEVICE_GLOBS == procs.DEVICE_GLOBS
    assert _documented_default(gpu_cleanup, "devices") == procs.DEVICE_GLOBS  # what ansible-doc shows

    constants = _load("plugins/filter/declared_constants.py", "contract_declared_constants")
    assert constants.target_constant("procs.DEVICE_GLOBS") == procs.DEVICE_GLOBS
    defaults = (ROOT / "roles/gpu_cleanup/defaults/main.yml").read_text()
    assert re.search(r"""^gpu_cleanup_devices: "\{\{ 'procs\.DEVICE_GLOBS' \| target_constant \}\}"$""", defaults, re.M)
    specs = (ROOT / "roles/gpu_cleanup/meta/argument_specs.yml").read_text()
    bench = (ROOT / "bench/gpu_check.py").read_text()
    assert re.search(r"^from module_utils.procs import DEVICE_GLOBS\b", bench, re.M)
    for path, text in (("defaults", defaults), ("argument_specs", specs), ("bench/gpu_check.py", bench)):
        for glob in procs.DEVICE_GLOBS[1:]:  # (/dev/nvidia[0-9]* also names the kind path_glob's example)
            assert glob not in text, f"{path} restates {glob}"


def test_the_training_units_name_has_one_declaration():
    unit = restart_backoff.DEFAULT_UNIT
    health = _load("library/train_health.py", "contract_train_health")
    assert health.ARGUMENT_SPEC["unit"]["default"] is health.DEFAULT_UNIT
    assert unit == health.DEFAULT_UNIT and _documented_default(health, "unit") == unit
    report = _load("library/train_report.py", "contract_train_report")
    assert unit == report.DEFAULT_UNIT and _documented_default(report, "unit") == unit
    for path in ("library/train_report.py", "library/train_health.py", "module_utils/restart_backoff.py"):
        code = (ROOT / path).read_text()
        assert not re.search(r"default\s*=\s*[\"']eagle3-train", code), f"{path} restates the unit's name"
    assert (ROOT / "module_utils/restart_backoff.py").read_text().count('"eagle3-train.service"') == 1
    assert "default=DEFAULT_UNIT" in (ROOT / "library/train_report.py").read_text()
    assert 'post.add_argument("--unit", default=DEFAULT_UNIT)' in (ROOT / "module_utils/restart_backoff.py").read_text()

    constants = _load("plugins/filter/declared_constants.py", "contract_declared_constants")
    assert constants.target_constant("restart_backoff.DEFAULT_UNIT") == unit
    defaults = (ROOT / "roles/gpu_cleanup/defaults/main.yml").read_text()
    assert re.search(
        r"""^gpu_cleanup_unit: "\{\{ 'restart_backoff\.DEFAULT_UNIT' \| target_constant \}\}"$""",
        defaults,
        re.M,
    )
    assert unit not in (ROOT / "roles/gpu_cleanup/meta/argument_specs.yml").read_text()
    summary = _load("roles/eagle3_train/filter_plugins/training_summary.py", "contract_training_summary")
    assert summary.default_unit() == unit
    code = (ROOT / "roles/eagle3_train/filter_plugins/training_summary.py").read_text()
    assert not re.search(r"unit_name: str[^=]*=\s*[\"']eagle3-train", code), "the summary restates the unit's name"


def test_the_controller_reads_the_trainers_length_block(monkeypatch):
    from eagle3 import bounds, config

    role_inputs = _load("plugins/filter/role_inputs.py", "contract_role_inputs")
    constants = _load("plugins/filter/declared_constants.py", "contract_declared_constants")
    assert constants.trainer_constant("config.SEQ_BLOCK") == config.SEQ_BLOCK
    assert role_inputs.trainer() is config
    assert role_inputs.role_input_errors({"eagle3_train_max_seq_len": str(config.SEQ_BLOCK * 3)}, "eagle3_train") == []

    # The filters follow the trainer's declaration: nothing on the controller side states the block or the rule.
    block = config.SEQ_BLOCK * 2
    monkeypatch.setattr(config, "SEQ_BLOCK", block)
    monkeypatch.setattr(bounds, "SEQ_BLOCK", block)
    rule = config.Bound(f"multiple of {block}", lambda v: v > 0 and v % block == 0, f"is not a multiple of {block}")
    monkeypatch.setattr(config, "SEQ_MULTIPLE", rule)
    assert constants.trainer_constant("config.SEQ_BLOCK") == block
    errors = role_inputs.role_input_errors({"eagle3_train_max_seq_len": str(block * 3 // 2)}, "eagle3_train")
    assert len(errors) == 1 and f"is not a multiple of {block}; try {block} or {block * 2}" in errors[0], errors

    plan = (ROOT / "roles/eagle3_train/tasks/plan.yml").read_text()
    assert "'eagle3_train__msl_chosen': 'config.SEQ_BLOCK' | trainer_constant" in plan
    assert not re.search(r"msl_chosen'?: *128\b", plan)


# Where the trainer's error kinds are listed for a reader. A list is a run of at least three kinds, each within a
# few words of the one before (no sentence ends between them).
ERROR_KIND_DOCS = (
    "docs/operations.md",
    "docs/contracts.md",
    "training/README.md",
    "training/eagle3/errors.py",
    "training/eagle3/launch.py",
    "library/train_health.py",
    "library/datagen_job.py",
    "module_utils/train_status.py",
)


def _kind_lists(text: str):
    """(text of the list, kinds named) of each run of at least three error kinds in `text`."""
    pattern = "|".join(sorted(errors.ERROR_KINDS, key=len, reverse=True))
    hits = list(re.finditer(rf"(?<![\w-])(?:{pattern})(?![\w-])", text))
    run: list = []
    for hit in [*hits, None]:
        gap = text[run[-1].end() : hit.start()] if run and hit else None
        if hit and run and len(gap) <= 45 and ". " not in gap and "\n\n" not in gap:
            run.append(hit)
            continue
        if len(run) >= 3:
            yield text[run[0].start() : run[-1].end()], {m.group(0) for m in run}
        run = [hit] if hit else []


def test_every_list_of_error_kinds_in_the_docs_is_complete():
    """A new error kind is declared once (eagle3.errors.ERROR_KINDS): a list of five or more of them anywhere a reader
    looks names every kind but crash (which some lists describe in words), or this test names the file and the list.
    The storage kinds (exit 5) appear together wherever one of them is listed."""
    storage = set(errors.STORAGE_KINDS.values())
    problems = []
    for name in ERROR_KIND_DOCS:
        found = list(_kind_lists((ROOT / name).read_text()))
        assert found, f"{name} no longer lists the error kinds: drop it from ERROR_KIND_DOCS"
        for listed, named in found:
            missing = set(errors.ERROR_KINDS) - named - {"crash"}
            if named & storage and storage - named:
                problems.append(f"{name}: {listed!r} lacks {sorted(storage - named)}")
            elif len(named) >= 5 and missing:
                problems.append(f"{name}: {listed!r} lacks {sorted(missing)}")
    assert not problems, "\n".join(problems)


# The run rules, each stated once, in code: the length block (training/eagle3/bounds.py, SEQ_MULTIPLE) and context
# parallelism against the workers and the row (training/eagle3/options.py, check_context_parallel); the heads rule
# is DrafterConfig.context_heads (training/eagle3/spec.py). Everything else calls them: the planner, the role's
# early checks (plugins/filter/role_inputs.py, roles/eagle3_train/filter_plugins/train_inputs.py), plan.yml's
# messages (which show the planner's words instead of restating the rule).
RULE_HOMES = {
    "the length block": (
        re.compile(r"%\s*(SEQ_BLOCK|128)\b|//\s*(SEQ_BLOCK|128)\b"),
        {"training/eagle3/bounds.py"},
    ),
    "context parallelism against the workers or the row": (
        re.compile(r"\b(world(_size)?|seq_len|max_seq_len|length|msl)\)?\s*%\s*(cp|c|context_parallel)\b"),
        {"training/eagle3/options.py"},
    ),
    "the heads rule": (
        re.compile(r"num_heads\s*%|kv_heads\s*%|% *kv\b|divide its num_kv_heads|num_kv_heads or be a multiple"),
        {"training/eagle3/spec.py"},
    ),
}
PRODUCT = ("training/eagle3", "plugins", "roles", "library", "module_utils", "playbooks")


def test_each_run_rule_is_stated_once():
    restated = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".yml", ".j2") or not path.is_file():
                continue
            name = str(path.relative_to(ROOT))
            text = path.read_text()
            for rule, (pattern, homes) in RULE_HOMES.items():
                if name in homes:
                    continue
                for m in pattern.finditer(text):
                    line = text[: m.start()].count("\n") + 1
                    restated.append(f"{name}:{line}: {rule} restated ({m.group(0)!r}); call its declaration")
    assert not restated, "\n".join(restated)
