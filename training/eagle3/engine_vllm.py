"""`eagle3 evaluate --engine vllm`: the drafter served by vLLM, measured on the held-out prompts of `evaluate`.

The same prompts are decoded twice by vLLM, with the same settings (greedy: temperature 0; the same number of new
tokens; the target's EOS as the stop token; one request at a time, the latency regime speculative decoding is for):

    the target with the drafter     LLM(model=TARGET, speculative_config={"method": "eagle3", "model": EXPORT,
                                        "num_speculative_tokens": K})
    the target alone                LLM(model=TARGET)

Reported beside the fields `eagle3 evaluate` shares with it: the acceptance length from vLLM's own counters
(1 + accepted draft tokens / drafting rounds), the acceptance per draft position (conditional, as evaluate's),
whether both decodings are equal token for token, and tokens/s of both with vLLM's KV cache: the real speed-up
on the machine it ran on. vLLM is imported here and in eagle3/generate_vllm.py only, and those only with `--engine vllm`.

vLLM keeps its metrics in the process-wide Prometheus registry, and an engine started later unregisters the
earlier one's: read an engine's counters while it is the newest (open_pair starts the drafter's last).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.acceptance import tau_of
from eagle3.errors import ConfigError

# vLLM's counters of speculative decoding (`llm.get_metrics()`, and /metrics of `vllm serve`).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# On CPU vLLM would size its KV cache from the machine's memory; a tiny target needs a few MiB of it.
CPU_KV_CACHE_BYTES = 256 << 20


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        pad = earlier.accepted_per_pos + [0] * (len(self.accepted_per_pos) - len(earlier.accepted_per_pos))
        return SpecCounters(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            [a - b for a, b in zip(self.accepted_per_pos, pad, strict=False)],
        )


@dataclass
class Decoded:
    outputs: list[list[int]]  # the new tokens of each prompt (the stop token included when it came)
    seconds: float
    counters: SpecCounters

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def parse_engine_args(text: str) -> dict:
    """--vllm-args: a JSON object of LLM(...) keyword arguments.

    >>> parse_engine_args('{"tensor_parallel_size": 8}')
    {'tensor_parallel_size': 8}
    >>> parse_engine_args("tensor_parallel_size=8")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: --vllm-args 'tensor_parallel_size=8' is not a JSON object of LLM(...) arguments; e.g. '{"tensor_parallel_size": 8, "dtype": "bfloat16"}'
    """
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(
            f"--vllm-args {text!r} is not a JSON object of LLM(...) arguments; "
            """e.g. '{"tensor_parallel_size": 8, "dtype": "bfloat16"}'"""
        )
    return value


def engine_arguments(target_dir, export_dir=None, k: int = 3, extra: dict | None = None) -> dict:
    """LLM(...) keyword arguments: float32 and eager like the project's decoder, token ids in and out, statistics
    on (the counters); `extra` (--vllm-args) adds or overrides any of them.

    >>> args = engine_arguments("/t", "/e", 3, {"dtype": "bfloat16"})
    >>> args["dtype"], args["speculative_config"]
    ('bfloat16', {'method': 'eagle3', 'model': '/e', 'num_speculative_tokens': 3})
    >>> "speculative_config" in engine_arguments("/t")
    False
    """
    args = {
        "model": str(target_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if export_dir is not None:
        args["speculative_config"] = {
            "method": "eagle3",
            "model": str(export_dir),
            "num_speculative_tokens": k,
        }
    args.update(extra or {})
    return args


class VllmEngine:
    """One vLLM engine (its engine-core and worker processes), reaped by PID on close()."""

    def __init__(self, target_dir, export_dir=None, k: int = 3, extra: dict | None = None):
        self._start(engine_arguments(target_dir, export_dir, k, extra), k if export_dir is not None else 0)

    @classmethod
    def from_arguments(cls, args: dict) -> VllmEngine:
        """An engine of any LLM(...) arguments (no drafter's counters: k is 0), reaped like the others."""
        engine = cls.__new__(cls)
        engine._start(dict(args), 0)
        return engine

    def _start(self, args: dict, k: int) -> None:
        import psutil
        from vllm import LLM
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        started = time.perf_counter()
        self.llm = LLM(**args)
        self.start_seconds = time.perf_counter() - started
        self.k = k
        # The engine core and its workers. Not multiprocessing's resource tracker, which the first spawn starts
        # for the whole interpreter: it ignores SIGTERM and ends with this process.
        self._procs = [
            p
            for p in me.children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(_cmdline(p))
        ]

    def counters(self) -> SpecCounters:
        """vLLM's speculative-decoding counters now, summed over their label sets; zeros without a drafter (the
        registry would show another engine's)."""
        from vllm.v1.metrics.reader import Counter, Vector

        c = SpecCounters(accepted_per_pos=[0] * self.k)
        if not self.k:
            return c
        names = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}
        for metric in self.llm.get_metrics():
            if isinstance(metric, Counter) and metric.name in names:
                setattr(c, names[metric.name], getattr(c, names[metric.name]) + int(metric.value))
            elif isinstance(metric, Vector) and metric.name == ACCEPTED_PER_POS:
                c.accepted_per_pos = [a + int(v) for a, v in zip(c.accepted_per_pos, metric.values, strict=False)]
        return c

    def decode(self, prompts: list[list[int]], max_new: int, eos: int | None) -> Decoded:
        """Greedy decoding of each prompt alone, after one short warm-up request (not timed, not counted)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=[] if eos is None else [eos])
        warm = SamplingParams(temperature=0.0, max_tokens=min(4, max_new))
        self.llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], warm, use_tqdm=False)
        before, outputs = self.counters(), []
        started = time.perf_counter()
        for ids in prompts:
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
            outputs.append(list(out[0].outputs[0].token_ids))
        seconds = time.perf_counter() - started
        return Decoded(outputs, seconds, self.counters() - before)

    def close(self, grace: float = 10.0) -> None:
        """vLLM's own shutdown, then any of the engine's processes still there: TERM, wait, KILL (by PID, each
        checked to be the process started with the engine)."""
        import psutil

        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            alive = [p for p in self._procs if p.is_running()]  # is_running: same PID and start time
            for p in alive:
                p.terminate()
            _, left = psutil.wait_procs(alive, timeout=grace)
            for p in left:
                p.kill()
            psutil.wait_procs(left, timeout=grace)
            self._procs = []

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cmdline(proc) -> list[str]:
    import psutil

    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def open_pair(target_dir, export_dir, k: int, extra: dict | None = None) -> tuple[VllmEngine, VllmEngine]:
    """(with the drafter, without), both running: the plain one starts first, so the drafter's counters are the
    registered ones (see the module's docstring). Tests share such a pair; the CLI runs one engine at a time."""
    plain = VllmEngine(target_dir, None, k, extra)
    try:
        return VllmEngine(target_dir, export_dir, k, extra), plain
    except BaseException:
        plain.close()
        raise


def summarize(k: int, spec: Decoded, plain: Decoded, start_seconds: dict) -> dict:
    """The result of one evaluation, in `eagle3 evaluate`'s shape where the two overlap.

    >>> spec = Decoded([[5, 6, 7, 2], [8, 9]], 0.5, SpecCounters(3, 9, 3, [2, 1, 0]))
    >>> r = summarize(3, spec, Decoded([[5, 6, 7, 2], [8, 9]], 1.0, SpecCounters()), {})
    >>> r["acceptance_length"], r["acceptance_per_position"], r["exact"], r["speedup"]
    (2.0, [0.6667, 0.5, 0.0], True, 2.0)
    """
    c = spec.counters
    reached = [c.drafts, *c.accepted_per_pos[:-1]]  # position i is reached when 1..i-1 were accepted
    spec_rate, plain_rate = spec.tokens / max(spec.seconds, 1e-9), plain.tokens / max(plain.seconds, 1e-9)
    return {
        "engine": "vllm",
        "k": k,
        "prompts": len(spec.outputs),
        "tokens": spec.tokens,
        # one prefill per prompt (batch 1), then one target forward per drafting round
        "target_forwards": len(spec.outputs) + c.drafts,
        # evaluate's tau_real (eagle3.acceptance.tau_of): the rounds' tokens per round, each prefill's token left out
        "tau_real": tau_of(spec.tokens, len(spec.outputs), c.drafts),
        "drafting_rounds": c.drafts,
        "accepted_tokens": c.accepted,
        "acceptance_length": round(1 + c.accepted / c.drafts, 4) if c.drafts else None,
        "acceptance_per_position": [
            round(a / r, 4) if r else None for a, r in zip(c.accepted_per_pos, reached, strict=True)
        ],
        "speculative_seconds": round(spec.seconds, 3),
        "greedy_seconds": round(plain.seconds, 3),
        "tokens_per_second": round(spec_rate, 1),
        "greedy_tokens_per_second": round(plain_rate, 1),
        "speedup": round(spec_rate / max(plain_rate, 1e-9), 3),
        "exact": spec.outputs == plain.outputs,
        "engine_start_seconds": {name: round(s, 1) for name, s in start_seconds.items()},
    }


def exported(drafter, run_cfg, drafter_path: Path, target_dir, out_dir: Path) -> Path:
    """The folder vLLM loads: the export given, or the run's checkpoint exported (float32, the weights the
    project's decoder evaluates) into out_dir with the target as its verifier."""
    if run_cfg is None:
        return drafter_path
    import torch

    from eagle3.export import export_speculators

    config = json.loads((Path(target_dir) / "config.json").read_text())
    return export_speculators(
        drafter,
        out_dir,
        speculative_tokens=run_cfg.ttt_steps,
        verifier_name_or_path=str(target_dir),
        verifier_architectures=config.get("architectures") or [],
        dtype=torch.float32,
    )


def measure(
    target_dir,
    drafter,
    run_cfg,
    drafter_path: Path,
    prompt_ids: list[list[int]],
    eos: int | None,
    *,
    k: int,
    max_new: int,
    engine_args: dict | None = None,
    engines: tuple[VllmEngine, VllmEngine] | None = None,
) -> dict:
    """The prompts decoded with the drafter and without, summarized (eagle3.evaluate.evaluate_vllm prepares them).
    `engines` (with, without), started by the caller on this drafter's export and left running, replace the two
    this starts and closes one after the other."""
    if engines is not None:
        spec, plain = engines[0].decode(prompt_ids, max_new, eos), engines[1].decode(prompt_ids, max_new, eos)
        starts = {"speculative": engines[0].start_seconds, "greedy": engines[1].start_seconds}
    else:
        with tempfile.TemporaryDirectory(prefix="eagle3-vllm-export-") as tmp:
            export_dir = exported(drafter, run_cfg, drafter_path, target_dir, Path(tmp))
            with VllmEngine(target_dir, export_dir, k, engine_args) as spec_engine:
                spec = spec_engine.decode(prompt_ids, max_new, eos)
                starts = {"speculative": spec_engine.start_seconds}
            with VllmEngine(target_dir, None, k, engine_args) as plain_engine:
                plain = plain_engine.decode(prompt_ids, max_new, eos)
                starts["greedy"] = plain_engine.start_seconds
    return summarize(k, spec, plain, starts)


def log_line(result: dict) -> str:
    return (
        f"evaluate (vLLM {vllm_version()}): acceptance length {result['acceptance_length']} (K={result['k']}, "
        f"{result['prompts']} prompts, {result['tokens']} tokens, {result['drafting_rounds']} drafting rounds); "
        f"acceptance per position {result['acceptance_per_position']}; {result['tokens_per_second']} tokens/s "
        f"with the drafter, {result['greedy_tokens_per_second']} without: speedup {result['speedup']:.2f}x on "
        f"this machine; outputs equal: {result['exact']}"
    )


def vllm_version() -> str:
    from vllm import __version__

    return __version__
