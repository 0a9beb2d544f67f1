"""The eagle3_train role's input checks (plugins/filter/role_inputs.py, through the inputs role) and the memory
planner's verdict on an explicit max_seq_len (filter_plugins/train_inputs.py, tasks/plan.yml), without a CT.

The playbook-level cases (train.yml against a missing CT) are in test_playbook_inputs.py; here: the table itself
(every variable of defaults/main.yml and meta/argument_specs.yml is in it, every default passes it, each kind
refuses what it must with the variable, the value and what is allowed) and plan.yml run on this machine with the
real planner from the training venv, the way deploy.yml includes it on the target.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLE = ROOT / "roles" / "eagle3_train"
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
TRAIN_PYTHON = ROOT / ".venv-train" / "bin" / "python"

spec = importlib.util.spec_from_file_location("train_inputs", ROLE / "filter_plugins" / "train_inputs.py")
ti = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ti)
spec = importlib.util.spec_from_file_location("role_inputs", ROOT / "plugins" / "filter" / "role_inputs.py")
ri = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ri)
VARIABLES = ri.ROLE_VARIABLES["eagle3_train"]
trainer_module = ti.trainer_module  # the trainer's torch-free modules, as the filters import them


def train_input_errors(values, aliases=None, known=None):
    return ri.role_input_errors(values, "eagle3_train", aliases, known)


def defaults() -> dict:
    return yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


def test_doctests():
    assert doctest.testmod(ti).failed == 0
    assert doctest.testmod(ri).failed == 0


def test_the_table_knows_exactly_the_role_variables():
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(VARIABLES) == set(defaults()), "defaults/main.yml and the table differ"
    assert set(VARIABLES) == set(specs), "meta/argument_specs.yml and the table differ"


def test_every_default_passes():
    values = {
        **defaults(),
        "eagle3_train_max_seq_len": "16384",  # the default templates max_seq_len | default(16384)
        "eagle3_train_context_parallel": "1",  # and context_parallel | default(1)
    }
    values["eagle3_train_venv"] = "/opt/eagle3/venv"  # "{{ eagle3_train_prefix }}/venv"
    values["eagle3_train_state_dir"] = "/var/lib/eagle3/run"  # "{{ eagle3_train_run_dir }}"
    values["eagle3_train_nodes"] = ["ct129"]  # "{{ groups['training'] ... }}"
    assert train_input_errors(values) == []


BOOL_VARS = [n for n, s in VARIABLES.items() if s["kind"] == "bool"]


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize(
    "value", ["true", "false", "True", "FALSE", "yes", "No", "on", "OFF", "1", "0", True, False, 1, 0]
)
def test_boolean_strings_are_accepted(name, value):
    assert train_input_errors({name: value}) == []


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize("value", ["maybe", "", " true", "2", 2, None, [], "y"])
def test_non_booleans_are_refused(name, value):
    (error,) = train_input_errors({name: value})
    assert error.startswith(f"{name}={ri.show(value)} is not a boolean; allowed: true or false")


# Bad values per kind: (value, what the line must say after "name=value ").
BAD = {
    "int": [
        ("abc", "is not a whole number"),
        ("1.5", "is not a whole number"),
        (True, "is not a whole number"),
        ("-7", "is out of range"),
        (None, "is not a whole number"),
    ],
    "float": [
        ("lots", "is not a number"),
        ("nan", "is not a number"),
        (False, "is not a number"),
        ("-1", "is out of range"),
    ],
    "abspath": [
        ("relative/dir", "is not an absolute path"),
        ("", "is not an absolute path"),
        (5, "is not an absolute path"),
        ("~/x", "is not an absolute path"),
        ("/tmp; rm -rf /", "holds characters a path here may not have"),
        ("/var/../etc", "is not normalised (it would be /etc)"),
    ],
    "owned_dir": [
        ("relative/dir", "is not an absolute path"),
        ("/tmp; rm -rf /", "holds characters a path here"),
        ("/var/../etc", "is not normalised (it would be /etc)"),
        ("/etc", "is a system folder"),
        ("/usr/lib/x", "lies in /usr/lib"),
    ],
    "command": [
        ("", "has the wrong form"),
        ("python3; id", "has the wrong form"),
        (3, "has the wrong form"),
        ("/usr/../bin/python3", "is not normalised"),
    ],
    "host": [("", "has the wrong form"), ("a b", "has the wrong form"), ("$(id)", "has the wrong form")],
    "run_id": [("", "has the wrong form"), ("run 1", "has the wrong form"), ("x" * 65, "has the wrong form")],
    "ifname": [("eth 0", "has the wrong form"), ("x" * 16, "has the wrong form")],
    "listen_address": [
        ("9100", "has the wrong form"),
        ("0.0.0.0:9100 --web.x", "has the wrong form"),
        ("127.0.0.1:$PORT", "has the wrong form"),
    ],
    "ib_hca": [("mlx5_0;id", "has the wrong form")],
    "list": [("--a b", "is not a list"), ({"a": 1}, "is not a list"), ([["x"]], "")],
    "int_list": [
        ("10,30", "is not a list of whole numbers"),
        ([], "is not a list of whole numbers"),
        ([10, "x"], "is not a list of whole numbers"),
        ([10, -1], "has a number out of range"),
    ],
    "dict": [
        ("a=b", "is not a mapping"),
        ([1], "is not a mapping"),
        (None, "is not a mapping"),
        ({"A B": "x"}, "has the key A B"),
        ({"X": "a\nY=b"}, "holds a control character"),
    ],
    "trainer_config": [("a=b", "is not a mapping"), ([1], "is not a mapping"), (None, "is not a mapping")],
    "node_rank": [("-1", "is not a node rank"), ("first", "is not a node rank"), (1.5, "is not a node rank")],
    "nproc": [("0", "is not a worker count"), ("many", "is not a worker count"), (-2, "is not a worker count")],
    "context_parallel": [
        ("0", "is not a context-parallel size"),
        ("-1", "is not a context-parallel size"),
        ("abc", "is not a context-parallel size"),
        ("2.5", "is not a context-parallel size"),
        (True, "is not a context-parallel size"),
        ("", "is not a context-parallel size"),
    ],
    "seq_len": [
        ("1000", "is not a positive multiple of 128"),
        ("0", "is neither a positive multiple of 128 nor"),
        ("big", "is neither"),
        ("-128", "is neither"),
        ("16384.0", "is neither"),
    ],
}
CASES = [
    (name, value, says)
    for name, entry in VARIABLES.items()
    if entry["kind"] != "bool"
    for value, says in BAD[entry["kind"]]
    if not (entry.get("empty") and value == "")  # "" means "not set" for these
    and not (value == "-7" and entry.get("min", 0) <= -7)  # a negative value in range (eagle3_train_nice)
]


@pytest.mark.parametrize(("name", "value", "says"), CASES)
def test_each_bad_value_names_the_variable_the_value_and_what_is_allowed(name, value, says):
    errors = train_input_errors({name: value})
    assert len(errors) == 1, errors
    # A bad item of a list is named with its index: eagle3_train_synth_args[0]=["x"] ...
    head = (
        f"{name}[0]={ri.show(value[0])}"
        if isinstance(value, list) and VARIABLES[name]["kind"] == "list"
        else f"{name}={ri.show(value)}"
    )
    if VARIABLES[name]["kind"] == "dict" and isinstance(value, dict):  # names the key: eagle3_train_env.X=...
        assert errors[0].startswith(name) and says in errors[0], errors[0]
    else:
        assert errors[0].startswith(f"{head} {says}"), errors[0]
    if VARIABLES[name]["kind"] == "seq_len":
        assert "128" in errors[0] and "auto" in errors[0]
    else:
        assert "; allowed: " in errors[0]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("eagle3_train_plan_margin", "1"),
        ("eagle3_train_plan_margin", 0.999),
        ("eagle3_train_rdzv_port", "65536"),
        ("eagle3_train_rdzv_port", 0),
        ("eagle3_train_restart_sec", -1),
        ("eagle3_train_cpu_workers", "0"),
    ],
)
def test_ranges(name, value):
    errors = train_input_errors({name: value})
    if name == "eagle3_train_plan_margin" and value == 0.999:
        assert errors == []
    else:
        assert len(errors) == 1 and f"{name}={ri.show(value)} is out of range; allowed:" in errors[0]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("eagle3_train_cpu_workers", " 4 "),
        ("eagle3_train_nproc", "AUTO"),
        ("eagle3_train_nproc", "8"),
        ("eagle3_train_plan_memory_gb", "0"),
        ("eagle3_train_plan_memory_gb", 95.5),
        ("eagle3_train_plan_margin", "0.25"),
        ("eagle3_train_max_seq_len", " Auto "),
        ("eagle3_train_max_seq_len", 16384),
        ("eagle3_train_restart_delays", ["10", 30]),
        ("eagle3_train_synth_args", ["--num-samples", 8]),
        ("eagle3_train_node_rank", "auto"),
        ("eagle3_train_node_rank", "1"),
        ("eagle3_train_socket_ifname", ""),
        ("eagle3_train_socket_ifname", "eth1"),
        ("eagle3_train_nodes", ["ct1", "ct2"]),
        ("eagle3_train_context_parallel", "auto"),
        ("eagle3_train_context_parallel", " Auto "),
        ("eagle3_train_context_parallel", "4"),
        ("eagle3_train_context_parallel", 1),
        ("eagle3_train_context_parallel", 2.0),  # YAML's 2.0 is a whole number
    ],
)
def test_good_values_pass(name, value):
    assert train_input_errors({name: value}) == []


def test_the_role_keys_of_the_trainer_config_are_refused_with_where_they_go():
    (error,) = train_input_errors({"eagle3_train_config_overrides": {"data_dir": "/x", "lr": 1}})
    assert error.startswith("eagle3_train_config_overrides sets data_dir=/x, which the role sets itself")
    assert "set eagle3_train_data_dir" in error


def test_context_parallel_in_the_trainer_config_is_refused_with_where_it_goes():
    (error,) = train_input_errors({"eagle3_train_config": {"context_parallel": 2, "lr": 0.001}})
    assert error.startswith("eagle3_train_config sets context_parallel=2, which the role sets itself")
    assert "set it with -e context_parallel=N (or auto)" in error


def test_context_parallel_is_reported_under_the_name_the_user_set():
    (error,) = train_input_errors(
        {"eagle3_train_context_parallel": "0"}, {"eagle3_train_context_parallel": "context_parallel"}
    )
    assert error.startswith("context_parallel=0 is not a context-parallel size; allowed: auto")
    assert "-e context_parallel=2" in error


def test_context_parallel_is_a_playbook_name_not_a_stray_trainer_key():
    assert ri.stray_variables(["context_parallel", "max_seq_len"]) == []


def test_unknown_names_are_typos_unless_the_defaults_know_them():
    values = {
        "eagle3_train_min_step": 3,
        "eagle3_train_brand_new": 1,
        "eagle3_train__msl": "auto",
        "other": 1,
    }
    errors = train_input_errors(values, known=["eagle3_train_brand_new"])
    assert errors == [
        "eagle3_train_min_step=3 is not a variable of the eagle3_train role; did you mean eagle3_train_min_steps?"
    ]


def test_max_seq_len_is_reported_under_the_name_the_user_set():
    (error,) = train_input_errors({"eagle3_train_max_seq_len": "24000"}, {"eagle3_train_max_seq_len": "max_seq_len"})
    assert error.startswith("max_seq_len=24000 is not a positive multiple of 128") and "try 23936 or 24064" in error
    (error,) = train_input_errors({"eagle3_train_max_seq_len": "x"})
    assert error.startswith("eagle3_train_max_seq_len=x is neither") and "-e eagle3_train_max_seq_len=auto" in error


# ------------------------------------------------------------------------------ the planner's decision, worded here
# The planner decides (training/eagle3/plan/decision.py; its cases: training/tests/test_plan.py); plan_refusal adds
# the role's ways out to its words. The decision here is the trainer's own, on a plan made up for the case.

PLAN = {
    "max_seq_len": 20096,
    "predicted_gb": 2.249,
    "memory_gb": 2.5,
    "margin": 0.1,
    "budget_gb": 2.25,
    "static_gb": 1.002,
    "world_size": 2,
    "source": "analytic",
    "context_parallel": 1,
    "table": [{"max_seq_len": 32768, "predicted_gb": 3.5, "fits": False}],
}


def answer(plan: dict, msl, cp=1, **options) -> dict:
    """The registered result of the planner's command for this plan and request, as plan.yml sees it."""
    decide = trainer_module("plan.decision").decide
    run = decide(plan, None if msl == "auto" else int(msl), cp, **options)
    return {"rc": 0, "stdout": json.dumps({**plan, "run": run}), "stderr": ""}


