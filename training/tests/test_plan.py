"""The memory planner: predictions against bytes the real training step allocates on CPU, the Kimi-shaped
prediction for the story's 8 GPUs, the choice of a length, bad input, the CLI the Ansible role parses, and the probe's fit
and cache (with injected measurements: the real probe needs CUDA)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eagle3 import plan as P
from eagle3.memtrack import measure_planned_step
from eagle3.model import Eagle3Drafter
from pipeline_support import trainer_env

TOLERANCE = 0.15

# Three small shapes with distinct H, heads, head_dim, MLP and vocab so a wrong coefficient on any one shows.
SHAPES = {
    "h64": P.DrafterConfig(64, 4, 16, 192, 512, 1024),
    "h128": P.DrafterConfig(128, 4, 32, 320, 1024, 2048),
    "h96": P.DrafterConfig(96, 6, 16, 256, 768, 1536),
    # grouped-query attention: 8 query heads over 2 key/value heads (K/V activations and k/v_proj 4x smaller)
    "h128-gqa": P.DrafterConfig(128, 8, 16, 320, 1024, 2048, num_kv_heads=2),
    # EAGLE 3.1 norms: one RMSNorm per aux state before fc, later steps read the post-norm hidden state
    "h96-eagle31": P.DrafterConfig(96, 6, 16, 256, 768, 1536, fc_norm=True, norm_output=True),
    # the Kimi drafter scaled by 1/8: weight-sized gradients and copies weigh as much as activations here
    "kimi-eighth": P.SHAPES["kimi-k2.5-eighth"],
    # multi-head latent attention (DeepSeek-V3's): low-rank queries, one latent per token for every head
    "h96-mla": P.DrafterConfig(
        96,
        6,
        16,
        256,
        768,
        1536,
        q_lora_rank=48,
        kv_lora_rank=64,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
    ),
    "h64-mla-direct-q": P.DrafterConfig(
        64, 4, 16, 192, 512, 1024, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
    ),
}


def cpu_spec(shape, dtype: str = "fp32", ckpt=False, ttt_steps: int = 3) -> P.RunSpec:
    """The trainer's CPU recipe (exact attention, loss chunks of 256), nothing reserved. bf16: the CUDA recipe
    (bf16 autocast, frozen weights in bf16) run on CPU: the same casts and saved tensors."""
    spec = P.spec_for(
        shape,
        device="cpu",
        dtype=dtype,
        attention="exact",
        loss_chunk_size=256,
        activation_checkpointing=ckpt,
        ttt_steps=ttt_steps,
    )
    spec = dataclasses.replace(spec, reserve_gib=0.0, allocator_factor=1.0)
    return spec.with_run(frozen_bf16=True) if dtype == "bf16" else spec


def cuda(shape, world_size: int = 1, **keys) -> P.RunSpec:
    """The trainer's CUDA recipe (bf16 autocast, flex attention) under config keys."""
    return P.on_cuda(shape, world_size=world_size, **keys)


SMALL = ("h64", "h128", "h96")
CASES = [(name, s, "fp32", False) for name in SMALL for s in (384, 768)]
CASES += [(name, s, "bf16", True) for name in SMALL for s in (384, 768)]
CASES += [
    (name, 768, dtype, ckpt)
    for name in ("h128-gqa", "h96-eagle31")
    for dtype in ("fp32", "bf16")
    for ckpt in (False, True)
]
# kimi-eighth with full checkpointing runs in fp32: a CPU without AVX-512 BF16 multiplies bf16 ~40x slower than
# fp32 (minutes per case); its bf16 accounting is covered by the selective case below and the smaller bf16 cases.
CASES += [("h96", 768, "fp32", True), ("h128", 768, "bf16", False), ("kimi-eighth", 512, "fp32", True)]
# selective activation checkpointing: the step's matmul outputs held, the rest recomputed
CASES += [("h96", 768, "fp32", "selective"), ("h128-gqa", 768, "bf16", "selective")]
CASES += [("kimi-eighth", 512, "bf16", "selective")]
# MLA: each checkpoint mode and both dtypes, over the two query paths (bf16 on CPU is slow: fewer of those)
CASES += [
    ("h96-mla", 768, "fp32", False),
    ("h96-mla", 768, "fp32", True),
    ("h96-mla", 768, "bf16", "selective"),
]
CASES += [("h64-mla-direct-q", 768, "bf16", False), ("h64-mla-direct-q", 768, "fp32", "selective")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "seq_len", "dtype", "ckpt"), CASES)
def test_prediction_is_within_15_percent_of_measured_bytes(name, seq_len, dtype, ckpt):
    spec = cpu_spec(SHAPES[name], dtype, ckpt)
    measured = measure_planned_step(spec, seq_len)
    held = P.activation_bytes(spec, seq_len)
    peak = P.dynamic_bytes(spec, seq_len)
    assert abs(held / measured.forward - 1) <= TOLERANCE, (
        f"held at forward end: predicted {held} vs measured {measured.forward} bytes"
    )
    assert abs(peak / measured.peak - 1) <= TOLERANCE, f"peak: predicted {peak} vs measured {measured.peak} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("lk", [0.0, 1.0])
