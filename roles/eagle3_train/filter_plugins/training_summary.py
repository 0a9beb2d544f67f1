# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``training_summary``: the lines a person watching a run wants, from status.json, the unit and gpu_facts;
``run_summary``: one line for a run of several nodes. Two filters, so ansible-doc reads their documentation from
training_summary.yml and run_summary.yml beside this file."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _f(value, fmt: str, default: str = "?") -> str:
    try:
        return format(float(value), fmt)
    except (TypeError, ValueError):
        return default


def _duration(seconds) -> str:
    """
    >>> _duration(3725)
    '1h02m'
    """
    try:
        s = int(float(seconds))
    except (TypeError, ValueError):
        return "?"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _ago(seconds) -> str:
    """
    >>> _ago(75), _ago(7300)
    ('1m15s ago', '2h01m ago')
    """
    try:
        s = int(float(seconds))
    except (TypeError, ValueError):
        return "?"
    return f"{s // 60}m{s % 60:02d}s ago" if s < 3600 else f"{_duration(s)} ago"


def _holder(h: dict) -> str:
    return f"pid {h.get('pid')} {h.get('name')} (user {h.get('user', '?')}): {h.get('cmdline', '')[:120]} holds {','.join(h.get('paths', []))}"


def _acceptance(status: dict) -> str:
    """The last validation's simulated acceptance length (tokens per draft-and-verify round) and its prediction of
    the real one (tau_predicted: the rounds a decoder would run over the validation responses), or ''.

    >>> _acceptance({"acceptance_length": 2.4125, "acceptance_length_step": 500})
    'acceptance length 2.41 (val, step 500)'
    >>> _acceptance({"val": {"step": 40, "acceptance_length": 1.5, "tau_predicted": 1.42}}), _acceptance({"val": None})
    ('acceptance length 1.50, predicted tau_real 1.42 (val, step 40)', '')
    """
    val = status.get("val") or {}
    value = status.get("acceptance_length", val.get("acceptance_length"))
    if value is None:
        return ""
    step = status.get("acceptance_length_step", val.get("step"))
    predicted = f", predicted tau_real {_f(val['tau_predicted'], '.2f')}" if val.get("tau_predicted") else ""
    return f"acceptance length {_f(value, '.2f')}{predicted} (val, step {step if step is not None else '?'})"


def _workers(run: dict, status: dict) -> str:
    """The worker count the unit starts (the status file's may be a failed start's), or the status's, or '?'.

    >>> _workers({"workers": 16}, {"world_size": 1}), _workers({}, {"world_size": 2}), _workers({}, {})
    ('16 workers', '2 workers (from status.json)', '? workers')
    """
    if run.get("workers"):
        return f"{run['workers']} workers"
    if status.get("world_size"):
        return f"{status['world_size']} workers (from status.json)"
    return "? workers"


def _parallel(status: dict) -> str:
    """How rows are split, when status.json says (context parallelism): the workers per row, the rows per step.

    >>> _parallel({"world_size": 8, "context_parallel": 4, "data_parallel": 2})
    ', context_parallel 4, data_parallel 2 (rows per step)'
    >>> _parallel({"world_size": 8, "context_parallel": 2}), _parallel({"context_parallel": 2}), _parallel({})
    (', context_parallel 2, data_parallel 4 (rows per step)', ', context_parallel 2', '')
    """
    cp = status.get("context_parallel")
    if cp is None:
        return ""
    dp = status.get("data_parallel")
    if dp is None and status.get("world_size") and cp:
        dp = int(status["world_size"]) // int(cp)
    return f", context_parallel {cp}" + (f", data_parallel {dp} (rows per step)" if dp is not None else "")


def _previous(status: dict) -> str:
    """The last real step of the run before, when this start has done none.

    >>> _previous({"step": 0, "previous_run": {"step": 40, "epoch": 1, "phase": "stopped"}})
    '; no step in this start yet (the run before reached step 40, epoch 1, and ended stopped)'
    >>> _previous({"step": 12, "previous_run": {"step": 40}})
    ''
    """
    prev = status.get("previous_run") or {}
    if status.get("step") or not prev.get("step"):
        return ""
    ended = prev.get("error_kind") or prev.get("phase") or "?"
    return f"; no step in this start yet (the run before reached step {prev['step']}, epoch {prev.get('epoch', 0)}, and ended {ended})"


