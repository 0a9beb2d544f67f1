"""Memory planner: predicted peak bytes per GPU for a resolved run (eagle3.spec.RunSpec: the drafter's shape, the run
options, the ranks) at a max_seq_len, and the largest max_seq_len that fits. It is a view of the spec the trainer
runs: it has no options of its own.

    python -m eagle3 plan --shape kimi-k2.5 --world-size 8 --memory-gb 96 --activation-checkpointing
    python -m eagle3 plan --config train.yaml --world-size 8 --memory-gb 96 --json     # what max_seq_len=auto runs

    model.py      the analytic model: every term names the tensors it stands for
    fit.py        for a budget: the largest max_seq_len, the plan, the fastest memory options that fit
    gpu_probe.py  real steps on this GPU at two lengths, a fitted line, a cached choice (CUDA only)
    cli.py        the command line and its JSON object (the Ansible role parses it)

The names below are the planner's public interface (tests, bench/, eagle3.memtrack use them as `plan.X`).
"""

from eagle3.bounds import SEQ_BLOCK
from eagle3.errors import ConfigError
from eagle3.plan.cli import (
    build_parser,
    choose,
    format_table,
    load_trainer_config,
    main,
    parse_lengths,
    spec_from_args,
)
from eagle3.plan.fit import (
    LOSS_CHUNKS,
    Plan,
    budget_bytes,
    context_parallel_choice,
    context_parallel_sizes,
    cpu_heap_chunk,
    largest_fitting,
    loss_chunk_choice,
    make_plan,
    memory_options_choice,
)
from eagle3.plan.gpu_probe import (
    ProbeUnavailable,
    build_probe_step,
    config_hash,
    cuda_measure,
    default_cache_dir,
    fit_line,
    probe,
    probe_cache_path,
)
from eagle3.plan.model import (
    DEFAULT_LENGTHS,
    EXACT_BLOCK,
    GIB,
    MAX_SEARCH_LEN,
    activation_bytes,
    activation_terms,
    all_to_all_bytes,
    batch_bytes,
    block_mask_bytes,
    breakdown,
    checkpointed_step_terms,
    dynamic_bytes,
    exact_block_elements,
    gqa_savings,
    kv_width,
    local_len,
    on_cuda,
    once_held_terms,
    predict_peak_bytes,
    reduce_phase_bytes,
    static_bytes,
    static_terms,
    step_held_terms,
    transient_bytes,
    transient_terms,
)
from eagle3.spec import SHAPES, DrafterConfig, RunSpec, spec_for

__all__ = [
    "DEFAULT_LENGTHS",
    "EXACT_BLOCK",
    "GIB",
    "LOSS_CHUNKS",
    "MAX_SEARCH_LEN",
    "SEQ_BLOCK",
    "SHAPES",
    "ConfigError",
    "DrafterConfig",
    "Plan",
    "ProbeUnavailable",
    "RunSpec",
    "activation_bytes",
    "activation_terms",
    "all_to_all_bytes",
    "batch_bytes",
    "block_mask_bytes",
    "breakdown",
    "budget_bytes",
    "build_parser",
    "build_probe_step",
    "checkpointed_step_terms",
    "choose",
    "config_hash",
    "context_parallel_choice",
    "context_parallel_sizes",
    "cpu_heap_chunk",
    "cuda_measure",
    "default_cache_dir",
    "dynamic_bytes",
    "exact_block_elements",
    "fit_line",
    "format_table",
    "gqa_savings",
    "kv_width",
    "largest_fitting",
    "load_trainer_config",
    "local_len",
    "loss_chunk_choice",
    "main",
    "make_plan",
    "memory_options_choice",
    "on_cuda",
    "once_held_terms",
    "parse_lengths",
    "predict_peak_bytes",
    "probe",
    "probe_cache_path",
    "reduce_phase_bytes",
    "spec_for",
    "spec_from_args",
    "static_bytes",
    "static_terms",
    "step_held_terms",
    "transient_bytes",
    "transient_terms",
]