@pytest.mark.parametrize("length", [128, 16384, "20096"])
def test_a_length_up_to_the_largest_fitting_one_runs(length):
    assert ti.plan_refusal(answer(PLAN, length), length, 1) == ""


def test_a_length_above_the_largest_fitting_one_is_refused_with_that_length_and_the_memory():
    result = answer(PLAN, "32768", memory_source="the smallest GPU (NVIDIA H200, 143771 MiB)")
    msg = " ".join(ti.plan_refusal(result, "32768", 1).split())
    assert msg.startswith("max_seq_len=32768 does not fit: the memory planner predicts 3.5 GiB per worker at 32768")
    assert "against a budget of 2.25 GiB (2.5 GiB per worker from the smallest GPU (NVIDIA H200, 143771 MiB)" in msg
    assert "less the 10% margin; 2 workers; analytic model)" in msg
    assert "The largest max_seq_len that fits is 20096 (predicted 2.25 GiB)" in msg
    assert "-e max_seq_len=20096" in msg and "-e eagle3_train_allow_unplanned_seq_len=true" in msg
    assert "eagle3_train_plan_margin" in msg  # the role's name for the margin, in the way out
    # Without the requested length in the table (an older planner), the verdict still stands.
    assert "finds that 32768 needs more" in ti.plan_refusal(answer({**PLAN, "table": []}, 32768), 32768, 1)