def _node_line(n: dict, nodes: list) -> str:
    ranks = n.get("ranks") or []
    span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else (str(ranks[0]) if ranks else "?")
    slowest = max(nodes, key=lambda x: float(x.get("busy_s_per_step") or 0))
    mark = " (the slowest node)" if slowest is n else ""
    return (
        f"node {n.get('node', '?')} of {len(nodes)} ({n.get('host', '?')}, ranks {span}): "
        f"{_f(n.get('tokens_per_s'), ',.0f')} tokens/s, busy {_f(n.get('busy_s_per_step'), '.2f')} s/step{mark}"
    )


def run_summary(reports: dict, now=None) -> list[str]:
    """One line for a whole run of several nodes, from every node's train_report result (by inventory name).

    Step and state come from the shared status.json; tokens/s is the sum over the nodes; the slowest node is the
    one whose ranks were busiest per step (the others wait for it in every collective).

    >>> nodes = [{"node": 0, "host": "ct1", "ranks": [0, 1], "tokens_per_s": 900.0, "busy_s_per_step": 0.5},
    ...          {"node": 1, "host": "ct2", "ranks": [2, 3], "tokens_per_s": 700.0, "busy_s_per_step": 0.8}]
    >>> rep = {"run": {"state": "running"}, "unit": {"ActiveState": "active"},
    ...        "status": {"step": 40, "tokens_per_s": 1600.0, "nodes": nodes}}
    >>> run_summary({"a": dict(rep, hostname="ct1"), "b": dict(rep, hostname="ct2")})
    ['run of 2 nodes: step 40, 1,600 tokens/s summed over the nodes (a 900, b 700); slowest node b (ct2, busy 0.80 s/step, fastest 0.50); units: a active, b active']
    >>> rep["run"]["state"] = "failed"
    >>> run_summary({"a": dict(rep, hostname="ct1"), "b": {"run": {"state": "stopped"}, "unit": {"ActiveState": "inactive"}}})
    ['run of 2 nodes: step 40, not running (a failed, b stopped); units: a active, b inactive']
    """
    reports = reports or {}
    names = sorted(reports)
    units = ", ".join(f"{h} {(reports[h].get('unit') or {}).get('ActiveState', '?')}" for h in names)
    status = (
        next(
            (reports[h].get("status") for h in names if (reports[h].get("status") or {}).get("step") is not None),
            {},
        )
        or {}
    )
    states = {h: (reports[h].get("run") or {}).get("state", "?") for h in names}
    head = f"run of {len(names)} nodes: step {status.get('step', '?')}"
    if any(v != "running" for v in states.values()):
        return [f"{head}, not running ({', '.join(f'{h} {states[h]}' for h in names)}); units: {units}"]
    nodes = status.get("nodes") or []
    host_of = {reports[h].get("hostname"): h for h in names}
    per = {host_of.get(n.get("host"), n.get("host")): n for n in nodes}
    if not nodes:
        return [f"{head}, {_f(status.get('tokens_per_s'), ',.0f')} tokens/s; units: {units}"]
    total = sum(float(n.get("tokens_per_s") or 0) for n in nodes)
    slow_name, slow = max(per.items(), key=lambda kv: float(kv[1].get("busy_s_per_step") or 0))
    fastest = min(float(n.get("busy_s_per_step") or 0) for n in nodes)
    split = ", ".join(f"{h} {_f(n.get('tokens_per_s'), ',.0f')}" for h, n in sorted(per.items()))
    return [
        f"{head}, {_f(total, ',.0f')} tokens/s summed over the nodes ({split}); slowest node {slow_name} "
        f"({slow.get('host', '?')}, busy {_f(slow.get('busy_s_per_step'), '.2f')} s/step, fastest {_f(fastest, '.2f')}); "
        f"units: {units}"
    ]


