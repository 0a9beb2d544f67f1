"""Training-time test: teacher forcing, positions, document gating, statistics, activation checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from eagle3.errors import ConfigError, DataError
from eagle3.model import apply_rope, rope_cos_sin, ttt_forward, ttt_logits


def inference_reference(model, batch, ttt_steps):
    """Draft logits [T, S, V_draft] computed slot by slot, the way a drafter proposes at inference time.

    For slot j: step 0 attends to the step-0 states of its document's slots <= j; step m then
    extends a private chain (teacher-forced token input_ids[j+1+m], position position_ids[j]+1+m,
    the previous step's hidden state) that attends to that prefix plus the chain so far.
    No masks, no shifted tensors: an independent statement of docs/facts.md#training-time-test.
    """
    cfg, layer = model.cfg, model.layers[0]
    ids, pos, doc = batch["input_ids"], batch["position_ids"], batch["document_ids"]
    seq_len = ids.shape[0]
    h0 = model.fc(batch["aux_hidden"])  # [S, H]

    def token(j, m):
        return ids[j + 1 + m] if j + 1 + m < seq_len else torch.tensor(0)

    def project(hidden, tok, position):
        x = torch.cat([layer.input_layernorm(model.embed_tokens(tok)), layer.hidden_norm(hidden)])  # [2H]
        cos, sin = rope_cos_sin(torch.tensor([position]), cfg.head_dim, cfg.rope_theta)

        def heads(t):
            return t.view(cfg.num_heads, 1, cfg.head_dim)

        q = apply_rope(heads(layer.self_attn.q_proj(x)), cos, sin)[:, 0]  # [nh, hd]
        k = apply_rope(heads(layer.self_attn.k_proj(x)), cos, sin)[:, 0]
        return q, k, layer.self_attn.v_proj(x).view(cfg.num_heads, cfg.head_dim)

    def attend_and_finish(hidden, q, keys, values):
        k, v = torch.stack(keys, 1), torch.stack(values, 1)  # [nh, n, hd]
        probs = torch.softmax((k @ q[:, :, None])[..., 0] / math.sqrt(cfg.head_dim), dim=-1)  # [nh, n]
        out = (probs[..., None] * v).sum(1).reshape(-1)  # [nh*hd]
        hidden = hidden + layer.self_attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    logits = torch.zeros(ttt_steps, seq_len, cfg.draft_vocab_size, dtype=h0.dtype)
    step0 = [project(h0[i], token(i, 0), int(pos[i]) + 1) for i in range(seq_len)]
    for j in range(seq_len):
        first = j
        while doc[j] >= 0 and first > 0 and doc[first - 1] == doc[j]:
            first -= 1
        prefix_k = [step0[i][1] for i in range(first, j + 1)]
        prefix_v = [step0[i][2] for i in range(first, j + 1)]
        hidden = attend_and_finish(h0[j], step0[j][0], prefix_k, prefix_v)
        logits[0, j] = model.draft_logits(hidden)
        chain_k, chain_v = [], []
        for m in range(1, ttt_steps):
            q, k, v = project(hidden, token(j, m), int(pos[j]) + 1 + m)
            chain_k.append(k)
            chain_v.append(v)
            hidden = attend_and_finish(hidden, q, prefix_k + chain_k, prefix_v + chain_v)
            logits[m, j] = model.draft_logits(hidden)
    return logits


def _to(batch, dtype):
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}


def test_ttt_steps_match_slot_by_slot_inference(make_model, make_row, tiny_config):
    cfg = tiny_config()
    model = make_model(cfg, dtype=torch.float64)
    batch = _to(make_row(cfg, [7, 11, 4], seq_len=26), torch.float64)
    with torch.no_grad():
        expected = inference_reference(model, batch, ttt_steps=4)
        got = ttt_logits(model, batch, ttt_steps=4, attention="exact")
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_supervised_slots_per_step_stop_at_document_ends(make_model, make_row, tiny_config):
    cfg = tiny_config()
    lengths = [20, 30, 9]
    _, stats = ttt_forward(make_model(cfg), make_row(cfg, lengths, seq_len=64), ttt_steps=5)
    # Slot j of a document of length L has a step-k target only while j + 1 + k < L: L - 1 - k slots.
    expected = [sum(max(0, n - 1 - k) for n in lengths) for k in range(5)]
    assert stats["count"].tolist() == expected


def test_documents_do_not_see_each_other(make_model, make_row, tiny_config):
    # The statistics of a row holding documents A and B equal those of A alone plus B alone.
    cfg = tiny_config()
    model = make_model(cfg)
    both = make_row(cfg, [20, 30], seq_len=64, mask_prob=0.7, seed=3)
    only_a = make_row(cfg, [20], seq_len=64, seed=4)
    only_b = make_row(cfg, [30], seq_len=64, seed=5)
    for key in ("input_ids", "aux_hidden", "last_hidden", "loss_mask"):
        only_a[key][:20] = both[key][:20]
        only_b[key][:30] = both[key][20:50]
    with torch.no_grad():
        _, s_both = ttt_forward(model, both, ttt_steps=4)
        _, s_a = ttt_forward(model, only_a, ttt_steps=4)
        _, s_b = ttt_forward(model, only_b, ttt_steps=4)
    for key in ("loss_sum", "count", "full_acc_sum", "cond_acc_count"):
        torch.testing.assert_close(s_both[key], s_a[key] + s_b[key], rtol=1e-5, atol=1e-4, msg=key)


def test_step_losses_are_weighted_by_gamma(make_model, make_row, tiny_config):
    cfg = tiny_config()
    loss, stats = ttt_forward(make_model(cfg), make_row(cfg, [40, 24], mask_prob=0.6), ttt_steps=4, gamma=0.8)
    expected = sum(0.8**k * stats["loss_sum"][k] / stats["count"][k] for k in range(4))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert all(v.dtype == torch.float64 and v.device.type == "cpu" and v.shape == (4,) for v in stats.values())


def test_activation_checkpointing_gives_the_same_loss_and_gradients(make_model, make_row, tiny_config):
    cfg = tiny_config(norm_before_fc=True)
    batch = make_row(cfg, [50, 30, 20], seq_len=128, mask_prob=0.8)
    results = []
    for checkpointing in (False, True):
        model = make_model(cfg, dtype=torch.float64)
        loss, _ = ttt_forward(
            model,
            _to(batch, torch.float64),
            ttt_steps=4,
            activation_checkpointing=checkpointing,
            loss_chunk_size=40,
        )
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss_plain, grads_plain), (loss_ckpt, grads_ckpt) = results
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-12, atol=1e-12)
    assert grads_plain.keys() == grads_ckpt.keys() and "fc.weight" in grads_plain
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-10, atol=1e-12, msg=name)


def _expected_stats(model, batch, ttt_steps, doc_lengths):
    """Statistics recounted slot by slot from the draft logits and the target's logits."""
    logits = ttt_logits(model, batch, ttt_steps, attention="exact")  # [T, S, Vd]
    y = model.verifier_norm(batch["last_hidden"])
    restricted = (y @ model.verifier_lm_head.weight.T).argmax(-1)  # [S] draft ids
    full_head = torch.zeros(model.cfg.target_vocab_size, model.cfg.hidden_size)
    full_head[model.t2d] = model.verifier_lm_head.weight
    full_head[~model.t2d] = model.verifier_lm_head_rest
    true = (y @ full_head.T).argmax(-1)  # [S] target ids
    out = {k: [0] * ttt_steps for k in ("full", "cond_n", "full_t", "cond_t_n", "count")}
    start = 0
    for length in doc_lengths:
        for j in range(start, start + length):
            ok = ok_t = True
            for k in range(ttt_steps):
                t = j + 1 + k
                if t >= start + length:
                    break
                draft = int(logits[k, j].argmax())
                was_ok, was_ok_t = ok, ok_t
                ok = ok and draft == int(restricted[t])
                ok_t = ok_t and draft + int(model.d2t[draft]) == int(true[t])
                if batch["loss_mask"][t]:
                    out["count"][k] += 1
                    out["full"][k] += ok
                    out["cond_n"][k] += was_ok
                    out["full_t"][k] += ok_t
                    out["cond_t_n"][k] += was_ok_t
        start += length
    return out


def test_accuracy_statistics_match_a_slot_by_slot_count(make_model, make_row, tiny_config):
    # A 4-token draft vocab inside 8 target tokens: matches are frequent, and the target's true argmax
    # is often outside the draft vocab, so restricted and true accuracy differ.
    cfg = tiny_config(draft_vocab_size=4, target_vocab_size=8)
    model = make_model(cfg)
    lengths = [25, 17]
    batch = make_row(cfg, lengths, seq_len=48, mask_prob=0.75, seed=1)
    with torch.no_grad():
        _, stats = ttt_forward(model, batch, ttt_steps=3)
        expected = _expected_stats(model, batch, 3, lengths)
    assert stats["count"].tolist() == expected["count"]
    assert stats["full_acc_sum"].tolist() == expected["full"]
    assert stats["cond_acc_sum"].tolist() == expected["full"]
    assert stats["cond_acc_count"].tolist() == expected["cond_n"]
    assert stats["full_acc_true_sum"].tolist() == expected["full_t"]
    assert stats["cond_acc_true_count"].tolist() == expected["cond_t_n"]
    assert stats["full_acc_sum"][0] > 0 and stats["full_acc_true_sum"][0] < stats["full_acc_sum"][0]


def test_target_ids_in_the_batch_replace_the_full_head(make_model, make_row, tiny_config):
    cfg = tiny_config(draft_vocab_size=4, target_vocab_size=8)
    model = make_model(cfg)
    batch = make_row(cfg, [30], seq_len=32)
    outside = int(torch.nonzero(~model.t2d)[0])  # a target id the drafter can never propose: true accuracy 0
    batch["target_ids"] = torch.full((32,), outside)
    model.load_target_weights(**{**_target_of(model), "keep_full_head": False})
    with torch.no_grad():
        _, stats = ttt_forward(model, batch, ttt_steps=2)
    assert stats["full_acc_true_sum"].sum() == 0 and stats["count"][0] == 29
    del batch["target_ids"]
    with pytest.raises(ConfigError, match="keep_full_head=True"):
        ttt_forward(model, batch, ttt_steps=2)


def _target_of(model):
    full = torch.zeros(model.cfg.target_vocab_size, model.cfg.hidden_size)
    full[model.t2d] = model.verifier_lm_head.weight
    full[~model.t2d] = model.verifier_lm_head_rest
    return {
        "embed": model.embed_tokens.weight.detach().clone(),
        "final_norm": model.verifier_norm.weight.detach().clone(),
        "lm_head": full,
        "t2d": model.t2d.clone(),
        "d2t": model.d2t.clone(),
    }


def test_bad_batches_name_the_key_and_the_expectation(make_model, make_row, tiny_config):
    cfg = tiny_config()
    model = make_model(cfg)
    batch = make_row(cfg, [16])
    wide = {**batch, "aux_hidden": torch.zeros(16, 3 * 96)}
    with pytest.raises(DataError, match=r"batch\['aux_hidden'\] has shape \[16, 288\], expected \[16, 192\]"):
        ttt_forward(model, wide)
    out_of_vocab = {**batch, "input_ids": torch.full((16,), cfg.target_vocab_size)}
    with pytest.raises(DataError, match="outside the target vocab"):
        ttt_forward(model, out_of_vocab)
    with pytest.raises(DataError, match=r"lacks \['position_ids'\]"):
        ttt_forward(model, {k: v for k, v in batch.items() if k != "position_ids"})
    with pytest.raises(ConfigError, match="ttt_steps=0 must be at least 1"):
        ttt_forward(model, batch, ttt_steps=0)


def test_validation_replays_the_rounds_a_greedy_decoder_runs_over_the_row(make_model, make_row, tiny_config):
    """In evaluation mode the statistics carry tau_predicted's sums: round_walk over each slot's accepted chain
    (the leading steps whose draft, mapped to a target id, is the target's token there and supervised), counted
    here slot by slot from the drafts themselves. The target's tokens are made to follow the drafter's step-0
    guesses, so chains of several drafts occur; a training step does not replay (a Python loop over the row)."""
    from eagle3.acceptance import round_walk
    from eagle3.supervision import step_supervision

    cfg, steps = tiny_config(draft_vocab_size=4, target_vocab_size=8), 3
    model = make_model(cfg).eval()
    lengths = [25, 17]
    batch = make_row(cfg, lengths, seq_len=48, mask_prob=0.8, seed=2)
    with torch.no_grad():
        drafts = ttt_logits(model, batch, steps).argmax(-1)  # [steps, S] draft ids
    proposed = drafts + model.d2t[drafts]  # as target ids
    batch["target_ids"] = torch.cat([proposed[0, :1], proposed[0, :-1]])  # slot j+1's token: step 0's guess at j
    sup = [step_supervision(batch["document_ids"], batch["loss_mask"], k)[1] for k in range(steps)]
    chain = []
    for j in range(sup[0].shape[0]):
        n = 0
        while n < steps and j < sup[n].shape[0] and sup[n][j] and proposed[n, j] == batch["target_ids"][j + 1 + n]:
            n += 1
        chain.append(n)
    assert max(chain) >= 2  # the case has chains longer than one draft
    for max_new in (0, 5):
        with torch.no_grad():
            _, stats = ttt_forward(model, batch, ttt_steps=steps, walk_max_new=max_new)
        tokens, rounds = round_walk(chain, sup[0].tolist(), max_new=max_new)
        assert rounds > 0 and (stats["round_tokens_sum"][0], stats["rounds_sum"][0]) == (tokens, rounds)
    model.train()
    with torch.no_grad():
        _, stats = ttt_forward(model, batch, ttt_steps=steps)
    assert stats["rounds_sum"].sum() == 0


def test_drop_oov_targets_trains_only_where_the_drafter_could_propose_the_target(make_model, make_row, tiny_config):
    """drop_oov_targets: a slot whose target token (here the batch's target_ids) is outside the draft vocabulary
    adds nothing to the loss but still counts in the step's mean and the statistics. With one TTT step the loss is
    then the loss of the row with those slots unsupervised, scaled by kept / supervised; all in the draft vocabulary
    changes nothing, none gives a zero loss and no gradient."""
    cfg = tiny_config(draft_vocab_size=4, target_vocab_size=8)
    model = make_model(cfg)
    batch = make_row(cfg, [30], seq_len=32, seed=3)
    inside, outside = torch.nonzero(model.t2d).flatten(), torch.nonzero(~model.t2d).flatten()
    ids = torch.where(torch.arange(32) % 3 == 0, outside[0], inside[torch.arange(32) % len(inside)])
    batch["target_ids"] = ids
    model.load_target_weights(**{**_target_of(model), "keep_full_head": False})

    def loss(b, **kw):
        return ttt_forward(model, b, ttt_steps=1, **kw)

    dropped, stats = loss(batch, drop_oov_targets=True)
    kept_mask = batch["loss_mask"].clone()
    kept_mask[ids == outside[0]] = False  # target slot t is supervised at step 0 through loss_mask[t]
    masked, masked_stats = loss({**batch, "loss_mask": kept_mask})
    n, kept = stats["count"][0], masked_stats["count"][0]
    assert 0 < kept < n
    torch.testing.assert_close(dropped * n, masked * kept, rtol=1e-5, atol=1e-6)
    assert stats["count"][0] == loss(batch)[1]["count"][0]  # the statistics keep every supervised slot
    all_in = {**batch, "target_ids": inside[torch.arange(32) % len(inside)]}
    torch.testing.assert_close(loss(all_in, drop_oov_targets=True)[0], loss(all_in)[0])
    none_in = {**batch, "target_ids": torch.full((32,), int(outside[0]))}
    zero, _ = loss(none_in, drop_oov_targets=True)
    zero.backward()
    assert zero.item() == 0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
