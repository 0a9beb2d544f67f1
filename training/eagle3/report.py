"""`python -m eagle3 report RUN_DIR [RUN_DIR ...] -o report.png`: one page of plots for one run or several.

Reads what a run leaves in its directory (metrics.jsonl, telemetry.jsonl, status.json, config.yaml), whatever
state it is in: running, stopped or failed. A line that does not parse (a run killed mid-write leaves a
truncated last line) is skipped and named on stderr, on the page and in the sidecar JSON.

The page (docs/observability.md describes each panel): loss, full and conditional accuracy per TTT step,
acceptance length, tokens/s, the step time split, peak memory per rank against the memory planner's prediction,
GPU power against utilisation with starved samples marked. `-o NAME.png` writes the PNG (the panel titles also in
its text metadata) and NAME.json beside it; `-o NAME.html` writes one self-contained HTML page.

matplotlib is imported here only, with the Agg backend: training never needs it and no display is used.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle3.errors import EXIT_OK, ConfigError

PANELS = (
    "Loss per TTT step",
    "Full accuracy per TTT step",
    "Conditional accuracy per TTT step",
    "Acceptance length (validation)",
    "Tokens/s",
    "Step time split",
    "Peak memory per rank vs planner",
    "GPU power vs utilisation",
)
PHASES = (("fetch", "fetch"), ("fwd", "forward"), ("bwd", "backward"), ("opt", "optimizer"))


@dataclass
class Run:
    """What one run directory holds, as far as it could be read."""

    path: Path
    label: str
    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    evaluated: list[dict] = field(default_factory=list)  # `eagle3 evaluate` results (evaluate.jsonl)
    gpu: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    planned_gb: float | None = None
    planned_note: str = ""


def read_jsonl(path: Path, skipped: list[str]) -> list[dict]:
    """The records of a JSONL file; each line that is not a JSON object is named in `skipped`.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); p = Path(d, "m.jsonl")
    >>> _ = p.write_text('{"step": 1}\\n\\n{"step": 2, "lo')
    >>> out = []; read_jsonl(p, out), out
    ([{'step': 1}], ['m.jsonl line 3 skipped: truncated or not JSON (Unterminated string starting at: line 1 column 13 (char 12))'])
    """
    if not path.is_file():
        return []
    records = []
    with path.open(errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                skipped.append(f"{path.name} line {n} skipped: truncated or not JSON ({e})")
                continue
            if not isinstance(value, dict):
                skipped.append(f"{path.name} line {n} skipped: not a JSON object")
                continue
            records.append(value)
    return records


def planner_prediction(run_dir: Path, config: dict, world_size: int) -> tuple[float | None, str]:
    """The memory planner's peak GiB per rank for the run's own config, or None and why not."""
    if not config:
        return None, "no config.yaml"
    try:
        from eagle3.config import build_config
        from eagle3.data import read_index
        from eagle3.plan.model import GIB, predict_peak_bytes
        from eagle3.spec import resolve_spec

        cfg = build_config(config, {})
        spec = resolve_spec(cfg, read_index(cfg.data_dir), cfg.device, world_size)
        return predict_peak_bytes(spec, cfg.max_seq_len) / GIB, "planner"
    except Exception as e:  # the dataset moved, an older config: the panel says so instead
        return None, f"no planner prediction ({type(e).__name__}: {str(e)[:80]})"


def load_run(path: str | Path, label: str | None = None) -> Run:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ConfigError(f"report: {run_dir} is not a directory (give the run_dir of `eagle3 train`)")
    run = Run(run_dir, label or run_dir.name)
    for record in read_jsonl(run_dir / "metrics.jsonl", run.skipped):
        (run.val if record.get("kind") == "val" else run.train).append(record)
    run.train = [r for r in run.train if isinstance(r.get("step"), int | float)]
    run.gpu = [r for r in read_jsonl(run_dir / "telemetry.jsonl", run.skipped) if r.get("kind") == "gpu"]
    run.evaluated = [
        r
        for r in read_jsonl(run_dir / "evaluate.jsonl", run.skipped)
        if isinstance(r.get("step"), int)
        and isinstance(r.get("tau_real"), int | float)
        and r.get("engine", "eagle3") == "eagle3"  # the project's decoder; vLLM's agrees (docs/serving.md)
    ]
    try:
        run.status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError) as e:
        run.skipped.append(f"status.json not read ({type(e).__name__})")
    try:
        run.config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        run.skipped.append(f"config.yaml not read ({type(e).__name__})")
    if not run.train and not run.val:
        run.skipped.append("metrics.jsonl has no records yet")
    world = int(run.status.get("world_size") or (run.train[-1].get("world_size") if run.train else 1) or 1)
    run.planned_gb, run.planned_note = planner_prediction(run_dir, run.config, world)
    return run


def run_title(run: Run) -> str:
    s = run.status
    msl = s.get("max_seq_len") or run.config.get("max_seq_len") or "?"
    error = (s.get("error") or {}).get("kind")
    state = s.get("phase", "unknown") + (f" ({error})" if error else "")
    return f"{run.label}: max_seq_len {msl}, {state}, step {s.get('step', '?')}/{s.get('max_steps', '?')}"


def _series(records: list[dict], key: str, k: int | None = None) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if k is not None:
            value = value[k] if isinstance(value, list) and k < len(value) else None
        if isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value)):
            xs.append(r["step"])
            ys.append(value)
    return xs, ys


def _ttt_steps(run: Run) -> int:
    for r in run.train + run.val:
        if isinstance(r.get("loss_per_step"), list):
            return len(r["loss_per_step"])
    return 0


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4", wrap=True)


def _per_ttt(ax, runs: list[Run], key: str, val_key: str | None, ylabel: str) -> None:
    styles = ("-", "--", ":", "-.")
    drawn = False
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for k in range(_ttt_steps(run)):
            xs, ys = _series(run.train, key, k)
            if xs:
                ax.plot(
                    xs,
                    ys,
                    color=color,
                    linestyle=styles[k % 4],
                    alpha=max(0.35, 1 - 0.15 * k),
                    label=f"{run.label} ttt {k}" if len(runs) > 1 or k < 4 else None,
                )
                drawn = True
            if val_key:
                vx, vy = _series(run.val, val_key, k)
                if vx:
                    ax.plot(vx, vy, "o", color=color, alpha=max(0.35, 1 - 0.15 * k), markersize=4)
    if not drawn:
        _empty(ax, "no train records yet")
        return
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6, ncol=2)


def _acceptance_panel(ax, runs: list[Run]) -> None:
    drawn = False
    for i, run in enumerate(runs):
        xs, ys = _series(run.val, "acceptance_length")
        if xs:
            ax.plot(xs, ys, "o-", color=f"C{i % 10}", label=f"{run.label} (target vocab)")
            dx, dy = _series(run.val, "acceptance_length_draft_vocab")
            ax.plot(dx, dy, "x:", color=f"C{i % 10}", alpha=0.6, label=f"{run.label} (draft vocab bound)")
            px, py = _series(run.val, "tau_predicted")
            if px:  # the rounds a decoder would run over the validation responses: the prediction of tau_real
                ax.plot(px, py, "s--", color=f"C{i % 10}", alpha=0.8, label=f"{run.label} (tau_predicted)")
            drawn = True
        if run.evaluated:  # measured by speculative decoding (eagle3 evaluate), K drafts per round
            ex, ey = _series(run.evaluated, "tau_real")
            ax.plot(ex, ey, "*", markersize=11, color=f"C{i % 10}", label=f"{run.label} (tau_real, evaluate)")
            drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel("tokens per draft-and-verify round")
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no validation yet: the acceptance length appears after the first one (val_every)")


def _throughput_panel(ax, runs: list[Run]) -> None:
    drawn = False
    for i, run in enumerate(runs):
        xs, ys = _series(run.train, "tokens_per_s")
        if xs:
            ax.plot(xs, ys, color=f"C{i % 10}", label=f"{run.label} (all ranks)")
            px, py = _series(run.train, "tokens_per_s_per_rank")
            ax.plot(px, py, color=f"C{i % 10}", linestyle="--", alpha=0.6, label=f"{run.label} (per rank)")
            drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no train records yet")


def _time_split_panel(ax, runs: list[Run]) -> None:
    labels = []
    rows = [(run, [r for r in run.train if isinstance(r.get("time_split"), dict)]) for run in runs]
    rows = [(run, recs) for run, recs in rows if recs]
    for y, (run, recs) in enumerate(rows):
        left = 0.0
        for j, (key, name) in enumerate(PHASES):
            ms = 1000 * sum(r["time_split"].get(key, 0.0) for r in recs) / len(recs)
            ax.barh(y, ms, left=left, color=f"C{j}", label=name if y == 0 else None)
            left += ms
        labels.append(run.label)
    if rows:
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.set_xlabel("ms per step (mean over the run's records)")
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no train records yet")


def _memory_panel(ax, runs: list[Run]) -> None:
    drawn = False
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        last = next((r for r in reversed(run.train) if r.get("peak_mem_gb_per_rank")), None)
        if last is None:
            continue
        ranks = last["peak_mem_gb_per_rank"]
        xs = [rank + (i - (len(runs) - 1) / 2) * width for rank in range(len(ranks))]
        ax.bar(xs, ranks, width=width, color=f"C{i % 10}", label=f"{run.label} measured ({last.get('mem_kind')})")
        if run.planned_gb is not None:
            ax.hlines(
                run.planned_gb,
                -0.5,
                len(ranks) - 0.5,
                colors=f"C{i % 10}",
                linestyles="--",
                label=f"{run.label} planner {run.planned_gb:.2f} GiB",
            )
        else:
            ax.text(0.02, 0.95 - 0.06 * i, f"{run.label}: {run.planned_note}", transform=ax.transAxes, fontsize=7)
        drawn = True
    if drawn:
        ax.set_xticks(range(max(len(r.train[-1].get("peak_mem_gb_per_rank") or [1]) for r in runs if r.train)))
        ax.set_xlabel("rank")
        ax.set_ylabel("peak GiB (cuda: allocated; rss: CPU resident)")
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no train records yet")


def _plot_gpu_samples(ax, ax2, i: int, run: Run, samples: list[dict]) -> None:
    """One run's power (solid, left axis) and utilisation (dotted, right axis) per GPU, starved samples marked."""
    t0 = samples[0]["time"]
    for g in samples[0]["gpus"]:
        idx = g["index"]
        pts = [(s["time"] - t0) / 60 for s in samples]
        per = [next((x for x in s["gpus"] if x["index"] == idx), {}) for s in samples]
        ax.plot(
            pts, [p.get("power_w") for p in per], color=f"C{i % 10}", alpha=0.8, label=f"{run.label} gpu{idx} power"
        )
        ax2.plot(
            pts,
            [p.get("util_pct") for p in per],
            color=f"C{i % 10}",
            linestyle=":",
            alpha=0.8,
            label=f"{run.label} gpu{idx} util",
        )
        starved = [(t, p.get("power_w")) for t, p in zip(pts, per, strict=True) if p.get("starved")]
        if starved:
            ax.plot(
                *zip(*starved, strict=True),
                "rx",
                markersize=7,
                label="starved (util >= 90 %, power < 50 % of limit)" if i == 0 and idx == 0 else None,
            )