def in_target_command(reach: dict) -> str:
    """The controller's command-line prefix that runs a command in the target, from its connection variables.

    >>> in_target_command({"connection": "pct", "vmid": 129, "node": "localhost", "pct": "/e/bin/pct-local"})
    '/e/bin/pct-local exec 129 --'
    >>> in_target_command({"connection": "pct", "vmid": 129, "node": "pve1", "node_user": "root"})
    'ssh root@pve1 pct exec 129 --'
    >>> in_target_command({"connection": "ssh", "host": "10.0.0.5", "user": "ubuntu"})
    'ssh ubuntu@10.0.0.5'
    """
    if reach.get("connection") == "pct":
        node = reach.get("node") or ""
        on_node = "" if node in ("", "localhost", "local") else f"ssh {reach.get('node_user') or 'root'}@{node} "
        return f"{on_node}{reach.get('pct') or 'pct'} exec {reach.get('vmid')} --"
    user = f"{reach['user']}@" if reach.get("user") else ""
    return f"ssh {user}{reach.get('host')}"


def tensorboard_lines(tensorboard: dict | None, run_dir: str, venv: str, in_target: str) -> list[str]:
    """Where the run's TensorBoard events are and the two ways to look at them: in the target, or fetched.

    >>> tensorboard_lines({"dir": "/r/tensorboard", "event_files": 2}, "/r", "/opt/v", "pct exec 129 --")
    ... # doctest: +NORMALIZE_WHITESPACE
    ['tensorboard: 2 event file(s) in /r/tensorboard; in the target: /opt/v/bin/tensorboard --logdir /r/tensorboard
      --bind_all (port 6006 of its address)',
     'on this controller: pct exec 129 -- tar -C /r -cf - tensorboard | tar -xf - && tensorboard --logdir tensorboard']
    >>> tensorboard_lines({}, "/r", "/opt/v", "ssh node1")
    []
    """
    if not (tensorboard or {}).get("event_files"):
        return []
    folder = tensorboard["dir"]
    return [
        f"tensorboard: {tensorboard['event_files']} event file(s) in {folder}; in the target: "
        f"{venv}/bin/tensorboard --logdir {folder} --bind_all (port 6006 of its address)",
        f"on this controller: {in_target} tar -C {run_dir} -cf - {folder.rsplit('/', 1)[-1]} | tar -xf - && "
        f"tensorboard --logdir {folder.rsplit('/', 1)[-1]}",
    ]


def _rate_lines(s: dict) -> list[str]:
    """A running run's step time and its split, throughput and memory, loss and ETA (from status.json)."""
    split = s.get("time_split") or {}
    lines = [
        f"{_f(s.get('step_time_s'), '.2f')} s/step (fetch {_f(split.get('fetch'), '.2f')}, "
        f"fwd {_f(split.get('fwd'), '.2f')}, bwd {_f(split.get('bwd'), '.2f')}, opt {_f(split.get('opt'), '.2f')})",
        f"{_f(s.get('tokens_per_s'), ',.0f')} tokens/s, {_f(s.get('tokens_per_s_per_rank'), ',.0f')} per worker; "
        f"peak memory {_f(s.get('peak_mem_gb'), '.2f')} GB ({s.get('mem_kind', '?')})",
    ]
    if s.get("loss") is not None:
        eta = f"; ETA {_duration(s['eta_s'])}" if s.get("eta_s") is not None else ""
        lines.append(f"loss {_f(s['loss'], '.4f')}, full_acc_0 {_f(s.get('full_acc_0'), '.3f')}{eta}")
    return lines


