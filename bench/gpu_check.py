#!/usr/bin/env python3
"""Everything that needs a real GPU, in one run of a few minutes; figures into one JSON file.

    bench/gpu_check.sh                 # on a CUDA machine (the wrapper checks the driver and torch first)
    bench/gpu_check.sh --dry-run       # anywhere: the same Python path on CPU with a tiny drafter

Sections, each timed, each recorded even when it fails (the next one still runs):
  cleanup   real /dev/nvidia* holders (child processes that initialised CUDA and hold memory, one ignoring
            SIGTERM, all carrying a marker) are found by the device scan, released by gpu_cleanup (the
            module's run() when ansible is importable, else its module_utils), and NVML memory returns to the
            baseline. Only processes this script started are ever signalled (selected by their marker).
  flex      compiled flex_attention forward+backward of the TTT mask against the exact path on the GPU.
  sweep     Kimi-shaped drafter on one GPU, ttt_steps 5: peak memory and tokens/s per max_seq_len (4096 ..
            32768), with and without activation checkpointing, stopping at the first OOM; the planner's
            prediction for the same run next to each measurement; step time, FLOP/s (eagle3.flops) against a
            bf16 matmul microbenchmark of the step's shapes in the same run and against the datasheet peak
            (MFU), and NVML power against utilisation during the step (docs/speed.md).
  probe     eagle3.plan.probe (real steps at two lengths, fit, choice for 8 x 96 GiB) and its cache.

Writes $OUT/gpu_check.json when OUT is set, else bench/results/gpu_check-<time>.json. Exit 0 when every
section ran (figures may still show a problem: read them), 1 when a section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "training"))
sys.path.insert(0, str(ROOT))  # module_utils as a package: its files import each other relatively

# Before CUDA initialises (docs/facts.md#memory-and-flex-attention).
for _var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
    os.environ.setdefault(_var, "expandable_segments:True")

import torch  # noqa: E402
from eagle3 import plan as P  # noqa: E402

from module_utils.procs import DEVICE_GLOBS  # noqa: E402  (the one declaration)

MARKER_NAME = "EAGLE3_GPU_CHECK"
HOLDER_CODE = r"""
import os, signal, sys, time, torch
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
x = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8, device="cuda")  # MiB held until killed
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    time.sleep(0.5)
"""


class Report:
    def __init__(self, path: Path, dry_run: bool):
        self.path = path
        self.data: dict = {"dry_run": dry_run, "started": time.time(), "sections": {}}

    def section(self, name: str, result: dict) -> None:
        self.data["sections"][name] = result
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def environment(device: torch.device) -> dict:
    env = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / P.GIB, 2)}
        try:
            from eagle3.distributed import expandable_segments_active

            env["expandable_segments"] = expandable_segments_active()
        except ImportError:
            env["expandable_segments"] = None
    return env


# ----------------------------------------------------------------------------------------------- cleanup


def nvml_used_mib() -> list[dict] | None:
    from module_utils import nvml

    return nvml.memory_used(nvml.query_gpus(timeout=10.0))


def run_cleanup_module(marker: str) -> dict:
    """gpu_cleanup's own run() with the job marker as the only selector; module_utils when ansible is missing."""
    try:
        import ansible.module_utils

        ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
        import importlib.util

        spec = importlib.util.spec_from_file_location("gpu_cleanup", ROOT / "library" / "gpu_cleanup.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        module = None
    if module is not None:
        params = {k: v.get("default") for k, v in module.argument_spec().items()}
        params |= {
            "marker": marker,
            "devices": [],
            "term_timeout": 5,
            "kill_timeout": 5,
            "timeout": 60,
            "sweep": [],
        }
        result, failure = module.run(params, check_mode=False, self_pid=os.getpid())
        return {"via": "library/gpu_cleanup.py run()", "result": result, "failure": failure}
    from module_utils import proc_stop, procs

    outcome = proc_stop.terminate(
        procs.Selectors(marker=marker),
        proc_stop.Budget(term=5, kill=5, stop=5, total=60),
        self_pid=os.getpid(),
    )
    return {"via": "module_utils/proc_stop.terminate", "result": outcome, "failure": None}


def section_cleanup(dry_run: bool) -> dict:
    if dry_run:
        return {"skipped": "dry run: real /dev/nvidia* holders need a GPU (tests/ cover stand-in devices)"}
    from module_utils import procs

    before = nvml_used_mib()
    marker_value = uuid.uuid4().hex[:12]
    env = {**os.environ, MARKER_NAME: marker_value}
    children = []
    try:
        for kind in ("polite", "stubborn"):
            child = subprocess.Popen(
                [sys.executable, "-c", HOLDER_CODE, kind, "1024"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            children.append(child)
        for child in children:
            line = child.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"holder {child.pid} did not start: {child.stderr.read()[-500:]}")
        pids = {c.pid for c in children}
        held = [h for h in procs.holders(DEVICE_GLOBS, self_pid=os.getpid()) if h["pid"] in pids]
        during = nvml_used_mib()
        started = time.monotonic()
        cleanup = run_cleanup_module(f"{MARKER_NAME}={marker_value}")
        released_s = time.monotonic() - started
        left = [h for h in procs.holders(DEVICE_GLOBS, self_pid=os.getpid()) if h["pid"] in pids]
        after, waited = nvml_used_mib(), 0.0
        while (
            before
            and after
            and waited < 15
            and any(a["used_mib"] > b["used_mib"] + 256 for a, b in zip(after, before, strict=False))
        ):
            time.sleep(0.5)
            waited += 0.5
            after = nvml_used_mib()
        back = (
            None
            if not (before and after)
            else all(a["used_mib"] <= b["used_mib"] + 256 for a, b in zip(after, before, strict=False))
        )
        return {
            "holders_found": sorted(h["pid"] for h in held),
            "holder_paths": sorted({p for h in held for p in h["paths"]}),
            "all_found": {h["pid"] for h in held} == pids,
            "released_s": round(released_s, 2),
            "left_after": left,
            "nvml_used_mib": {"before": before, "during": during, "after": after},
            "memory_back_to_baseline": back,
            "cleanup": cleanup,
            "ok": {h["pid"] for h in held} == pids and not left and back is not False,
        }
    finally:
        for child in children:  # reap ours by PID, whatever happened above
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)


# ----------------------------------------------------------------------------------------------- flex


def section_flex(device: torch.device, dry_run: bool) -> dict:
    from eagle3.attention import TTTAttention

    seq_len, heads, head_dim, steps = (512, 4, 32, 3) if dry_run else (4096, 8, 64, 3)
    dtype = torch.float32 if dry_run else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    doc = torch.repeat_interleave(torch.arange(4), seq_len // 4).to(device)  # four documents

    def tensors():
        return [
            torch.randn(heads, seq_len, head_dim, generator=gen).to(device, dtype).requires_grad_(not dry_run)
            for _ in range(1 + 2 * steps)
        ]

    inputs = tensors()
    q, ks, vs = inputs[0], inputs[1 : 1 + steps], inputs[1 + steps :]
    results = {}
    for kind in ("exact", "flex"):
        attn = TTTAttention(doc, kind)
        for x in inputs:
            x.grad = None
        started = time.monotonic()
        out = attn(q, ks, vs)
        if dry_run:  # flex has no backward on CPU: forward parity only
            results[kind] = {"out": out.detach().float(), "s": time.monotonic() - started}
            continue
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        first = time.monotonic() - started
        started = time.monotonic()
        for x in inputs:
            x.grad = None
        out = attn(q, ks, vs)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        results[kind] = {
            "out": out.detach().float(),
            "grads": [x.grad.float() for x in inputs],
            "first_s": first,
            "s": time.monotonic() - started,
        }
    ex, fl = results["exact"], results["flex"]
    report = {
        "seq_len": seq_len,
        "heads": heads,
        "head_dim": head_dim,
        "ttt_step": steps - 1,
        "dtype": str(dtype),
        "max_abs_diff_out": float((ex["out"] - fl["out"]).abs().max()),
    }
    if "grads" in fl:
        report["max_abs_diff_grad"] = max(
            float((a - b).abs().max()) for a, b in zip(ex["grads"], fl["grads"], strict=True)
        )
        report |= {"flex_first_s": round(fl["first_s"], 2), "flex_fwd_bwd_s": round(fl["s"], 4)}
        report["exact_fwd_bwd_s"] = round(ex["s"], 4)
    tolerance = 1e-4 if dry_run else 5e-2
    report["ok"] = report["max_abs_diff_out"] <= tolerance and report.get("max_abs_diff_grad", 0.0) <= tolerance * 4
    return report


# ----------------------------------------------------------------------------------------------- sweep


def recipe(dry_run: bool, shape, world_size: int = 1, reserve_gib: float = 0.0, **keys) -> P.RunSpec:
    """The trainer's CUDA recipe for config `keys`, resolved as the trainer resolves it (bf16 autocast, frozen
    weights in bf16, flex); a dry run takes the same recipe to the CPU with the exact attention path."""
    spec = dataclasses.replace(P.on_cuda(shape, world_size=world_size, **keys), reserve_gib=reserve_gib)
    return spec.with_run(device="cpu", attention="exact") if dry_run else spec


def run_steps(spec: P.RunSpec, seq_len: int, device: torch.device, steps: int = 2):
    """Real training steps as eagle3.train runs them; the last one is measured: (static, peak, seconds)."""
    from eagle3.memtrack import LiveBytesTracker
    from eagle3.model import ttt_forward

    model, optimizer, batch = P.build_probe_step(spec, seq_len, device)
    cuda = device.type == "cuda"
    try:
        for n in range(steps):
            last = n == steps - 1
            if last and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if cuda else 0
            tracker = LiveBytesTracker() if (last and not cuda) else contextlib.nullcontext()
            started = time.monotonic()
            with tracker, torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.run.autocast):
                loss, _ = ttt_forward(model, batch, **spec.run.ttt_kwargs())
            with tracker:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.monotonic() - started
            del loss
        if cuda:
            return before, torch.cuda.max_memory_allocated(), seconds, torch.cuda.max_memory_reserved()
        static = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        static += sum(
            v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        )
        static += sum(t.numel() * t.element_size() for t in batch.values())  # gradients: in the tracker's peak
        return static, static + tracker.peak_bytes, seconds, None
    finally:
        del model, optimizer, batch
        if cuda:
            torch.cuda.empty_cache()


class PowerSampler:
    """NVML power (W) and GPU utilisation (%) of device 0 sampled every 50 ms while a step runs; empty without NVML."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML (CPU dry run, or pynvml missing): no figures, not a failure
            self._nvml = None

    def __enter__(self):
        import threading

        if self._nvml is None:
            return self
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(0.05):
                watts = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
                self.samples.append((watts, float(util)))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._stop is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"power_w": None, "utilization_pct": None}
        n = len(self.samples)
        return {
            "power_w": round(sum(w for w, _ in self.samples) / n, 1),
            "utilization_pct": round(sum(u for _, u in self.samples) / n, 1),
        }


def matmul_peak(device: torch.device, dtype: torch.dtype, shapes) -> float:
    """Best FLOP/s of torch.mm at the step's own shapes in the step's dtype: the practical peak of this run."""
    sys.path.insert(0, str(ROOT / "bench"))
    from trainer import matmul_rate

    return matmul_rate(shapes, dtype=dtype, device=device.type)


def section_sweep(device: torch.device, dry_run: bool, budget_s: float, lengths: list[int]) -> dict:
    if dry_run:
        shape = P.DrafterConfig(128, 4, 32, 320, 1024, 2048)
        base = recipe(dry_run, shape, loss_chunk_size=256)
        lengths = [256, 512]
    else:
        shape = P.SHAPES["kimi-k2.5"]
        base = recipe(dry_run, shape)
    ttt = base.run.ttt_steps
    deadline = time.monotonic() + budget_s
    rows = []
    from eagle3.flops import datasheet_peak

    sys.path.insert(0, str(ROOT / "bench"))
    from trainer import step_matmul_shapes

    dtype = torch.bfloat16 if base.run.autocast and device.type == "cuda" else torch.float32
    practical = matmul_peak(device, dtype, step_matmul_shapes(shape, max(lengths[0], 1024)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    sheet = datasheet_peak(name, "bf16" if dtype == torch.bfloat16 else "fp32")
    for label, opts in (
        ("activation_checkpointing", base.with_run(activation_checkpointing="full")),
        ("no options", base),
    ):
        for seq_len in lengths:
            if time.monotonic() > deadline:
                rows.append({"options": label, "max_seq_len": seq_len, "skipped": "time budget spent"})
                continue
            predicted = P.predict_peak_bytes(opts, seq_len)
            row = {"options": label, "max_seq_len": seq_len, "predicted_gib": round(predicted / P.GIB, 2)}
            started = time.monotonic()
            power = PowerSampler()
            try:
                with power:
                    static, peak, seconds, reserved = run_steps(opts, seq_len, device)
            except torch.OutOfMemoryError as e:
                row |= {"oom": True, "message": str(e).splitlines()[0][:300]}
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"  {label:26} {seq_len:>6}: OOM (predicted {row['predicted_gib']} GiB)", flush=True)
                break
            row |= {
                "measured_peak_gib": round(peak / P.GIB, 2),
                "measured_static_gib": round(static / P.GIB, 2),
                "reserved_gib": round(reserved / P.GIB, 2) if reserved else None,
                "error": round(predicted / peak - 1, 3),
                "step_s": round(seconds, 3),
                "tokens_per_s": round(seq_len / seconds, 1),
                "wall_s": round(time.monotonic() - started, 1),
            }
            row |= sweep_rate(shape, seq_len, ttt, opts, seconds, practical, sheet) | power.summary()
            rows.append(row)
            print_sweep_row(label, seq_len, seconds, row)
    measured = [r for r in rows if "error" in r]
    return {
        "shape": shape.to_dict(),
        "ttt_steps": ttt,
        "matmul_peak_tflop_per_s": round(practical / 1e12, 3),
        "datasheet_peak_tflop_per_s": sheet and round(sheet / 1e12, 1),
        "rows": rows,
        "max_abs_error": max((abs(r["error"]) for r in measured), default=None),
        "ok": bool(measured),
    }


def sweep_rate(shape, seq_len: int, ttt: int, opts, seconds: float, practical: float, sheet) -> dict:
    """A sweep row's work and rate: TFLOP per step, TFLOP/s, share of the matmul and datasheet peaks."""
    from eagle3.flops import step_flops

    flops = step_flops(
        shape,
        seq_len,
        ttt,
        loss_chunk_size=opts.run.loss_chunk_size,
        activation_checkpointing=opts.run.activation_checkpointing,
    )  # one document filling the row: the attention's worst case, as the sweep's batch
    rate = flops["total"] / seconds
    return {
        "tflop": round(flops["total"] / 1e12, 2),
        "recompute_tflop": round(flops["recompute"] / 1e12, 2),
        "tflop_per_s": round(rate / 1e12, 2),
        "of_matmul_peak": round(rate / practical, 3),
        "mfu": round(rate / sheet, 3) if sheet else None,
    }


def print_sweep_row(label: str, seq_len: int, seconds: float, row: dict) -> None:
    print(
        f"  {label:26} {seq_len:>6}: step {seconds:7.2f} s, {row['tokens_per_s']:9.1f} tok/s, "
        f"{row['tflop_per_s']:7.2f} TFLOP/s ({row['of_matmul_peak']:.0%} of matmul peak, MFU "
        f"{'-' if row['mfu'] is None else format(row['mfu'], '.1%')}), peak {row['measured_peak_gib']:7.2f} "
        f"GiB vs plan {row['predicted_gib']:7.2f} ({row['error']:+.1%}), power {row['power_w']} W at "
        f"{row['utilization_pct']} % utilisation",
        flush=True,
    )


# ----------------------------------------------------------------------------------------------- probe


def section_probe(device: torch.device, dry_run: bool, sweep: dict | None) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="eagle3-plan-cache-"))
    if dry_run:
        spec = recipe(dry_run, P.DrafterConfig(128, 4, 32, 320, 1024, 2048), activation_checkpointing=True)

        def measure(seq_len):
            static, peak, _, _ = run_steps(spec, seq_len, device)
            return static, peak

        kwargs = {"measure": measure, "gpu_name": "cpu-dry-run", "torch_version": torch.__version__}
        lengths, memory = (256, 512), 1.0
    else:
        spec = recipe(dry_run, P.SHAPES["kimi-k2.5"], 8, reserve_gib=1.0, activation_checkpointing=True)
        kwargs, lengths, memory = {}, (4096, 8192), 96.0
    first = P.probe(spec, memory_gb=memory, margin=0.1, lengths=lengths, cache_dir=cache, **kwargs)
    again = P.probe(spec, memory_gb=memory, margin=0.1, lengths=lengths, cache_dir=cache, **kwargs)
    analytic = P.make_plan(spec, memory_gb=memory, margin=0.1)
    return {
        "probe": first,
        "second_call_from_cache": again["from_cache"],
        "analytic_choice": analytic.max_seq_len,
        "probe_choice": first["max_seq_len"],
        "ok": again["from_cache"] and first["max_seq_len"] is not None,
    }


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GPU-only checks of eagle3-pve; figures to one JSON file")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny drafter: exercises the same code path")
    p.add_argument("--sections", default="cleanup,flex,sweep,probe,context")
    p.add_argument("--lengths", default="4096,8192,16384,24576,32768")
    p.add_argument("--sweep-budget-s", type=float, default=240.0, help="stop starting new lengths after this")
    p.add_argument("--output", default=None, help="JSON file (default $OUT/gpu_check.json or bench/results/)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run with --dry-run for the CPU path", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.output:
        path = Path(args.output)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_check.json"
    else:
        path = ROOT / "bench" / "results" / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = Report(path, args.dry_run)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    # cleanup first: its NVML baseline must not include this process's own CUDA context
    report.data["environment"] = environment(torch.device("cpu") if "cleanup" in sections else device)
    failed = []
    sweep = None
    for name in sections:
        started = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            if name == "cleanup":
                result = section_cleanup(args.dry_run)
            elif name == "flex":
                result = section_flex(device, args.dry_run)
            elif name == "sweep":
                lengths = [int(v) for v in args.lengths.split(",")]
                result = sweep = section_sweep(device, args.dry_run, args.sweep_budget_s, lengths)
            elif name == "probe":
                result = section_probe(device, args.dry_run, sweep)
            elif name == "context":
                from gpu_context import section_context  # the largest length at cp 1 and cp = GPUs, measured

                result = section_context(args.dry_run)
            else:
                raise ValueError(f"unknown section {name!r}; choose from cleanup, flex, sweep, probe, context")
        except Exception as e:  # a failed section is a figure too; the next one still runs
            result = {
                "ok": False,
                "exception": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        result["section_s"] = round(time.monotonic() - started, 1)
        if result.get("ok") is False:
            failed.append(name)
        report.section(name, result)
        summary = {k: v for k, v in result.items() if k in ("ok", "skipped", "exception", "section_s", "max_abs_error")}
        print(f"   {summary}", flush=True)
    if device.type == "cuda":
        report.data["environment"] = environment(device)
    report.data["failed_sections"] = failed
    report.data["finished"] = time.time()
    report.save()
    print(f"figures: {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
