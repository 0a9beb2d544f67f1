"""The nodes of one run as every node sees them (filter run_nodes) and the per-node status lines (run_summary)."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "roles" / "eagle3_train" / "filter_plugins"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, PLUGINS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_nodes = load("run_nodes")
summary = load("training_summary")


def reports(**over) -> dict:
    base = {
        "nodes": ["a", "b", "c"],
        "rank": "auto",
        "run_dir": "/shared/run",
        "state_dir": "/var/lib/eagle3/node",
        "port": 29400,
        "run_id": "r",
    }
    out = {h: dict(base, addr=f"10.0.0.{i + 1}") for i, h in enumerate(base["nodes"])}
    for host, changes in over.items():
        out[host].update(changes)
    return out


def test_docstring_examples_hold():
    assert doctest.testmod(run_nodes).failed == 0
    assert doctest.testmod(summary).failed == 0


def test_every_node_gets_the_same_ranks_and_endpoint():
    r = reports()
    views = [run_nodes.run_nodes(["a", "b", "c"], ["a", "b", "c"], r, h) for h in "abc"]
    assert [v["rank"] for v in views] == [0, 1, 2]
    assert {v["endpoint"] for v in views} == {"10.0.0.1:29400"}
    assert all(v["errors"] == [] and v["rdzv_node"] == "a" for v in views)


def test_an_explicit_rank_moves_the_rendezvous():
    r = reports(a={"rank": 2}, c={"rank": 0})
    view = run_nodes.run_nodes(["a", "b", "c"], ["a", "b", "c"], r, "b")
    assert view["ranks"] == {"a": 2, "b": 1, "c": 0} and view["endpoint"] == "10.0.0.3:29400"


def test_each_disagreement_is_named():
    r = reports(b={"rank": 0, "port": 29500, "addr": "10.0.0.1"}, c={"nodes": ["a", "c"], "run_id": "other"})
    errors = run_nodes.run_nodes(["a", "b", "c"], ["a", "b", "c"], r, "a")["errors"]
    text = "\n".join(errors)
    assert "node rank 0 is taken by a, b" in text
    assert "b: eagle3_train_node_addr=10.0.0.1 is also a's" in text
    assert "b: eagle3_train_rdzv_port=29500 differs from a's 29400" in text
    assert "c: eagle3_train_nodes=['a', 'c'] differs" in text
    assert "c: eagle3_train_run_id=other differs from a's r" in text


def test_every_node_needs_the_same_context_parallel():
    r = reports(a={"context_parallel": "auto"}, b={"context_parallel": "auto"}, c={"context_parallel": 2})
    errors = run_nodes.run_nodes(["a", "b", "c"], ["a", "b", "c"], r, "b")["errors"]
    assert errors == ["c: eagle3_train_context_parallel=2 differs from a's auto; every node of a run needs the same"]


def test_one_node_is_the_local_rendezvous_whatever_its_address():
    r = {
        "a": {
            "nodes": ["a"],
            "rank": "auto",
            "addr": "127.0.0.1",
            "run_dir": "/r",
            "state_dir": "/r",
            "port": 29400,
            "run_id": "x",
        }
    }
    view = run_nodes.run_nodes(["a"], ["a"], r, "a")
    assert view == {
        "nnodes": 1,
        "rank": 0,
        "ranks": {"a": 0},
        "rdzv_node": "a",
        "endpoint": "127.0.0.1:29400",
        "errors": [],
    }


def test_a_node_line_names_its_ranks_and_marks_the_slowest():
    nodes = [
        {"node": 0, "host": "ct1", "ranks": [0, 1], "tokens_per_s": 900.0, "busy_s_per_step": 0.5},
        {"node": 1, "host": "ct2", "ranks": [2, 3], "tokens_per_s": 700.0, "busy_s_per_step": 0.8},
    ]
    rep = {
        "run": {"state": "running"},
        "unit": {"ActiveState": "active"},
        "hostname": "ct2",
        "status": {"step": 40, "tokens_per_s": 1600.0, "nodes": nodes},
    }
    lines = summary.training_summary(rep, [])
    assert "node 1 of 2 (ct2, ranks 2-3): 700 tokens/s, busy 0.80 s/step (the slowest node)" in lines
    assert not any(line.startswith("node 0 of 2") for line in lines)