def training_summary(
    report: dict | None,
    gpus: list | None,
    unit_name: str | None = None,
    now=None,
    run_dir: str = "",
    venv: str = "",
    in_target: str = "",
):
    """Summary lines for train.yml and status.yml, from train_report's result and gpu_facts.

    Rates and ETA are shown only while the run is running: a stopped or failed run has none.

    >>> report = {"run": {"state": "running", "reason": "", "detail": "", "stalled": False, "workers": 2},
    ...           "unit": {"ActiveState": "active", "SubState": "running", "NRestarts": "0"},
    ...           "status": {"phase": "training", "step": 12, "world_size": 2, "max_seq_len": 16384,
    ...                      "step_time_s": 1.5, "tokens_per_s": 20000, "tokens_per_s_per_rank": 10000,
    ...                      "peak_mem_gb": 1.4, "mem_kind": "rss", "loss": 3.2, "full_acc_0": 0.41, "eta_s": 3725,
    ...                      "resumed_from_step": 10, "last_checkpoint_step": 10, "last_checkpoint_time": 1000}}
    >>> training_summary(report, [], now=1075)[:5]
    ['state: running; eagle3-train.service active (running), restarts 0; 2 workers, max_seq_len 16384', 'step 12 (epoch 0), resumed from step 10; last checkpoint step 10 (1m15s ago)', '1.50 s/step (fetch ?, fwd ?, bwd ?, opt ?)', '20,000 tokens/s, 10,000 per worker; peak memory 1.40 GB (rss)', 'loss 3.2000, full_acc_0 0.410; ETA 1h02m']
    >>> report["run"] = {"state": "failed", "reason": "oom: CUDA out of memory", "detail": "unit failed (result exit-code)",
    ...                  "workers": 2}
    >>> training_summary(report, [], now=1075)[:3]
    ['state: failed (unit failed (result exit-code)); eagle3-train.service active (running), restarts 0; 2 workers, max_seq_len 16384', 'reason: oom: CUDA out of memory', 'step 12 (epoch 0), resumed from step 10; last checkpoint step 10 (1m15s ago)']
    """
    unit_name = unit_name or default_unit()
    import time

    now = time.time() if now is None else now
    r = report or {}
    run, s, u = r.get("run") or {}, r.get("status") or {}, r.get("unit") or {}
    state = run.get("state", "?")
    detail = f" ({run['detail']})" if run.get("detail") else ""
    lines = [
        f"state: {state}{detail}; {unit_name} {u.get('ActiveState', '?')} ({u.get('SubState', '?')}), "
        f"restarts {u.get('NRestarts', '?')}; {_workers(run, s)}, max_seq_len {s.get('max_seq_len', '?')}"
        f"{_parallel(s)}"
    ]
    if run.get("reason") and state != "running":
        lines.append(f"reason: {run['reason']}")
    elif run.get("reason"):
        lines.append(f"the previous run ended with {run['reason']}")
    if (r.get("last_stop") or {}).get("message"):
        lines.append(f"last stop: {r['last_stop']['message']}")
    if "step" in s:
        resumed = f", resumed from step {s['resumed_from_step']}" if s.get("resumed_from_step") else ""
        ckpt = ""
        if s.get("last_checkpoint_step") is not None:
            when = f" ({_ago(now - s['last_checkpoint_time'])})" if s.get("last_checkpoint_time") else ""
            ckpt = f"; last checkpoint step {s['last_checkpoint_step']}{when}"
        lines.append(f"step {s['step']} (epoch {s.get('epoch', 0)}){resumed}{ckpt}{_previous(s)}")
    for skipped in s.get("skipped_checkpoints") or []:
        moved = f"; moved aside to {skipped['moved_to']}" if skipped.get("moved_to") else "; left in place"
        lines.append(f"skipped corrupt checkpoint {skipped.get('name', '?')}: {skipped.get('reason', '?')}{moved}")
    if state == "running" and run.get("stalled"):
        lines.append(
            f"no current rate while stalled (the last steps ran at {_f(s.get('tokens_per_s'), ',.0f')} tokens/s, "
            f"{_f(s.get('step_time_s'), '.2f')} s/step)"
        )
    elif state == "running":
        lines.extend(_rate_lines(s))
    elif s.get("loss") is not None:
        lines.append(f"last loss {_f(s['loss'], '.4f')}, full_acc_0 {_f(s.get('full_acc_0'), '.3f')}")
    nodes = s.get("nodes") or []
    if len(nodes) > 1 and state == "running" and not run.get("stalled"):
        mine = [n for n in nodes if n.get("host") == r.get("hostname")]
        for n in mine or nodes:
            lines.append(_node_line(n, nodes))
    lines.extend(line for line in (_acceptance(s), _tracker(s)) if line)
    if run_dir:
        lines.extend(tensorboard_lines(r.get("tensorboard"), run_dir, venv, in_target))
    for h in r.get("foreign_holders") or []:
        lines.append(f"GPU held outside the unit: {_holder(h)}")
    for h in r.get("protected_holders") or []:
        lines.append(f"GPU held by a protected process (never signalled): {_holder(h)}")
    if not gpus:
        lines.append("GPUs: none visible (CPU workers)")
    for g in gpus or []:
        line = (
            f"GPU{g.get('index', '?')} {g.get('name', '?')}: {g.get('utilization_pct', '?')}% util at "
            f"{g.get('power_draw_w', '?')}/{g.get('power_limit_w', '?')} W, "
            f"{g.get('memory_used_mib', '?')}/{g.get('memory_total_mib', '?')} MiB"
        )
        if g.get("starved"):
            line += (
                " - STARVED: busy but far below its power limit (waiting on all-reduce or data: compare fetch and bwd)"
            )
        lines.append(line)
    return lines