def test_the_acceptance_aware_loss_is_planned_within_15_percent(lk):
    """lk_weight > 0 adds a one-byte [chunk, V] mask to the loss's peak (eagle3.loss.FusedKL): the plan counts it.
    A large draft vocab makes the loss phase the step's peak, and the mask about 5 % of it: within 3 % both ways."""
    shape = dataclasses.replace(SHAPES["h64"], draft_vocab_size=16384, target_vocab_size=16384)
    spec = cpu_spec(shape).with_run(lk_weight=lk)
    measured = measure_planned_step(spec, 384)
    peak = P.dynamic_bytes(spec, 384)
    assert abs(peak / measured.peak - 1) <= 0.03, f"lk {lk}: predicted {peak} vs measured {measured.peak}"


def test_parameter_counts_match_the_real_model():
    for shape in [*SHAPES.values(), P.SHAPES["kimi-k2.5"]]:
        with torch.device("meta"):
            model = Eagle3Drafter(shape)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        assert shape.trainable_params() == trainable
        # the target head rows outside the draft vocab are a buffer filled by load_target_weights
        rest = (shape.target_vocab_size - shape.draft_vocab_size) * shape.hidden_size
        assert shape.frozen_params(keep_full_head=True) == frozen + rest


def test_kimi_shape_at_32768_fits_96_gb_on_8_gpus_only_with_the_options():
    kimi = P.SHAPES["kimi-k2.5"]
    on = cuda(kimi, 8, activation_checkpointing=True, fsdp=True)
    off = cuda(kimi, 8)
    assert P.predict_peak_bytes(on, 32768) / P.GIB <= 90
    # the story: without the options 32768 does not fit 96 GB
    assert P.predict_peak_bytes(off, 32768) / P.GIB > 96
    # checkpointing alone (DDP) already fits; FSDP takes the static state down further
    ckpt = cuda(kimi, 8, activation_checkpointing=True)
    assert P.predict_peak_bytes(ckpt, 32768) < 90 * P.GIB
    assert P.static_bytes(on) < P.static_bytes(ckpt) - 6 * P.GIB


def test_largest_fitting_length_fits_and_the_next_one_does_not():
    kimi = P.SHAPES["kimi-k2.5"]
    spec = cuda(kimi, 8, activation_checkpointing=True)
    plan = P.make_plan(spec, memory_gb=96, margin=0.1)
    budget = P.budget_bytes(96, 0.1)
    chosen = plan.max_seq_len
    assert chosen % 128 == 0
    assert P.predict_peak_bytes(spec, chosen) <= budget
    assert P.predict_peak_bytes(spec, chosen + 128) > budget
    assert [row["fits"] for row in plan.table] == [row["predicted_gb"] * P.GIB <= budget for row in plan.table]


def test_predictions_grow_with_length_steps_and_shrink_with_options():
    kimi = P.SHAPES["kimi-k2.5"]
    base = cuda(kimi, 8)
    lengths = [128 * n for n in (1, 8, 64, 128, 256)]
    peaks = [P.predict_peak_bytes(base, s) for s in lengths]
    assert peaks == sorted(peaks)
    assert P.predict_peak_bytes(base.with_run(ttt_steps=3), 16384) < P.predict_peak_bytes(
        base.with_run(ttt_steps=7), 16384
    )
    assert P.predict_peak_bytes(base.with_run(activation_checkpointing="full"), 16384) < (
        P.predict_peak_bytes(base, 16384)
    )