def test_a_length_that_fits_at_a_larger_context_parallel_is_offered_it():
    plan = {
        **PLAN,
        "context_parallel": 1,
        "context_parallel_table": [
            {"context_parallel": 1, "max_seq_len": 20096, "predicted_gb": 2.249},
            {"context_parallel": 2, "max_seq_len": 30208, "predicted_gb": 2.2},
            {"context_parallel": 4, "max_seq_len": 49152, "predicted_gb": 2.2},
        ],
    }
    msg = " ".join(ti.plan_refusal(answer(plan, "32768", "auto"), "32768", "auto").split())
    assert "split each row over more workers (-e context_parallel=4, or auto)" in msg
    # The prediction names the planner's context_parallel; when no larger one fits, nothing is offered.
    msg = " ".join(ti.plan_refusal(answer({**plan, "context_parallel": 4}, "32768", 4), "32768", 4).split())
    assert "predicts 3.5 GiB per worker at 32768 with context_parallel=4" in msg
    assert "-e context_parallel=" not in msg


@pytest.mark.parametrize(
    ("msl", "cp", "words"),
    [
        ("auto", 1, "max_seq_len=auto needs the memory per worker: no GPU on ct"),
        ("16384", "auto", "context_parallel=auto needs the memory planner to pick it, and max_seq_len=16384 is not"),
    ],
)
def test_what_needs_a_memory_figure_is_refused_naming_what_to_set(msl, cp, words):
    why = "no GPU on ct, eagle3_train_plan_memory_gb is 0 and the trainer config sets no memory_limit_gb"
    msg = " ".join(ti.plan_refusal(answer(PLAN, msl, cp, unplanned=why), msl, cp, why).split())
    assert msg.startswith(words) and "eagle3_train_plan_memory_gb (GiB per worker)" in msg