def _gpu_panel(ax, runs: list[Run]) -> None:
    drawn = False
    notes = []
    ax2 = None
    for i, run in enumerate(runs):
        samples = [s for s in run.gpu if s.get("gpus")]
        if not samples:
            note = next((s.get("note") for s in run.gpu if s.get("note")), None)
            notes.append(f"{run.label}: {note or 'no telemetry recorded'}")
            continue
        if ax2 is None:
            ax2 = ax.twinx()
        _plot_gpu_samples(ax, ax2, i, run, samples)
        drawn = True
    if drawn:
        ax.set_xlabel("minutes since the first sample")
        ax.set_ylabel("power (W)")
        ax2.set_ylabel("utilisation (%)")
        ax2.set_ylim(0, 105)
        ax.legend(fontsize=6, loc="upper left")
        ax2.legend(fontsize=6, loc="lower right")
    if notes:
        _empty(ax, "\n".join(notes)) if not drawn else ax.text(
            0.02, 0.02, "\n".join(notes), transform=ax.transAxes, fontsize=7
        )


def render_figure(runs: list[Run]):
    """The report page (one panel per PANELS entry), its title and the lines skipped while reading the runs."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 18), dpi=80, layout="constrained")
    axes = fig.subplots(4, 2).flatten()
    for ax, title in zip(axes, PANELS, strict=True):
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)

    _per_ttt(axes[0], runs, "loss_per_step", "loss_per_step", "loss (forward KL; dots: validation)")
    _per_ttt(axes[1], runs, "full_acc", "full_acc", "top-1 accuracy, all positions (dots: validation)")
    _per_ttt(axes[2], runs, "cond_acc", "cond_acc", "top-1 accuracy given earlier steps right")
    _acceptance_panel(axes[3], runs)
    _throughput_panel(axes[4], runs)
    _time_split_panel(axes[5], runs)
    _memory_panel(axes[6], runs)
    _gpu_panel(axes[7], runs)

    title = "EAGLE-3 training report\n" + "\n".join(run_title(r) for r in runs)
    fig.suptitle(title, fontsize=12)
    skipped = [f"{r.label}: {s}" for r in runs for s in r.skipped]
    if skipped:
        fig.text(0.01, 0.001, "\n".join(skipped[:8]), fontsize=7, color="darkred", va="bottom")
    return fig, title, skipped


def summary(runs: list[Run], title: str, skipped: list[str], image: str) -> dict:
    return {
        "title": title,
        "panels": list(PANELS),
        "image": image,
        "runs": [
            {
                "run_dir": str(r.path),
                "label": r.label,
                "phase": r.status.get("phase"),
                "step": r.status.get("step"),
                "max_seq_len": r.status.get("max_seq_len") or r.config.get("max_seq_len"),
                "train_records": len(r.train),
                "val_records": len(r.val),
                # tau_real measured by `eagle3 evaluate` at checkpoints of the run: [step, tau_real, k]
                "tau_real": [[e["step"], e["tau_real"], e.get("k")] for e in r.evaluated],
                "gpu_samples": len(r.gpu),
                "planned_peak_gb": r.planned_gb,
                "planner": r.planned_note,
            }
            for r in runs
        ],
        "skipped": skipped,
    }


def write_report(run_dirs: list[str], out: str | Path, labels: list[str] | None = None) -> dict:
    """Render the page to `out` (.png or .html); returns the sidecar summary (also written for a PNG)."""
    out = Path(out)
    if out.suffix.lower() not in (".png", ".html"):
        raise ConfigError(f"report: -o {out} must end in .png or .html")
    labels = list(labels or [])
    if labels and len(labels) != len(run_dirs):
        raise ConfigError(f"report: {len(labels)} --label for {len(run_dirs)} run directories")
    runs = [load_run(d, labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    fig, title, skipped = render_figure(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    metadata = {"Title": title, "Description": "panels: " + "; ".join(PANELS), "Software": "eagle3 report"}
    fig.savefig(buf, format="png", metadata=metadata)
    info = summary(runs, title, skipped, out.name)
    if out.suffix.lower() == ".png":
        out.write_bytes(buf.getvalue())
        out.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    else:
        out.write_text(html_page(info, buf.getvalue()))
    return info


def html_page(info: dict, png: bytes) -> str:
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(r[k]))}</td>"
            for k in (
                "label",
                "phase",
                "step",
                "max_seq_len",
                "train_records",
                "val_records",
                "gpu_samples",
                "planned_peak_gb",
            )
        )
        + "</tr>"
        for r in info["runs"]
    )
    skipped = "".join(f"<li>{html.escape(s)}</li>" for s in info["skipped"]) or "<li>none</li>"
    panels = "".join(f"<li>{html.escape(p)}</li>" for p in info["panels"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(info["title"].splitlines()[0])}</title>
<script type="application/json" id="eagle3-report">{html.escape(json.dumps(info))}</script></head>
<body><h1>EAGLE-3 training report</h1>
<table border="1"><tr><th>run</th><th>phase</th><th>step</th><th>max_seq_len</th><th>train records</th>
<th>val records</th><th>GPU samples</th><th>planned peak GiB</th></tr>{rows}</table>
<h2>Panels</h2><ul>{panels}</ul>
<img alt="report" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Skipped lines</h2><ul>{skipped}</ul></body></html>
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle3 report",
        description="Plot one run or compare several on one page (PNG with a JSON sidecar, or HTML).",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `eagle3 train`")
    p.add_argument("-o", "--output", default="report.png", help="report.png (and report.json) or report.html")
    p.add_argument(
        "--label", action="append", default=None, help="a name per RUN_DIR, in order (default: the directory names)"
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    info = write_report(args.run_dirs, args.output, args.label)
    for line in info["skipped"]:
        print(f"report: {line}", file=sys.stderr, flush=True)
    print(f"report: wrote {args.output} ({len(info['panels'])} panels, {len(info['runs'])} run(s))", flush=True)
    return EXIT_OK
