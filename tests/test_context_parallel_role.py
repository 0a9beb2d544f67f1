"""Context parallelism on the Ansible side: eagle3_train_context_parallel checked against the run's workers before
anything changes (validate.yml), passed to the memory planner and its choice carried into the trainer config
(plan.yml, train.yaml.j2), one value for a run of several nodes.

plan.yml runs here against a stand-in planner (a script in place of the venv's python) that answers the way
`python -m eagle3 plan --json` does with --context-parallel (the trainer's contract): a made-up memory model, and
the trainer's own decision on it (eagle3.plan.decision, torch-free), so these cases hold whatever the trainer's
memory model can do today. The filters themselves are tested in test_train_validation.py (the grammar and
context_parallel_refusal) and test_plan_request.py (plan_argv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.local_inventory import local_training_inventory

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
TEMPLATE = ROOT / "roles" / "eagle3_train" / "templates" / "train.yaml.j2"

# The planner's contract: --context-parallel N|auto, --max-seq-len L; the JSON gains context_parallel and
# context_parallel_table. Here the largest length that fits is memory_gb x 8192 tokens per worker of a row, and the
# data set's longest document is 30000 tokens.
PLANNER = f"""#!{sys.executable}
import json, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT / "training")!r})
from eagle3.plan.decision import decide

args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default

config = sys.stdin.read()
with open(Path(__file__).with_name("calls.jsonl"), "a") as log:
    log.write(json.dumps({{"argv": args, "config": config}}) + "\\n")
world, memory = int(opt("--world-size")), float(opt("--memory-gb", "0"))
cp = opt("--context-parallel", "1")
if cp != "auto" and world % int(cp):
    print(f"eagle3 plan: context_parallel={{cp}} does not divide --world-size {{world}}", file=sys.stderr)
    sys.exit(2)