def test_an_unplanned_length_runs_as_given_and_says_why():
    why = "eagle3_train_allow_unplanned_seq_len is true"
    result = answer(PLAN, "65536", 2, unplanned=why)
    assert ti.plan_refusal(result, "65536", 2, why) == ""
    run = json.loads(result["stdout"])["run"]
    assert (run["max_seq_len"], run["context_parallel"], run["checked"]) == (65536, 2, False)
    assert (
        run["summary"]
        == f"max_seq_len=65536 is not checked against memory: {why}, context_parallel=2 (data_parallel 1)"
    )


# ------------------------------------------------------------------------------ context_parallel against the workers


@pytest.mark.parametrize(
    ("cp", "world", "nnodes", "msl"),
    [
        ("auto", 3, 1, "16384"),
        ("1", 3, 1, "auto"),
        (2, 8, 2, "16384"),
        ("8", 8, 2, "auto"),
        (6, 12, 3, "auto"),
        (3, 6, 1, "12288"),
    ],
)
def test_a_context_parallel_that_splits_the_workers_runs(cp, world, nnodes, msl):
    assert ti.context_parallel_refusal(cp, world, nnodes, msl) == ""


def test_a_context_parallel_that_does_not_divide_the_workers_is_refused_with_the_divisors():
    msg = ti.context_parallel_refusal("3", 8, 2, "16384")
    assert msg.startswith("context_parallel=3 does not divide the 8 workers of the run (2 nodes x 4 workers)")
    assert "allowed: a divisor of 8 (1, 2, 4, 8), or auto." in msg
    assert "(one node)" in ti.context_parallel_refusal(4, 2, 1)
    assert "(3 nodes)" in ti.context_parallel_refusal(4, 7, 3)  # nodes of different sizes


