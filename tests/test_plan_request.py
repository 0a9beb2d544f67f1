"""What plan.yml asks the planner (roles/eagle3_train/filter_plugins/plan_request.py): the memory per worker it
assumes and where it comes from, why a length is not bounded by it, and the planner's argv. Each case is also held to the Jinja that plan.yml used to
hold, so moving the decision into a filter changed nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jinja2
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "plan_request", ROOT / "roles" / "eagle3_train" / "filter_plugins" / "plan_request.py"
)
pr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pr)

# plan.yml's expressions before the filters (the trainer config already combined with its overrides); the argv with
# the one change since: an explicit length also goes as --max-seq-len, the length the planner decides about.
OLD_GB = """{% set m = gpus | selectattr('memory_total_mib') | sort(attribute='memory_total_mib') | list %}{{
  configured | float if configured | float > 0
  else ((m[0].memory_total_mib / 1024) | round(2, 'floor')) if m else 0 }}"""
OLD_SOURCE = """{% set m = gpus | selectattr('memory_total_mib') | sort(attribute='memory_total_mib') | list %}{{
  'eagle3_train_plan_memory_gb' if configured | float > 0
  else ('the smallest GPU (' ~ m[0].name | default('GPU') ~ ', ' ~ m[0].memory_total_mib | int ~ ' MiB)') if m
  else 'memory_limit_gb of the trainer config' if cfg.memory_limit_gb | default(0) | float > 0 else '' }}"""
OLD_ARGV = """{{ ([python, '-m', 'eagle3', 'plan', '--json', '--config', '/dev/stdin', '--world-size', world_size | string]
  + (['--nnodes', nnodes | string, '--nproc-per-node', nproc | string]
     if nnodes | int > 1 and world_size | int == nnodes | int * nproc | int else [])
  + ['--margin', margin | string]
  + (['--memory-gb', memory_gb | string] if memory_gb | float > 0 else [])
  + (['--max-seq-len', msl, '--lengths', msl] if msl != 'auto' else [])
  + (['--probe'] if msl == 'auto' and gpus | length > 0 else [])) | join('\\x00') }}"""
ENV = jinja2.Environment()

GPUS = [
    [],
    [{"name": "NVIDIA RTX PRO 6000 Blackwell", "memory_total_mib": 97887}] * 2,
    [{"name": "A", "memory_total_mib": 97887}, {"name": "B", "memory_total_mib": 81559}],
    [{"memory_total_mib": 40960}],  # no name
    [{"name": "C", "memory_total_mib": 0}],  # not measured
]


@pytest.mark.parametrize("configured", [0, "0", 1.6, "1.6", "x", -1])
@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("cfg", [{}, {"memory_limit_gb": 2}, {"memory_limit_gb": "0"}])
def test_plan_memory_decides_as_plan_yml_did(configured, gpus, cfg):
    got = pr.plan_memory(configured, gpus, {"lr": 0.001}, cfg)
    assert str(got["gb"]) == ENV.from_string(OLD_GB).render(configured=configured, gpus=gpus).strip()
    assert got["source"] == ENV.from_string(OLD_SOURCE).render(configured=configured, gpus=gpus, cfg=cfg).strip()


def test_plan_memory_names_each_source():
    assert pr.plan_memory("2", GPUS[1]) == {"gb": 2.0, "source": "eagle3_train_plan_memory_gb"}
    assert pr.plan_memory(0, GPUS[1]) == {
        "gb": 95.59,
        "source": "the smallest GPU (NVIDIA RTX PRO 6000 Blackwell, 97887 MiB)",
    }
    assert pr.plan_memory(0, [], {"memory_limit_gb": 1.5}) == {
        "gb": 0,
        "source": "memory_limit_gb of the trainer config",
    }
    assert pr.plan_memory(0, None, None, None) == {"gb": 0, "source": ""}


@pytest.mark.parametrize(("world_size", "nnodes", "nproc"), [(2, 1, 2), ("4", "2", "2"), (3, 2, 2), (1, 1, 1)])
@pytest.mark.parametrize("memory_gb", [0, 1.6, 95.59])
@pytest.mark.parametrize("msl", ["auto", "16384"])
@pytest.mark.parametrize("gpus", [[], GPUS[1]])
def test_plan_argv_is_what_plan_yml_built(world_size, nnodes, nproc, memory_gb, msl, gpus):
    args = {"world_size": world_size, "nnodes": nnodes, "nproc": nproc, "margin": 0.1, "memory_gb": memory_gb}
    got = pr.plan_argv("/opt/eagle3/venv/bin/python", **args, msl=msl, gpus=gpus)
    old = ENV.from_string(OLD_ARGV).render(python="/opt/eagle3/venv/bin/python", msl=msl, gpus=gpus, **args)
    assert "\x00".join(got) == old
    assert ("--probe" in got) == (msl == "auto" and bool(gpus))


@pytest.mark.parametrize("cp", [None, 1, "1", " 1 "])
def test_context_parallel_off_asks_the_planner_nothing_new(cp):
    """1 (the default) adds no flag: the argv is the one the planner had before context parallelism."""
    for msl in ("auto", "16384"):
        got = pr.plan_argv("/p", 8, 1, 8, 0.1, 80, msl, GPUS[1], cp)
        assert got == pr.plan_argv("/p", 8, 1, 8, 0.1, 80, msl, GPUS[1])
        assert "--context-parallel" not in got and ("--max-seq-len" in got) == (msl != "auto")


@pytest.mark.parametrize(("cp", "flag"), [(2, "2"), ("4", "4"), ("auto", "auto"), (" AUTO ", "auto")])
def test_context_parallel_is_passed_with_the_length_auto_must_fit(cp, flag):
    explicit = pr.plan_argv("/p", 8, 1, 8, 0.1, 80, "65536", [], cp)
    i = explicit.index("--context-parallel")
    assert explicit[i + 1] == flag
    assert explicit[explicit.index("--max-seq-len") + 1] == "65536"
    assert explicit[explicit.index("--lengths") + 1] == "65536"  # the table row the decision reads
    auto = pr.plan_argv("/p", 8, 1, 8, 0.1, 80, "auto", GPUS[1], cp)
    assert auto[auto.index("--context-parallel") + 1] == flag
    assert "--max-seq-len" not in auto and "--lengths" not in auto and auto[-1] == "--probe"


@pytest.mark.parametrize(
    ("memory", "allow", "msl", "why"),
    [
        ({"gb": 2.5, "source": "eagle3_train_plan_memory_gb"}, False, "16384", ""),
        ({"gb": 2.5, "source": "eagle3_train_plan_memory_gb"}, "true", "16384", "allow_unplanned_seq_len is true"),
        ({"gb": 2.5, "source": "eagle3_train_plan_memory_gb"}, True, "auto", ""),  # auto is always planned
        ({"gb": 0, "source": "memory_limit_gb of the trainer config"}, False, "auto", ""),
        ({"gb": 0, "source": ""}, False, "16384", "no GPU on ct, eagle3_train_plan_memory_gb is 0"),
        ({"gb": 0, "source": ""}, False, "auto", "no GPU on ct"),
    ],
)
def test_a_length_is_unplanned_when_the_user_says_so_or_no_memory_figure_exists(memory, allow, msl, why):
    got = pr.plan_unplanned(memory, allow, msl, "ct")
    assert (why in got and got) if why else got == ""
    argv = pr.plan_argv("/p", 2, 1, 2, 0.1, memory["gb"], msl, GPUS[1], 1, got)
    assert ("--unplanned" in argv) == bool(why) and ("--probe" in argv) == (msl == "auto" and not why)
