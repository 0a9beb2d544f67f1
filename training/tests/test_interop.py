"""Interop with speculators 0.9.0 itself (installed, pinned, in the training venv): a drafter folder written by its
`save_pretrained` loads here as it is, with the verifier's rope (YaRN, llama3) and norm epsilon, and gives the
logits speculators' own forward gives; `init_from` starts a run from it with the same logits."""

import json

import pytest
import torch
from eagle3.export import export_speculators, init_from_export, load_exported
from eagle3.model import Eagle3Drafter, ttt_logits
from eagle3.spec import DrafterConfig, verifier_settings
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN, TARGET_VOCAB, DRAFT_VOCAB, TTT = 64, 256, 64, 3
# Verifier settings a Llama-3 or a long-context target has: neither the trainer's old fixed 10000 / 1e-6.
OPTIONS = {
    "yarn-norm-before-residual": (
        {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 16},
        {"norm_before_residual": True},
    ),
    "llama3-eagle31-norms": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"norm_before_residual": False, "fc_norm": True, "norm_output": True},
    ),
}


def speculators_drafter(rope_parameters, options, seed=0):
    layer = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=TARGET_VOCAB,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        num_hidden_layers=1,
        max_position_embeddings=64,
    )
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
        **options,
    )
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():  # random weights everywhere, norms included (not all ones)
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * (0.2 if "norm" not in name else 1.0))
        draft = torch.sort(torch.randperm(TARGET_VOCAB, generator=gen)[:DRAFT_VOCAB]).values
        model.t2d.zero_()
        model.t2d[draft] = True
        model.d2t.copy_(draft - torch.arange(DRAFT_VOCAB))  # speculators' d2t: offset from draft to target id
    return model.eval()


def their_logits(model, row):
    """speculators' per-step draft logits for one row (a hook on lm_head), inputs aligned as its data pipeline
    aligns them: token t+1 beside the hidden state of t, positions counted from 1."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out[0].detach()))
    try:
        with torch.no_grad():
            model(
                hidden_states=row["aux_hidden"][None],
                input_ids=torch.cat([row["input_ids"][1:], row["input_ids"].new_zeros(1)])[None],
                document_ids=torch.zeros_like(row["input_ids"])[None],
                position_ids=(row["position_ids"] + 1)[None],
                ttt_steps=TTT,
            )
    finally:
        hook.remove()
    return torch.stack(captured)  # [TTT, S, V_draft]


def one_document(seq_len=40, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, TARGET_VOCAB, (seq_len,), generator=gen),
        "aux_hidden": torch.randn(seq_len, 3 * HIDDEN, generator=gen),
        "last_hidden": torch.randn(seq_len, HIDDEN, generator=gen),
        "loss_mask": torch.ones(seq_len, dtype=torch.bool),
        "document_ids": torch.zeros(seq_len, dtype=torch.long),
        "position_ids": torch.arange(seq_len),  # 40 positions: past the rope's original 16
    }


@pytest.fixture(scope="module", params=list(OPTIONS))
def saved(request, tmp_path_factory):
    rope, options = OPTIONS[request.param]
    model = speculators_drafter(rope, options)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder, rope


def test_a_save_pretrained_folder_loads_as_written_with_the_verifiers_rope_and_eps(saved):
    _, folder, rope = saved
    written = json.loads((folder / "config.json").read_text())
    assert {"auto_map", "tie_word_embeddings"} <= set(written)  # what the reader used to refuse
    cfg = load_exported(folder).cfg
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == rope["rope_theta"]
    assert cfg.rope_scaling["rope_type"] == rope["rope_type"]
    assert cfg.rope_scaling["factor"] == rope["factor"]


@pytest.mark.parametrize("attention", ["exact", "flex"])
def test_its_logits_are_speculators_logits_at_every_ttt_step(saved, attention):
    model, folder, _ = saved
    row = one_document()
    theirs = their_logits(model, row)
    ours = ttt_logits(load_exported(folder), row, TTT, attention=attention)
    valid = row["input_ids"].numel() - TTT  # the last slots read padding, aligned differently by each
    torch.testing.assert_close(ours[:, :valid], theirs[:, :valid], rtol=1e-4, atol=5e-5)


def test_init_from_takes_the_verifiers_values_from_the_dataset_and_reproduces_the_logits(saved):
    """A run whose dataset records the verifier's rope and eps builds the drafter speculators built, and init_from
    then gives speculators' logits before the first step."""
    model, folder, rope = saved
    written = json.loads((folder / "config.json").read_text())
    target_config = {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"},
        "rms_norm_eps": 1e-5,
    }
    from eagle3.config import TrainConfig

    settings = verifier_settings(TrainConfig(), {"target_config": target_config})
    cfg = DrafterConfig.from_shapes(
        HIDDEN,
        DRAFT_VOCAB,
        TARGET_VOCAB,
        (1, 2, 3),
        num_heads=4,
        head_dim=16,
        intermediate_size=128,
        num_kv_heads=2,
        norm_before_residual=written["norm_before_residual"],
        fc_norm=written["fc_norm"],
        norm_output=written["norm_output"],
        **settings,
    )
    run_model = Eagle3Drafter(cfg)
    state = model.state_dict()
    run_model.load_target_weights(  # the dataset's frozen target weights and vocab mapping
        embed=state["embed_tokens.weight"],
        lm_head=torch.randn(TARGET_VOCAB, HIDDEN),
        final_norm=torch.ones(HIDDEN),
        d2t=state["d2t"],
        t2d=state["t2d"],
    )
    init_from_export(run_model, folder)
    row = one_document(seed=2)
    valid = row["input_ids"].numel() - TTT
    torch.testing.assert_close(
        ttt_logits(run_model, row, TTT, attention="exact")[:, :valid],
        their_logits(model, row)[:, :valid],
        rtol=1e-4,
        atol=5e-5,
    )