def test_a_context_parallel_that_does_not_divide_the_length_is_refused():
    msg = ti.context_parallel_refusal(3, 6, 1, "16384")
    assert msg.startswith("context_parallel=3 does not divide max_seq_len=16384")
    assert "a divisor of the run's 6 workers that divides 16384 (1, 2), or auto." in msg


# ------------------------------------------------------------------------------ plan.yml with the real planner

PLAY = """\
- name: plan.yml as deploy.yml includes it, on this machine
  hosts: target
  gather_facts: false
  tasks:
    - name: The planner's task file
      ansible.builtin.include_role:
        name: eagle3_train
        tasks_from: plan.yml
"""


def local_budget() -> float:
    """The local inventory's planner budget: the demo's max_seq_len=16384 must fit it."""
    return yaml.safe_load((ROOT / "inventory/local/group_vars/training.yml").read_text())["eagle3_train_plan_memory_gb"]


@pytest.fixture(scope="module")
def planner_target(tmp_path_factory):
    if not TRAIN_PYTHON.exists():
        pytest.skip("needs the training venv (.venv-train: scripts/setup.sh)")
    base = tmp_path_factory.mktemp("plan")
    (base / "prefix").mkdir()
    (base / "prefix" / "src").symlink_to(ROOT / "training")
    (base / "etc").mkdir()
    synth = [str(a) for a in defaults()["eagle3_train_synth_args"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "training")}
    made = subprocess.run(
        [str(TRAIN_PYTHON), "-m", "eagle3", "synth", str(base / "data"), *synth],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if made.returncode != 0:
        pytest.skip(f"eagle3 synth does not run here: {made.stderr[-500:]}")
    (base / "play.yml").write_text(PLAY)
    variables = {
        "eagle3_train__nproc": 2,  # deploy.yml decides it: the local CT's two CPU workers
        "eagle3_train__world_size": 2,  # and the run's (one node)
        "eagle3_train__layout": {"nnodes": 1},  # nodes.yml: one node
        "eagle3_train__cp": 1,  # validate.yml: context_parallel, normalised
        "gpu_cleanup_unit": "eagle3-train.service",
        "eagle3_train_prefix": str(base / "prefix"),
        "eagle3_train_venv": str(ROOT / ".venv-train"),
        "eagle3_train_config_dir": str(base / "etc"),
        "eagle3_train_data_dir": str(base / "data"),
        "eagle3_train_run_dir": str(base / "run"),
        "eagle3_train_config_overrides": {"num_threads": 1, "epochs": 1000},  # as inventory/local
    }
    (base / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {
                        "target": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                            **variables,
                        }
                    }
                }
            }
        )
    )
    return base