def test_budget_below_the_static_footprint_names_the_static_figure():
    with pytest.raises(P.ConfigError, match=r"below the static footprint (\d+\.\d) GiB") as err:
        P.make_plan(cuda(P.SHAPES["kimi-k2.5"], 8), memory_gb=16, margin=0.1)
    static = float(err.value.args[0].split("static footprint ")[1].split(" GiB")[0])
    expected = (P.static_bytes(cuda(P.SHAPES["kimi-k2.5"], 8)) + P.GIB) / P.GIB
    assert static == pytest.approx(expected, abs=0.05)


def test_nothing_fits_says_so_with_the_smallest_length():
    kimi = P.SHAPES["kimi-k2.5"]
    static = (P.static_bytes(cuda(kimi, 8)) + P.GIB) / P.GIB
    with pytest.raises(P.ConfigError, match="no max_seq_len fits: even 128 tokens need"):
        # a budget just above the static bytes: the 3.6 GB autocast weight copies alone do not fit
        P.make_plan(cuda(kimi, 8), memory_gb=static + 0.5, margin=0.0)


def test_the_planner_refuses_and_accepts_what_the_trainer_does():
    """The planner sizes the spec the trainer resolves: flex attention on a CPU is refused with the trainer's own
    message, and fsdp on one rank plans an unsharded run (the trainer's note), as the trainer runs it."""
    with pytest.raises(P.ConfigError, match=r"attention='flex' needs CUDA"):
        P.spec_for(P.SHAPES["tiny"], device="cpu", attention="flex")
    one_rank = P.make_plan(cuda(P.SHAPES["tiny"], 1, fsdp=True), memory_gb=96, margin=0.1)
    assert one_rank.shard_layout == "unsharded" and one_rank.shard_ranks == 1
    assert "fsdp: true with a single process shards nothing" in one_rank.spec.run.notes[0]
    assert P.static_bytes(one_rank.spec) == P.static_bytes(cuda(P.SHAPES["tiny"], 1))