@pytest.mark.parametrize("case", list(OPTIONS))
def test_speculators_loads_an_export_of_ours_and_gives_our_logits(tmp_path, make_model, tiny_config, case):
    """The other direction: what `eagle3 export` writes, speculators' own from_pretrained reads (the verifier named
    by a local folder holding its config.json, as a served verifier would be), with the same logits."""
    rope, options = OPTIONS[case]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg = tiny_config(rope_theta=rope["rope_theta"], rms_norm_eps=1e-5, rope_scaling=scaling, num_kv_heads=2, **options)
    ours = make_model(cfg)
    verifier = tmp_path / "verifier"
    LlamaForCausalLM(  # speculators reads the verifier's config and its lm_head and final norm
        LlamaConfig(
            hidden_size=cfg.hidden_size,
            intermediate_size=64,
            num_hidden_layers=8,
            num_attention_heads=4,
            vocab_size=cfg.target_vocab_size,
        )
    ).save_pretrained(verifier)
    export_speculators(
        ours,
        tmp_path / "export",
        verifier_name_or_path=str(verifier),
        verifier_architectures=["LlamaForCausalLM"],
        dtype=torch.float32,
    )
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "export")
    config.transformer_layer_config._attn_implementation = "eager"  # chosen at construction
    theirs = Eagle3DraftModel.from_pretrained(tmp_path / "export", config=config).eval()
    assert theirs.config.transformer_layer_config.rope_parameters["rope_type"] == rope["rope_type"]
    row = one_document()
    row["input_ids"] = row["input_ids"] % cfg.target_vocab_size
    row["aux_hidden"] = torch.randn(row["input_ids"].numel(), 3 * cfg.hidden_size)
    valid = row["input_ids"].numel() - TTT
    torch.testing.assert_close(
        ttt_logits(ours, row, TTT, attention="exact")[:, :valid],
        their_logits(theirs, row)[:, :valid],
        rtol=1e-4,
        atol=5e-5,
    )