def plan(base: Path, msl: str, *extra: str, path_prefix: str = "") -> tuple[int, str]:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "PATH": path_prefix + os.environ["PATH"],
    }
    args = [str(ANSIBLE_PLAYBOOK), "-i", str(base / "hosts.yml"), str(base / "play.yml")]
    for e in (f"eagle3_train__msl={msl}", *extra):
        args += ["-e", e]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    return proc.returncode, " ".join(proc.stdout.split())


@pytest.mark.slow
def test_planner_refuses_a_length_above_the_largest_that_fits(planner_target):
    rc, out = plan(planner_target, "65536", f"eagle3_train_plan_memory_gb={local_budget()}")
    assert rc == 2, out[-3000:]
    m = re.search(r"The largest max_seq_len that fits is (\d+) \(predicted ([0-9.]+) GiB\)", out)
    assert m, out[-3000:]
    largest = int(m.group(1))
    assert largest % 128 == 0 and 16384 <= largest < 65536
    assert "max_seq_len=65536 does not fit: the memory planner predicts" in out
    assert f"({local_budget():g} GiB per worker from eagle3_train_plan_memory_gb, less the 10% margin" in out
    assert f"-e max_seq_len={largest}" in out and "The service was not touched." in out

    # The largest length it named runs, and so does the demo's 16384 with the local inventory's budget.
    for ok in (str(largest), "16384"):
        rc, out = plan(planner_target, ok, f"eagle3_train_plan_memory_gb={local_budget()}")
        assert rc == 0, out[-3000:]
        assert f"max_seq_len={ok} fits (the largest that fits: {largest})" in out


@pytest.mark.slow
def test_an_expert_can_run_an_unplanned_length(planner_target):
    rc, out = plan(
        planner_target,
        "65536",
        "eagle3_train_plan_memory_gb=1.6",
        "eagle3_train_allow_unplanned_seq_len=True",
    )
    assert rc == 0, out[-3000:]
    assert "max_seq_len=65536 is not checked against memory: eagle3_train_allow_unplanned_seq_len is true" in out


@pytest.mark.slow
def test_auto_picks_the_largest_that_fits(planner_target):
    rc, out = plan(planner_target, "auto", f"eagle3_train_plan_memory_gb={local_budget()}")
    assert rc == 0, out[-3000:]
    assert re.search(r"max_seq_len=auto -> \d+: predicted peak", out), out[-3000:]


@pytest.mark.slow
def test_without_gpu_or_budget_an_explicit_length_is_not_bounded_and_auto_fails(planner_target):
    rc, out = plan(planner_target, "16384")
    assert rc == 0, out[-3000:]
    assert "max_seq_len=16384 is not checked against memory: no GPU on target" in out
    rc, out = plan(planner_target, "auto")
    assert rc == 2 and "max_seq_len=auto needs the memory per worker: no GPU on target" in out, out[-3000:]


@pytest.mark.slow
def test_zero_budget_means_the_smallest_gpu(planner_target):
    # The fake nvidia-smi reports two 97887 MiB GPUs; the drafter is tiny, so 65536 fits them.
    rc, out = plan(planner_target, "65536", path_prefix=f"{ROOT / 'tests' / 'fakebin'}:")
    assert rc == 0, out[-3000:]
    assert "of 95.59 GiB per worker (the smallest GPU (NVIDIA RTX PRO 6000 Blackwell, 97887 MiB))" in out


