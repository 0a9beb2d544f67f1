# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``training_summary``: the lines a person watching a run wants, from status.json, the unit and gpu_facts."""

from __future__ import annotations


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


def training_summary(
    status: dict | None, unit: dict | None, gpus: list | None, unit_name: str = "eagle3-train.service"
):
    """Summary lines for train.yml and status.yml.

    >>> training_summary({"phase": "training", "step": 12, "world_size": 2, "max_seq_len": 16384,
    ...                   "step_time_s": 1.5, "tokens_per_s": 20000, "tokens_per_s_per_rank": 10000,
    ...                   "peak_mem_gb": 1.4, "mem_kind": "rss", "loss": 3.2, "full_acc_0": 0.41, "eta_s": 3725},
    ...                  {"ActiveState": "active", "SubState": "running", "NRestarts": "0"}, [])[1:4]
    ['step 12 (epoch 0): 1.50 s/step (fetch ?, fwd ?, bwd ?, opt ?)', '20,000 tokens/s, 10,000 per worker; peak memory 1.40 GB (rss)', 'loss 3.2000, full_acc_0 0.410; ETA 1h02m']
    """
    s, u = status or {}, unit or {}
    split = s.get("time_split") or {}
    lines = [
        f"{unit_name}: {u.get('ActiveState', '?')} ({u.get('SubState', '?')}), restarts {u.get('NRestarts', '?')}; "
        f"{s.get('world_size', '?')} workers, max_seq_len {s.get('max_seq_len', '?')}, "
        f"phase {s.get('phase', 'no status yet')}"
    ]
    if "step" in s:
        per_epoch = f", {s['steps_per_epoch']} steps/epoch" if s.get("steps_per_epoch") else ""
        lines.append(
            f"step {s['step']} (epoch {s.get('epoch', 0)}{per_epoch}): {_f(s.get('step_time_s'), '.2f')} s/step "
            f"(fetch {_f(split.get('fetch'), '.2f')}, fwd {_f(split.get('fwd'), '.2f')}, "
            f"bwd {_f(split.get('bwd'), '.2f')}, opt {_f(split.get('opt'), '.2f')})"
        )
    if "tokens_per_s" in s:
        lines.append(
            f"{_f(s['tokens_per_s'], ',.0f')} tokens/s, {_f(s.get('tokens_per_s_per_rank'), ',.0f')} per worker; "
            f"peak memory {_f(s.get('peak_mem_gb'), '.2f')} GB ({s.get('mem_kind', '?')})"
        )
    if s.get("loss") is not None:
        eta = f"; ETA {_duration(s['eta_s'])}" if s.get("eta_s") is not None else ""
        lines.append(f"loss {_f(s['loss'], '.4f')}, full_acc_0 {_f(s.get('full_acc_0'), '.3f')}{eta}")
    if s.get("error"):
        err = s["error"]
        lines.append(
            f"last error ({err.get('kind', '?')}, max_seq_len {err.get('max_seq_len', '?')}): {err.get('message', '')}"
        )
    if not gpus:
        lines.append("GPUs: none visible (CPU workers)")
    for g in gpus or []:
        line = (
            f"GPU{g.get('index', '?')} {g.get('name', '?')}: {g.get('utilization_pct', '?')}% util at "
            f"{g.get('power_draw_w', '?')}/{g.get('power_limit_w', '?')} W, "
            f"{g.get('memory_used_mib', '?')}/{g.get('memory_total_mib', '?')} MiB"
        )
        if g.get("starved"):
            line += " - STARVED: busy but far below its power limit (waiting on all-reduce or data: compare fetch and bwd)"
        lines.append(line)
    return lines


class FilterModule:
    def filters(self):
        return {"training_summary": training_summary}