valid = [c for c in range(1, world + 1) if world % c == 0]
fits = {{c: int(memory * 8192 * c) // 128 * 128 for c in valid}}
if cp == "auto":
    need = int(opt("--max-seq-len") or 30000)
    cp = next((c for c in valid if fits[c] >= need), valid[-1])
cp = int(cp)
lengths = [int(n) for n in opt("--lengths", "").split(",") if n]
plan = {{
    "max_seq_len": fits[cp], "predicted_gb": round(memory * 0.9, 3), "memory_gb": memory, "margin": 0.1,
    "budget_gb": round(memory * 0.9, 3), "static_gb": 0.5, "world_size": world, "source": "analytic",
    "table": [{{"max_seq_len": n, "predicted_gb": round(n / 8192 / cp, 3), "fits": n <= fits[cp]}} for n in lengths],
    "context_parallel": cp,
    "context_parallel_table": [{{"context_parallel": c, "max_seq_len": fits[c], "predicted_gb": 0.9 * memory}}
                               for c in valid],
}}
asked = opt("--max-seq-len")
plan["run"] = decide(plan, int(asked) if asked else None, opt("--context-parallel", "1") if opt("--context-parallel",
                     "1") == "auto" else int(opt("--context-parallel", "1")), unplanned=opt("--unplanned", ""),
                     memory_source=opt("--memory-source", ""))
print(json.dumps(plan))
"""

PLAY = f"""\
- name: plan.yml as deploy.yml includes it, then the trainer config deploy.yml would write
  hosts: all
  gather_facts: false
  tasks:
    - name: The planner's task file
      ansible.builtin.include_role:
        name: eagle3_train
        tasks_from: plan.yml
        public: true
    - name: The trainer config
      ansible.builtin.copy:
        content: "{{{{ lookup('ansible.builtin.template', '{TEMPLATE}') }}}}"
        dest: "{{{{ eagle3_train_config_dir }}}}/train-{{{{ inventory_hostname }}}}.yaml"
        mode: "0600"
"""


def host(tmp_path: Path, name: str, memory_gb: float, **extra) -> dict:
    venv = tmp_path / f"venv-{name}"
    (venv / "bin").mkdir(parents=True)
    planner = venv / "bin" / "python"
    planner.write_text(PLANNER)
    planner.chmod(0o755)
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "gpu_cleanup_unit": "eagle3-train.service",
        "eagle3_train_venv": str(venv),
        "eagle3_train_prefix": str(tmp_path / "prefix"),
        "eagle3_train_data_dir": str(tmp_path / "data"),
        "eagle3_train_run_dir": str(tmp_path / "run"),
        "eagle3_train_config_dir": str(tmp_path),
        "eagle3_train_plan_memory_gb": memory_gb,
        "eagle3_train__nproc": 2,
        "eagle3_train__world_size": 2,
        "eagle3_train__layout": {"nnodes": 1},
        **extra,
    }


def run_plan(tmp_path: Path, hosts: dict, *extra: str) -> tuple[int, str]:
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    (tmp_path / "play.yml").write_text(PLAY)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    args = [str(ANSIBLE_PLAYBOOK), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")]
    for e in extra:
        args += ["-e", e]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    return proc.returncode, " ".join(proc.stdout.split())


def calls(tmp_path: Path, name: str = "target") -> list[dict]:
    path = tmp_path / f"venv-{name}" / "bin" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def config_of(tmp_path: Path, name: str = "target") -> dict:
    """The trainer config the play rendered from train.yaml.j2 after plan.yml (as deploy.yml writes it)."""
    return yaml.safe_load((tmp_path / f"train-{name}.yaml").read_text())


def test_auto_takes_the_planners_context_parallel_into_the_trainer_config(tmp_path):
    rc, out = run_plan(
        tmp_path, {"target": host(tmp_path, "target", 2)}, "eagle3_train__msl=auto", "eagle3_train__cp=auto"
    )
    assert rc == 0, out[-3000:]
    # 30000 tokens need 2 workers per row at 2 GiB each; the 2 workers then train one row per step.
    assert "max_seq_len=auto -> 32768, context_parallel=auto -> 2 (data_parallel 1): predicted peak" in out
    assert "The largest max_seq_len per context_parallel: 1 -> 16384, 2 -> 32768" in out
    (call,) = calls(tmp_path)
    assert call["argv"][call["argv"].index("--context-parallel") + 1] == "auto"
    assert "--max-seq-len" not in call["argv"]  # the planner's own target: the data set's longest document
    config_on_stdin = yaml.safe_load(call["config"])
    assert config_on_stdin["context_parallel"] == 1  # the flag decides, not the config on stdin
    assert config_of(tmp_path)["context_parallel"] == 2 and config_of(tmp_path)["max_seq_len"] == 32768


def test_a_number_is_checked_by_the_planner_and_written_as_it_is(tmp_path):
    rc, out = run_plan(
        tmp_path, {"target": host(tmp_path, "target", 2)}, "eagle3_train__msl=32768", "eagle3_train__cp=2"
    )
    assert rc == 0, out[-3000:]
    assert "max_seq_len=32768 fits (the largest that fits: 32768), context_parallel=2 (data_parallel 1)" in out
    argv = calls(tmp_path)[0]["argv"]
    assert argv[argv.index("--context-parallel") + 1] == "2" and argv[argv.index("--max-seq-len") + 1] == "32768"
    assert config_of(tmp_path)["context_parallel"] == 2 and config_of(tmp_path)["max_seq_len"] == 32768


def test_off_asks_the_planner_nothing_new_and_writes_one(tmp_path):
    rc, out = run_plan(
        tmp_path, {"target": host(tmp_path, "target", 2)}, "eagle3_train__msl=16384", "eagle3_train__cp=1"
    )
    assert rc == 0, out[-3000:]
    assert "max_seq_len=16384 fits (the largest that fits: 16384): predicted peak" in out
    assert ". None" not in out  # no table line for a context_parallel that was not chosen
    assert "--context-parallel" not in calls(tmp_path)[0]["argv"]
    assert config_of(tmp_path)["context_parallel"] == 1


def test_a_length_that_fits_at_no_context_parallel_is_refused_naming_it(tmp_path):
    rc, out = run_plan(
        tmp_path, {"target": host(tmp_path, "target", 2)}, "eagle3_train__msl=65536", "eagle3_train__cp=auto"
    )
    assert rc == 2, out[-3000:]
    assert "max_seq_len=65536 does not fit: the memory planner predicts 4 GiB per worker at 65536" in out
    assert "with context_parallel=2" in out and "The service was not touched." in out


def test_the_planners_refusal_is_a_clear_failure(tmp_path):
    rc, out = run_plan(
        tmp_path, {"target": host(tmp_path, "target", 2)}, "eagle3_train__msl=16384", "eagle3_train__cp=3"
    )
    assert rc == 2, out[-3000:]
    assert (
        "max_seq_len=16384, context_parallel=3: the memory planner refuses the run (exit 2): eagle3 plan: "
        "context_parallel=3 does not divide --world-size 2" in out
    )
    assert "-e context_parallel=auto picks a valid one" in out and "The service was not touched." in out
    assert not (tmp_path / "train-target.yaml").exists()


def test_without_a_memory_plan_the_planner_still_checks_the_heads(tmp_path):
    """No memory figure anywhere (memory 0, no memory_limit_gb): the length is not bounded, but a context_parallel the
    planner refuses still fails here, before the trainer config is written."""
    rc, out = run_plan(
        tmp_path, {"target": host(tmp_path, "target", 0)}, "eagle3_train__msl=16384", "eagle3_train__cp=3"
    )
    assert rc == 2, out[-3000:]
    assert (
        "max_seq_len=16384, context_parallel=3: the memory planner refuses the run (exit 2): eagle3 plan: "
        "context_parallel=3 does not divide" in out
    )
    assert "eagle3_train_allow_unplanned_seq_len=true" not in out  # the length is not planned already
    assert "The service was not touched." in out and not (tmp_path / "train-target.yaml").exists()
    (call,) = calls(tmp_path)
    assert call["argv"][call["argv"].index("--context-parallel") + 1] == "3"
    again = tmp_path / "again"
    again.mkdir()
    rc, out = run_plan(again, {"target": host(again, "target", 0)}, "eagle3_train__msl=16384", "eagle3_train__cp=2")
    assert rc == 0, out[-3000:]
    assert config_of(again)["context_parallel"] == 2


def test_several_nodes_run_at_the_largest_context_parallel_any_chose(tmp_path):
    """Node a fits 30000 tokens on one worker per row, node b needs 4: the run takes 4 and the smaller length."""
    run = {
        "eagle3_train_nodes": ["a", "b"],
        "eagle3_train__world_size": 4,
        "eagle3_train__layout": {"nnodes": 2},
    }
    hosts = {"a": host(tmp_path, "a", 4, **run), "b": host(tmp_path, "b", 1.5, **run)}
    rc, out = run_plan(tmp_path, hosts, "eagle3_train__msl=auto", "eagle3_train__cp=auto")
    assert rc == 0, out[-3000:]
    chosen = (
        "the run (2 nodes): max_seq_len=32768 (the smallest any node chose), context_parallel=4 (the largest; "
        "data_parallel 1)"
    )
    assert out.count(chosen) == 2, out[-3000:]
    assert "max_seq_len=auto -> 32768, context_parallel=auto -> 1" in out  # node a's own choice, reported first
    assert calls(tmp_path, "a") and calls(tmp_path, "b")
    for name in "ab":
        config = config_of(tmp_path, name)
        assert (config["context_parallel"], config["max_seq_len"]) == (4, 32768)


# ------------------------------------------------------------------------------ train.yml: refused before any change
@pytest.fixture
def local_target(tmp_path):
    """The training host is this machine (local connection), every path under tmp_path, a data set in place; the
    runs use --check, so even a check that let something through could change nothing here."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "index.json").write_text("{}")
    return local_training_inventory(
        tmp_path / "local.yml",
        eagle3_train_prefix=f"{tmp_path}/prefix",
        eagle3_train_config_dir=f"{tmp_path}/etc",
        eagle3_train_run_dir=f"{tmp_path}/run",
        eagle3_train_data_dir=f"{tmp_path}/data",
        eagle3_train_venv=f"{tmp_path}/venv",
        eagle3_train_nproc=2,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["context_parallel=3"],
            "context_parallel=3 does not divide the 2 workers of the run (one node): each group of 3 consecutive "
            "workers shares one row; allowed: a divisor of 2 (1, 2), or auto. Nothing was changed.",
        ),
        (
            ["context_parallel=3", "eagle3_train_nproc=6"],
            "context_parallel=3 does not divide max_seq_len=16384: each of the 3 workers of a row holds "
            "max_seq_len / 3 of its positions; allowed: a divisor of the run's 6 workers that divides 16384 (1, 2), "
            "or auto. Nothing was changed.",
        ),
    ],
)
def test_train_refuses_a_context_parallel_the_workers_cannot_split(local_target, tmp_path, extra, message):
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    args = [str(ANSIBLE_PLAYBOOK), "-i", str(local_target), str(ROOT / "train.yml"), "--check"]
    for e in ["max_seq_len=16384", *extra]:
        args += ["-e", e]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    out = " ".join(proc.stdout.split()).replace("''", "'")  # (YAML's quoting of the message)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert message in out, proc.stdout[-3000:]
    assert "validate.yml" in proc.stdout  # it stopped in the validation, before the lock
    assert not (tmp_path / "prefix").exists() and not (tmp_path / "etc").exists()