@pytest.mark.slow
def test_context_parallel_auto_fails_where_the_planner_does_not_run(planner_target):
    rc, out = plan(planner_target, "16384", "eagle3_train__cp=auto")
    assert rc == 2, out[-3000:]
    assert "context_parallel=auto needs the memory planner to pick it, and max_seq_len=16384 is not planned" in out
    assert "-e context_parallel=2" in out and "The service was not touched." in out
    rc, out = plan(
        planner_target,
        "65536",
        "eagle3_train__cp=auto",
        "eagle3_train_plan_memory_gb=1.6",
        "eagle3_train_allow_unplanned_seq_len=true",
    )
    assert rc == 2 and "eagle3_train_allow_unplanned_seq_len is true" in out, out[-3000:]


def planner_has_context_parallel() -> bool:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "training")}
    proc = subprocess.run(
        [str(TRAIN_PYTHON), "-m", "eagle3", "plan", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    return "--context-parallel" in proc.stdout


@pytest.mark.slow
def test_plan_yml_with_context_parallel(planner_target):
    """auto: the planner's choice and its table in the report; a value the planner refuses (exit 2): the failure
    names it and the service is not touched."""
    if not planner_has_context_parallel():
        pytest.skip("the planner has no --context-parallel yet (training/eagle3/plan/cli.py)")
    budget = f"eagle3_train_plan_memory_gb={local_budget()}"
    rc, out = plan(planner_target, "auto", "eagle3_train__cp=auto", budget)
    assert rc == 0, out[-3000:]
    assert re.search(r"max_seq_len=auto -> \d+, context_parallel=auto -> [12] \(data_parallel [12]\)", out), out[-3000:]
    assert "The largest max_seq_len per context_parallel: 1 -> " in out
    rc, out = plan(planner_target, "16384", "eagle3_train__cp=3", budget)  # 2 workers (validate.yml refuses it first)
    assert rc == 2, out[-3000:]
    assert "max_seq_len=16384, context_parallel=3: the memory planner refuses the run (exit 2)" in out
    out = out.replace("''", "'")  # (YAML's quoting of the message)
    # the planner's own words (the trainer's rule), not a restatement of it
    assert "does not divide the 2 workers of the run" in out and "The service was not touched." in out


@pytest.mark.slow  # planner_target: a module fixture that runs the planner
def test_the_planners_json_carries_its_decision(planner_target):
    """What plan.yml reads comes from `eagle3 plan --json --max-seq-len N` (eagle3/plan/cli.py): the plan and the
    decision on it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "training")}
    cfg = planner_target / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "max_seq_len": 128,
                "data_dir": str(planner_target / "data"),
                "num_threads": 1,
                "run_dir": str(planner_target / "run"),
            }
        )
    )
    argv = [str(TRAIN_PYTHON), "-m", "eagle3", "plan", "--json", "--config", str(cfg), "--world-size", "2"]
    argv += ["--memory-gb", "1.6", "--max-seq-len", "65536", "--lengths", "65536"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {"max_seq_len", "predicted_gb", "memory_gb", "margin", "budget_gb", "world_size", "source"} <= set(result)
    assert result["table"] == [
        {"max_seq_len": 65536, "predicted_gb": result["table"][0]["predicted_gb"], "fits": False}
    ]
    run = result["run"]
    assert run["refusal_kind"] == "too_long" and run["largest"] == result["max_seq_len"]
    assert run["refusal"].startswith("max_seq_len=65536 does not fit")
    assert ti.plan_refusal({"rc": 0, "stdout": proc.stdout}, 65536, 1).startswith(run["refusal"])


def test_trainer_settings_are_checked_by_the_trainers_own_declaration_naming_the_variable():
    errors = train_input_errors(
        {
            "eagle3_train_config": {"epochs": 0, "lr": 0.001},
            "eagle3_train_config_overrides": {"checkpoint_every": -1, "ttt_step": 3},
            "eagle3_train_max_seq_len": "auto",
        }
    )
    assert "eagle3_train_config: epochs=0 must be at least 1 (the trainer refuses it)" in errors
    assert "eagle3_train_config_overrides: checkpoint_every=-1 must be at least 1 (the trainer refuses it)" in errors
    assert "eagle3_train_config_overrides: ttt_step is not a trainer config key; did you mean ttt_steps?" in errors
    assert not any("memory" in e or "allow_unplanned" in e for e in errors)  # not the planner's business