def test_cli_json_is_what_the_ansible_role_parses(capsys):
    args = "--shape kimi-k2.5 --world-size 8 --memory-gb 96 --activation-checkpointing --fsdp --json"
    rc = P.main([*args.split(), "--lengths", "16384,24576,32768"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"max_seq_len", "predicted_gb", "memory_gb", "static_gb", "table", "options"} <= set(out)
    assert [row["max_seq_len"] for row in out["table"]] == [16384, 24576, 32768]
    assert all(row["fits"] for row in out["table"])
    assert out["max_seq_len"] >= 32768 and out["predicted_gb"] <= 96 * 0.9
    assert out["options"]["activation_checkpointing"] and out["options"]["fsdp"]


def kimi(shape: str = "kimi-k2.5") -> list[str]:
    """The planner's command line for a Kimi-K2.5-shaped drafter on 8 GPUs of 96 GiB, checkpointing and FSDP2."""
    return [
        "--shape",
        shape,
        "--world-size",
        "8",
        "--memory-gb",
        "96",
        "--activation-checkpointing",
        "--fsdp",
        "--json",
    ]


KIMI = kimi()


def test_the_planner_decides_the_runs_length_and_context_parallel(capsys):
    """The decision the Ansible role takes as it is ("run"): auto takes the largest length that fits, an explicit
    length runs when it fits and is refused naming the largest that does and a context_parallel at which it would,
    and context_parallel auto picks the smallest size that fits the length."""
    assert P.main(KIMI) == 0
    plan = json.loads(capsys.readouterr().out)
    run = plan["run"]
    assert (run["max_seq_len"], run["context_parallel"], run["data_parallel"]) == (plan["max_seq_len"], 1, 8)
    assert run["refusal"] == "" and run["summary"].startswith(f"max_seq_len=auto -> {plan['max_seq_len']}: ")
    assert P.main([*KIMI, "--max-seq-len", "16384"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert run["max_seq_len"] == 16384 and run["summary"].startswith("max_seq_len=16384 fits (the largest that fits")
    assert P.main([*KIMI, "--max-seq-len", "131072", "--context-parallel", "1"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert run["refusal_kind"] == "too_long" and run["largest"] == plan["max_seq_len"]
    assert run["refusal"].startswith("max_seq_len=131072 does not fit: the memory planner predicts")
    assert P.main([*KIMI, "--max-seq-len", "131072", "--context-parallel", "auto"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert (run["max_seq_len"], run["context_parallel"], run["data_parallel"], run["refusal"]) == (131072, 2, 4, "")
    assert "context_parallel=auto -> 2 (data_parallel 4)" in run["summary"]


def test_an_unplanned_length_is_decided_by_the_rules_alone(capsys):
    """--unplanned: no memory figure is needed, the length runs as given, and the rules (a size the workers and the
    drafter's heads split into) still refuse."""
    base = ["--shape", "tiny", "--world-size", "2", "--json", "--unplanned", "no GPU here"]
    assert P.main([*base, "--max-seq-len", "262144", "--context-parallel", "2"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert (run["max_seq_len"], run["context_parallel"], run["checked"]) == (262144, 2, False)
    assert run["summary"].startswith("max_seq_len=262144 is not checked against memory: no GPU here")
    assert P.main(base) == 0
    assert json.loads(capsys.readouterr().out)["run"]["refusal_kind"] == "needs_memory"
    assert P.main([*base, "--max-seq-len", "16384", "--context-parallel", "3"]) == 2
    assert "context_parallel=3 does not divide" in capsys.readouterr().err


def test_cli_exits_2_with_a_message_when_nothing_fits(capsys):
    rc = P.main(["--shape", "kimi-k2.5", "--world-size", "8", "--memory-gb", "12"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "below the static footprint" in err and "GiB" in err


def test_cli_reads_the_trainer_config_and_its_dataset(tmp_path, capsys):
    from eagle3.synth import SynthConfig, synthesize

    data = tmp_path / "data"
    synthesize(data, SynthConfig(num_samples=4, hidden_size=64, min_len=16, max_len=32), log=lambda *a, **k: None)
    config = tmp_path / "train.yaml"
    config.write_text(
        f"data_dir: {data}\nrun_dir: {tmp_path / 'run'}\nmax_seq_len: auto\nttt_steps: 3\n"
        "device: cpu\nmemory_limit_gb: 2\nactivation_checkpointing: true\n"
    )
    assert P.main(["--config", str(config), "--json", "--lengths", "1024,2048"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["hidden_size"] == 64 and out["ttt_steps"] == 3
    assert out["options"]["attention"] == "exact" and out["options"]["autocast"] is False
    assert out["options"]["activation_checkpointing"] == "full"
    assert out["max_seq_len"] % 128 == 0 and out["predicted_gb"] <= 1.8


def test_cli_config_with_an_unknown_key_exits_2(tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text("data_dir: /x\nrun_dir: /y\nmax_seq_lenn: 4096\n")
    assert P.main(["--config", str(config), "--memory-gb", "96"]) == 2
    assert "max_seq_lenn" in capsys.readouterr().err


def fake_gpu(a: int, b: int):
    """A GPU whose peak is static + a + b * S; counts its calls."""
    calls = []

    def measure(seq_len):
        calls.append(seq_len)
        return 10 * P.GIB, 10 * P.GIB + a + b * seq_len

    return measure, calls


def test_probe_fits_a_line_chooses_and_caches(tmp_path):
    kimi = P.SHAPES["kimi-k2.5"]
    spec = cuda(kimi, 8, activation_checkpointing=True)
    measure, calls = fake_gpu(a=2 * P.GIB, b=1_000_000)
    kwargs = dict(
        memory_gb=96,
        margin=0.1,
        lengths=(4096, 8192),
        gpu_name="Fake GPU 96GB",
        torch_version="2.13.0",
        cache_dir=tmp_path,
    )
    first = P.probe(spec, measure=measure, **kwargs)
    assert calls == [4096, 8192]
    assert first["fit_bytes"]["a"] == pytest.approx(2 * P.GIB) and first["fit_bytes"]["b_per_token"] == pytest.approx(
        1e6
    )
    budget = P.budget_bytes(96, 0.1)
    fixed = P.static_bytes(spec) + P.GIB + 2 * P.GIB

    def predicted(s):
        return fixed + P.batch_bytes(spec, s) + 1_000_000 * s

    chosen = first["max_seq_len"]
    assert predicted(chosen) <= budget < predicted(chosen + 128)
    second = P.probe(spec, measure=measure, **kwargs)
    assert calls == [4096, 8192], "the second probe must come from the cache"
    assert second["from_cache"] and second["max_seq_len"] == chosen
    other = P.probe(spec, measure=measure, **{**kwargs, "gpu_name": "Other GPU"})
    assert not other["from_cache"] and calls == [4096, 8192, 4096, 8192]


def test_probe_without_cuda_is_skipped_cleanly(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; bench/gpu_check.sh runs the real probe")
    with pytest.raises(P.ProbeUnavailable, match="no CUDA device"):
        P.probe(cuda(P.SHAPES["tiny"]), memory_gb=8, margin=0.1, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir()), "nothing cached when nothing was measured"


GPU_CHECK = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


def test_gpu_check_script_parses_and_fails_fast_without_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], check=False).returncode == 0
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver: the real check is for the GPU session")
    run = subprocess.run([str(GPU_CHECK)], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 2
    assert "no NVIDIA driver" in run.stderr and "--dry-run" in run.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_exercises_the_same_python_path_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    args = [str(GPU_CHECK), "--dry-run", "--sections", "cleanup,flex,probe,context", "--output", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    sections = figures["sections"]
    assert "skipped" in sections["cleanup"]
    assert sections["flex"]["ok"] and sections["flex"]["max_abs_diff_out"] < 1e-4
    probe = sections["probe"]
    assert probe["second_call_from_cache"] and probe["probe_choice"] % 128 == 0
    assert all(abs(e) <= TOLERANCE for e in probe["probe"]["analytic_error"])
    context = sections["context"]  # cp 1 and cp 2 (two CPU ranks): the path the GPU run takes with NCCL
    assert context["ok"] and [r["context_parallel"] for r in context["rows"]] == [1, 2]
    assert all(r["largest_planned"] % 128 == 0 and r["tokens_per_s"] > 0 for r in context["rows"])


@pytest.mark.slow
def test_auto_on_cpu_chooses_a_length_that_trains_under_the_memory_limit(tmp_path, capsys):
    """The local CT flow: max_seq_len=auto, memory_limit_gb decides; the trainer then runs under RLIMIT_AS."""
    from eagle3.synth import SynthConfig, synthesize

    data = tmp_path / "data"
    synthesize(data, SynthConfig(num_samples=200, hidden_size=64, min_len=64, max_len=512), log=lambda *a, **k: None)
    config = tmp_path / "train.yaml"
    common = (
        f"data_dir: {data}\nrun_dir: {tmp_path / 'run'}\ndevice: cpu\nmemory_limit_gb: 1.5\nmax_steps: 2\n"
        "val_fraction: 0.0\nval_every: 0\nwarmup_steps: 1\nlog_every: 1\n"
    )
    config.write_text(common + "max_seq_len: auto\n")
    assert P.main(["--config", str(config), "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["max_seq_len"]
    assert chosen >= 1024
    config.write_text(common + f"max_seq_len: {chosen}\n")
    run = subprocess.run(
        [sys.executable, "-m", "eagle3", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[1],
        env=trainer_env(),  # MALLOC_ARENA_MAX=2: the address space left does not depend on load
        check=False,
    )
    assert run.returncode == 0, f"max_seq_len={chosen}: {run.stdout[-2000:]}{run.stderr[-2000:]}"


def test_cli_probe_without_cuda_falls_back_to_the_analytic_plan(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = ["--shape", "kimi-k2.5", "--world-size", "8", "--memory-gb", "96", "--activation-checkpointing"]
    assert P.main([*args, "--probe", "--cache-dir", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "probe skipped: no CUDA device" in captured.err
    assert out["source"] == "analytic" and out["probe"] is None and out["max_seq_len"] >= 32768


def test_grouped_query_attention_shrinks_kv_activations_and_weights_by_heads_over_kv_heads():
    gqa = SHAPES["h128-gqa"]
    mha = dataclasses.replace(gqa, num_kv_heads=None)
    assert gqa.kv_dim * 4 == mha.kv_dim == gqa.attention_dim
    saved = P.gqa_savings(cpu_spec(gqa, "bf16"))
    # exact attention keeps k and v of each of the 3 steps: 2 * 3 * (128 - 32) * 2 bytes per token
    assert saved["activation_bytes_per_token"] == 2 * 3 * (128 - 32) * 2
    assert saved["weights"] == 2 * (2 * 128) * (128 - 32)  # k_proj and v_proj, 2H -> kv_dim
    assert P.gqa_savings(cpu_spec(mha, "bf16")) == {"activation_bytes_per_token": 0, "weights": 0}
    for s in (384, 768):
        diff = P.activation_bytes(cpu_spec(mha, "bf16"), s) - P.activation_bytes(cpu_spec(gqa, "bf16"), s)
        assert diff == s * saved["activation_bytes_per_token"] + 2 * saved["weights"]  # + autocast weight copies


def test_memory_options_choice_takes_the_fastest_that_fits():
    """No checkpointing while it fits, then selective, then full; the loss chunking each needs."""
    kimi = P.SHAPES["kimi-k2.5"]
    spec = cuda(kimi, 8, fsdp=True)
    budget = P.budget_bytes(141, 0.1)
    choices = [P.memory_options_choice(spec, s, budget) for s in (8192, 65536, 131072, 10**6)]
    assert [c and c[0] for c in choices] == ["none", "selective", "full", None]
    for s, choice in zip((8192, 65536, 131072), choices, strict=False):
        mode, chunk = choice
        fits = spec.with_run(activation_checkpointing=mode, loss_chunk_size=chunk)
        assert P.predict_peak_bytes(fits, s) <= budget
    lean = spec.with_run(activation_checkpointing="selective")
    assert P.activation_bytes(lean, 32768) > P.activation_bytes(spec.with_run(activation_checkpointing="full"), 32768)


def test_the_plan_table_says_why_it_advises_a_loss_chunk():
    """On CPU at a long row the chunk is advised for speed (cpu_heap_chunk), on CUDA only when memory needs it."""
    from eagle3.plan.cli import format_table

    tiny = P.DrafterConfig(64, 4, 16, 192, 512, 1024)
    cpu = dataclasses.replace(P.spec_for(tiny, device="cpu"), reserve_gib=1.0)
    plan = P.make_plan(cpu, memory_gb=64, margin=0.1, lengths=(16384,))
    assert plan.max_seq_len >= 16384 and plan.loss_chunk_size == 4096
    assert "loss_chunk_size=4096 fits at that length (on CPU faster than one pass" in format_table(plan)
    on_gpu = P.make_plan(cuda(tiny), memory_gb=64, margin=0.1, lengths=(16384,))
    assert "loss_chunk_size=0 fits at that length (one pass, the fastest)" in format_table(on_gpu)
    kimi = P.SHAPES["kimi-k2.5"]
    tight = P.make_plan(
        cuda(kimi, 8, activation_checkpointing=True, fsdp=True), memory_gb=141, margin=0.1, lengths=(145280,)
    )
    assert "loss_chunk_size=4096 fits at that length (memory needs the chunked loss)" in format_table(tight)


def test_the_mla_drafter_is_planned_and_keeps_one_latent_per_token_and_step(capsys):
    """MLA's TTT steps keep one latent (kv_lora_rank + qk_rope_head_dim) per token for every head instead of K and
    V per key/value head: under checkpointing, what the steps keep per token falls (bench/memory.py part (c))."""
    args = kimi("kimi-k2.5-mla")
    assert P.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["kv_lora_rank"] == 512 and out["max_seq_len"] >= 65536

    def per_step(name):
        spec = cuda(P.SHAPES[name], 8, activation_checkpointing=True, fsdp=True)
        fewer = spec.with_run(ttt_steps=4)
        return (P.activation_bytes(spec, 2) - P.activation_bytes(spec, 1)) - (
            P.activation_bytes(fewer, 2) - P.activation_bytes(fewer, 1)
        )

    llama, mla = per_step("kimi-k2.5"), per_step("kimi-k2.5-mla")
    assert llama - mla == 2 * (2 * 64 * 64 - (512 + 64))  # bf16 K and V of 64 heads x 64 against one latent