def _tracker(s: dict) -> str:
    """The experiment tracker's failure, when it failed (training goes on without it), else ''.

    >>> _tracker({"tracker": {"name": "wandb", "ok": False, "error": "ImportError: no module x", "at": "start"}})
    'tracker wandb FAILED at start (ImportError: no module x): training goes on without it; see the journal'
    >>> _tracker({"tracker": {"name": "wandb", "ok": True}}), _tracker({})
    ('', '')
    """
    tracker = s.get("tracker") or {}
    if not tracker or tracker.get("ok", True):
        return ""
    return (
        f"tracker {tracker.get('name', '?')} FAILED at {tracker.get('at') or '?'} ({tracker.get('error') or '?'}): "
        "training goes on without it; see the journal"
    )


def stopped_summary(last: dict | None, vmid, pct_status: str = "", now=None) -> list[str]:
    """The state line of a stopped CT, with what the controller last saw of its run (nothing inside can be read).

    >>> stopped_summary({"seen": 1000, "status": {"step": 40, "last_checkpoint_step": 40, "last_checkpoint_time": 990},
    ...                  "run": {"state": "running"}}, 129, "status: stopped", now=1600)
    ... # doctest: +NORMALIZE_WHITESPACE
    ['state: stopped (CT 129: status: stopped); nothing in it runs or holds a GPU',
     'last checkpoint step 40 (10m10s ago), as reported while it ran, 10m00s ago (state running, step 40)',
     'when the CT starts, the enabled unit resumes from its newest checkpoint']
    >>> stopped_summary({}, 129, now=1)[1]
    'no report of its run on this controller (status.yml or train.yml saw it running never, or elsewhere)'
    """
    import time

    now = time.time() if now is None else now
    lines = [f"state: stopped (CT {vmid}{': ' + pct_status if pct_status else ''}); nothing in it runs or holds a GPU"]
    s, run = (last or {}).get("status") or {}, (last or {}).get("run") or {}
    if not last or not last.get("seen"):
        lines.append(
            "no report of its run on this controller (status.yml or train.yml saw it running never, or elsewhere)"
        )
        return lines
    seen = f"as reported while it ran, {_ago(now - float(last['seen']))} (state {run.get('state', '?')}, step {s.get('step', '?')})"
    if s.get("last_checkpoint_step") is not None:
        when = f" ({_ago(now - s['last_checkpoint_time'])})" if s.get("last_checkpoint_time") else ""
        lines.append(f"last checkpoint step {s['last_checkpoint_step']}{when}, {seen}")
    else:
        lines.append(f"no checkpoint yet, {seen}")
    lines.append("when the CT starts, the enabled unit resumes from its newest checkpoint")
    return lines


class FilterModule:
    def filters(self):
        return {
            "training_summary": training_summary,
            "in_target_command": in_target_command,
            "run_summary": run_summary,
            "stopped_summary": stopped_summary,
        }


def default_unit() -> str:
    """The training unit's name where it is declared (module_utils/restart_backoff.py DEFAULT_UNIT, through the
    target_constant filter's reader): the role passes gpu_cleanup_unit, which is that name unless overridden."""
    path = Path(__file__).resolve().parents[3] / "plugins" / "filter" / "declared_constants.py"
    spec = importlib.util.spec_from_file_location("_eagle3_summary_declared_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.target_constant("restart_backoff.DEFAULT_UNIT")
