"""The simplest correct eager implementation of the trainer's TTT step, for timing only (bench/trainer.py).

Same maths as eagle3.model.ttt_forward (loss and accuracy counts), written the plain way: a dense [S, S*(k+1)]
attention mask, a full softmax over it, log_softmax KL over every position at once under autograd, the target
head applied once over its whole vocabulary. No chunking, no checkpointing, no custom autograd. It reads the
weights of an eagle3 Eagle3Drafter so both run the same parameters; training/tests/test_eager_reference.py checks
that the two agree at a tiny shape, so this cannot drift from the trainer unnoticed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def reference_step(model, batch: dict, ttt_steps: int, gamma: float = 1.0):
    """(loss, {"loss_sum", "count", "full_acc_sum"} per step) for one packed row; fp32, plain autograd."""
    cfg, layer = model.cfg, model.layers[0]
    eps, s = cfg.rms_norm_eps, batch["input_ids"].shape[0]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    doc, pos, ids = batch["document_ids"], batch["position_ids"], batch["input_ids"]
    y = _rms(batch["last_hidden"].float(), model.verifier_norm.weight, eps)
    with torch.no_grad():
        full_head = torch.zeros(cfg.target_vocab_size, cfg.hidden_size)
        full_head[model.t2d] = model.verifier_lm_head.weight.float()
        if model.verifier_lm_head_rest.numel():
            full_head[~model.t2d] = model.verifier_lm_head_rest.float()
        target_full = y @ full_head.T  # [S, V_target]
        log_p_t = F.log_softmax(target_full[:, model.t2d], -1)  # [S, V_draft]
        target_draft_id = log_p_t.argmax(-1)
    hidden = batch["aux_hidden"].float() @ model.fc.weight.T  # [S, H]
    same_doc = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    causal = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
    eye = torch.eye(s, dtype=torch.bool)
    keys, values = [], []
    loss = torch.zeros(())
    all_right = torch.ones(s, dtype=torch.bool)
    stats = {"loss_sum": [], "count": [], "full_acc_sum": []}
    for step in range(ttt_steps):
        tok = torch.zeros_like(ids)
        tok[: s - 1 - step] = ids[1 + step :]
        emb = model.embed_tokens.weight[tok].float()
        normed = _rms(hidden, layer.hidden_norm.weight, eps)
        x = torch.cat([_rms(emb, layer.input_layernorm.weight, eps), normed], -1)
        at = layer.self_attn
        q = _rope((x @ at.q_proj.weight.T).view(s, nh, hd).transpose(0, 1), pos + 1 + step, cfg.rope_theta)
        k = _rope((x @ at.k_proj.weight.T).view(s, nkv, hd).transpose(0, 1), pos + 1 + step, cfg.rope_theta)
        v = (x @ at.v_proj.weight.T).view(s, nkv, hd).transpose(0, 1)
        keys.append(k)
        values.append(v)
        kk = torch.cat(keys, 1).repeat_interleave(nh // nkv, 0)  # [nh, S*(k+1), hd]
        vv = torch.cat(values, 1).repeat_interleave(nh // nkv, 0)
        mask = torch.cat([causal & same_doc] + [eye] * step, 1) | torch.cat([eye] + [eye] * step, 1)
        scores = (q @ kk.transpose(1, 2)) / math.sqrt(hd)
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv  # [nh, S, hd]
        residual = normed if cfg.norm_before_residual else hidden
        hidden = residual + attn.transpose(0, 1).reshape(s, nh * hd) @ at.o_proj.weight.T
        m = layer.mlp
        h2 = _rms(hidden, layer.post_attention_layernorm.weight, eps)
        hidden = hidden + (F.silu(h2 @ m.gate_proj.weight.T) * (h2 @ m.up_proj.weight.T)) @ m.down_proj.weight.T
        # loss over slots 0..n-1 against the target at slot j+1+step, within the document
        n = s - 1 - step
        valid = (doc[:n] >= 0) & (doc[:n] == doc[1 + step :])
        sup = valid & batch["loss_mask"][1 + step :].bool()
        log_p_d = F.log_softmax(_rms(hidden[:n], model.norm.weight, eps) @ model.lm_head.weight.float().T, -1)
        lt = log_p_t[1 + step :]
        kl = (lt.exp() * (lt - log_p_d)).sum(-1)
        count = sup.sum()
        loss = loss + gamma**step * (kl * sup).sum() / count.clamp(min=1)
        right = log_p_d.detach().argmax(-1) == target_draft_id[1 + step :]
        all_right[:n] &= right
        stats["loss_sum"].append(float((kl.detach() * sup).sum()))
        stats["count"].append(float(count))
        stats["full_acc_sum"].append(float((all_right[:n] & sup).sum()))
        hidden = _rms(hidden, model.norm.weight, eps) if cfg.norm_output else hidden
    return loss, {k: torch.tensor(v, dtype=torch.float64) for k, v in stats.items()}
