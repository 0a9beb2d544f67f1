"""The EAGLE-3 drafter (docs/facts.md#eagle-3-drafter) and its training-time-test (TTT) forward pass.

Parameter names follow speculators' Eagle3 so vLLM can serve the export:

    embed_tokens            frozen copy of the target embedding              [V_target, H]
    input_norm              optional RMSNorm over the 3 aux states (norm_before_fc)   [3H]
    fc_norm.{0,1,2}         optional RMSNorm per aux state (fc_norm, EAGLE 3.1)      [H] each
    fc                      Linear 3H -> H over the three target aux hidden states
    layers.0.input_layernorm / hidden_norm       RMSNorm of the embedding half / hidden half
    layers.0.self_attn.q_proj  2H -> heads*head_dim;  {k,v}_proj 2H -> kv_heads*head_dim (GQA);
                            o_proj heads*head_dim -> H
    layers.0.post_attention_layernorm, layers.0.mlp.{gate,up,down}_proj   (Llama SwiGLU)
    norm, lm_head           final RMSNorm, H -> V_draft (initialised from the target head rows t2d)
    verifier_norm, verifier_lm_head   frozen target final norm and head rows t2d: the teacher
    d2t long[V_draft], t2d bool[V_target]   target_id = draft_id + d2t[draft_id]

Alignment of one packed row (raw per-document data, positions restarting at 0 per document).
Slot j of the drafter holds target hidden state g_j (aux_hidden[j]); at TTT step k it embeds the
teacher-forced token input_ids[j+1+k], uses position position_ids[j]+1+k, and is supervised
against the target's distribution at slot j+1+k (from last_hidden[j+1+k]) when
loss_mask[j+1+k] is set and slot j+1+k is in the same document as slot j.

    slot j                 0    1    2    3  | 4    5    (two documents: [0,0,0,0,1,1])
    step 0 token           x1   x2   x3   y0 | y1   -
    step 0 target slot     1    2    3    -  | 5    -    (slot 3 would cross into document 1)
    step 1 token           x2   x3   y0   y1 | -    -
    step 1 target slot     2    3    -    -  | -    -

This is speculators' `shift_batch` + `align_for_step`, with the deeper steps gated per document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from eagle3.attention import TTTAttention
from eagle3.config import check_key
from eagle3.context import SINGLE, ContextShard, row_attention
from eagle3.errors import ConfigError, DataError
from eagle3.loss import DEFAULT_CHUNK_SIZE, fused_kl, target_probs
from eagle3.mla import MLAAttention, softmax_scale
from eagle3.options import TTT_STEPS, checkpoint_mode
from eagle3.rope import rope_cos_sin
from eagle3.spec import DrafterConfig
from eagle3.step_stats import STAT_KEYS, step_statistics, true_target_ids
from eagle3.supervision import check_batch, shift_tokens, step_supervision


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, scale by `weight` in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64: the parity tests)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Linear with the input cast to the weight dtype (frozen heads may be bf16 while activations are fp32)."""
    return layer(x.to(layer.weight.dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, S, hd] rotated by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        inner = cfg.num_heads * cfg.head_dim
        kv_inner = cfg.num_kv_heads * cfg.head_dim  # grouped-query attention: fewer key/value heads
        self.q_proj = nn.Linear(2 * cfg.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, kv_inner, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, kv_inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """One Llama decoder layer whose attention reads concat(norm(embedding), norm(hidden)): [S, 2H]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.norm_before_residual = cfg.norm_before_residual
        self.mla = cfg.mla
        if self.mla is None:
            self.self_attn = Eagle3Attention(cfg)
        else:  # multi-head latent attention (eagle3.mla): DeepSeek-V3's, as vLLM's deepseek_eagle3 serves it
            self.self_attn = MLAAttention(
                2 * cfg.hidden_size, cfg.hidden_size, self.mla, RMSNorm, cfg.rms_norm_eps, cfg.rope_interleave
            )
            self.mla_scale = softmax_scale(self.mla, cfg.rope_scaling)
        self.mlp = Eagle3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, embeds, cos, sin, past_keys, past_values, attention):
        """One TTT step. Returns the new hidden [S, H] and this step's post-RoPE keys/values [kv_heads, S, hd].

        Keys/values stay at kv_heads (the cache of later steps is that small); the attention expands
        them to the query heads, query head h reading key/value head h // (heads / kv_heads) (HF repeat_kv).
        """
        seq_len = hidden.shape[0]
        normed = self.hidden_norm(hidden)  # [S, H]
        residual = normed if self.norm_before_residual else hidden  # vLLM llama_eagle3 _norm_before_residual
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [S, 2H]
        if self.mla is not None:  # one latent per step is the key and the value of every head
            x = x.to(self.self_attn.kv_a_proj_with_mqa.weight.dtype)
            out, latent = self.self_attn(x, cos, sin, past_keys, attention, self.mla_scale)
            hidden = residual + out  # [S, H]
            hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
            return hidden, latent, latent
        x = x.to(self.self_attn.q_proj.weight.dtype)

        def heads(t, n):
            return t.view(seq_len, n, self.head_dim).transpose(0, 1)  # [n, S, hd]

        q = apply_rope(heads(self.self_attn.q_proj(x), self.num_heads), cos, sin)  # [nh, S, hd]
        k = apply_rope(heads(self.self_attn.k_proj(x), self.num_kv_heads), cos, sin)  # [nkv, S, hd]
        v = heads(self.self_attn.v_proj(x), self.num_kv_heads)  # [nkv, S, hd]
        # context parallelism (eagle3.context): this rank's S slots of every head -> a share of the heads over the
        # whole row, and back after the attention; the identity on one rank
        q, k, v = attention.to_heads(q), attention.to_heads(k, kv=True), attention.to_heads(v, kv=True)
        attn = attention.to_sequence(attention(q, [*past_keys, k], [*past_values, v]))  # [nh, S, hd]
        attn = attn.transpose(0, 1).reshape(seq_len, self.num_heads * self.head_dim)  # [S, nh*hd]
        hidden = residual + self.self_attn.o_proj(attn)  # [S, H]
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))  # [S, H]
        return hidden, k, v


class Eagle3Drafter(nn.Module):
    """The drafter. Call `load_target_weights` before training; `forward(batch, ...)` is `ttt_forward`."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        hidden = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, hidden)
        self.input_norm = RMSNorm(3 * hidden, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(hidden, cfg.rms_norm_eps) for _ in range(3)]) if cfg.fc_norm else None
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.verifier_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.verifier_lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        # Target head rows outside the draft vocab and their ids: only for the "true" accuracy
        # (is the target's argmax over its whole vocab what the drafter proposed?). Not saved.
        self.register_buffer("verifier_lm_head_rest", torch.zeros(0, hidden), persistent=False)
        self.register_buffer("rest_target_ids", torch.zeros(0, dtype=torch.long), persistent=False)
        self._init_weights()
        for frozen in (self.embed_tokens, self.verifier_norm, self.verifier_lm_head):
            frozen.requires_grad_(False)
        self.lm_head.requires_grad_(cfg.train_lm_head)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    # ---------------------------------------------------------------- target weights
    @torch.no_grad()
    def load_target_weights(
        self,
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        t2d: torch.Tensor,
        d2t: torch.Tensor,
        *,
        keep_full_head: bool = True,
    ) -> None:
        """Copy the frozen target pieces in: embedding [V_target, H], final norm [H], lm_head [V_target, H].

        lm_head (the drafter's) and verifier_lm_head both start as the target rows t2d.
        keep_full_head=False drops the rows outside the draft vocab (saves (V_target - V_draft) * H
        elements); then batches must carry `target_ids` for the true-target accuracy.
        """
        cfg = self.cfg
        h, vt, vd = cfg.hidden_size, cfg.target_vocab_size, cfg.draft_vocab_size
        expect = {"embed": (embed, [vt, h]), "final_norm": (final_norm, [h]), "lm_head": (lm_head, [vt, h])}
        expect |= {"t2d": (t2d, [vt]), "d2t": (d2t, [vd])}
        for key, (tensor, shape) in expect.items():
            if list(tensor.shape) != shape:
                raise DataError(
                    f"target weight {key} has shape {list(tensor.shape)}, expected {shape} "
                    f"(hidden_size={h}, target_vocab_size={vt}, draft_vocab_size={vd}); "
                    "the dataset's target.safetensors/vocab.safetensors do not match the drafter config"
                )
        t2d = t2d.to(torch.bool)
        draft_to_target = torch.arange(vd, device=d2t.device) + d2t.long()  # [V_draft]
        in_draft = torch.nonzero(t2d).flatten()  # [V_draft] target ids, ascending
        if in_draft.numel() != vd or not torch.equal(draft_to_target.cpu(), in_draft.cpu()):
            raise DataError(
                f"vocab mapping mismatch: t2d marks {in_draft.numel()} target ids but draft_vocab_size={vd}, "
                "or draft_id + d2t[draft_id] is not the ascending list of target ids marked in t2d; "
                "rebuild vocab.safetensors with one mapping for both"
            )
        self.embed_tokens.weight.copy_(embed)
        self.verifier_norm.weight.copy_(final_norm)
        rows = lm_head[t2d.to(lm_head.device)]  # [V_draft, H]
        self.verifier_lm_head.weight.copy_(rows)
        self.lm_head.weight.copy_(rows)
        self.t2d.copy_(t2d)
        self.d2t.copy_(d2t)
        device = self.fc.weight.device
        if keep_full_head and vd < vt:
            rest = (~t2d).to(lm_head.device)
            self.verifier_lm_head_rest = lm_head[rest].to(device=device, dtype=self.verifier_lm_head.weight.dtype)
            self.rest_target_ids = torch.nonzero(~t2d).flatten().to(device)
        else:
            self.verifier_lm_head_rest = self.verifier_lm_head_rest.new_zeros(0, h)
            self.rest_target_ids = self.rest_target_ids.new_zeros(0)
        self._full_head = keep_full_head or vd == vt

    def frozen_to(self, dtype: torch.dtype) -> Eagle3Drafter:
        """Store the frozen embedding and target heads in `dtype` (bf16 halves them); trainable weights untouched."""
        frozen = [self.embed_tokens, self.verifier_norm, self.verifier_lm_head]
        if not self.cfg.train_lm_head:
            frozen.append(self.lm_head)
        for module in frozen:
            module.to(dtype)
        self.verifier_lm_head_rest = self.verifier_lm_head_rest.to(dtype)
        return self

    # ---------------------------------------------------------------- pieces of the forward pass
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter logits over the draft vocab: lm_head(norm(h)) [N, V_draft]."""
        return _linear(self.lm_head, self.norm(hidden))

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Target logits restricted to the draft vocab: verifier_lm_head(verifier_norm(y)) [N, V_draft]."""
        return _linear(self.verifier_lm_head, self.verifier_norm(last_hidden))

    @torch.no_grad()
    def target_chunk(self, last_hidden: torch.Tensor):
        """One chunk of target slots [C, H] -> (draft-vocab argmax [C], true target argmax [C] or None,
        (p_t [C, V_draft], neg-entropy [C])): the target logits made once for the argmax and the loss."""
        y = self.verifier_norm(last_hidden)  # [C, H]
        logits = _linear(self.verifier_lm_head, y)  # [C, V_draft]
        best, best_id = logits.max(-1)
        probs = target_probs(logits)
        del logits
        if not getattr(self, "_full_head", False):
            return best_id, None, probs
        as_target = best_id + self.d2t[best_id]
        if self.rest_target_ids.numel():
            rest_best, rest_id = _linear_rows(self.verifier_lm_head_rest, y).max(-1)  # [C]
            as_target = torch.where(rest_best > best, self.rest_target_ids[rest_id], as_target)
        return best_id, as_target, probs

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.embed_tokens(token_ids)  # [S, H]

    def _layer_step(self, hidden, token_ids, cos, sin, past_keys, past_values, attention):
        return self.layers[0](hidden, self.embed(token_ids), cos, sin, past_keys, past_values, attention)

    def _layer_step_uncached(self, *args):
        """The step under selective checkpointing: autocast's weight-cast cache off inside it, so the recomputation
        runs the same ops as the forward did (the cache would skip the weight casts of steps after the first in
        forward but not in recomputation, and selective checkpointing matches ops by their order)."""
        device = self.fc.weight.device.type
        if not torch.is_autocast_enabled(device):
            return self._layer_step(*args)
        with torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False):
            return self._layer_step(*args)

    def ttt_hidden_states(
        self,
        batch: dict,
        ttt_steps: int,
        attention: str = "auto",
        activation_checkpointing: bool | str = False,
        context: ContextShard = SINGLE,
    ):
        """Yield the drafter's pre-norm hidden state [S, H] of each TTT step 0..ttt_steps-1 (teacher forced).

        activation_checkpointing (eagle3.options.checkpoint_mode): full (and true) recomputes each step's decoder
        layer in backward; selective keeps the outputs of the layer's matmuls (q/k/v, o, gate, up, down) and
        recomputes only the cheap work between them (norms, concat, RoPE, SiLU, the residual adds) and the
        attention's blockwise forward. The K/V of earlier steps are passed in and this step's K/V returned, so
        recomputation sees the same cache (HF-style checkpointing would drop it).

        context (eagle3.context): the hidden states are those of this rank's slots [a, b) of the row; batch holds
        aux_hidden of those slots only, the per-slot id vectors of the whole row.
        """
        mode = checkpoint_mode(activation_checkpointing)
        a, b = context.bounds(batch["input_ids"].shape[0])
        input_ids = batch["input_ids"]
        attn = row_attention(TTTAttention(batch["document_ids"], attention), context, self.cfg.attention_kv_heads)
        aux = batch["aux_hidden"]
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:  # one RMSNorm per aux state: [S, 3H] as 3 x [S, H]
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, aux.chunk(3, dim=-1), strict=True)], -1)
        hidden = _linear(self.fc, aux)  # [S, H]
        base_positions = batch["position_ids"][a:b] + 1  # the embedded token sits one slot right
        keys, values = [], []
        for step in range(ttt_steps):
            if step and self.cfg.norm_output:  # EAGLE 3.1: a later step reads the post-norm hidden state
                hidden = self.norm(hidden)
            token_ids = shift_tokens(input_ids, step + 1)[a:b]  # [S]
            cos, sin = rope_cos_sin(
                base_positions + step, self.cfg.rope_dim, self.cfg.rope_theta, self.cfg.rope_scaling
            )  # [S, rotary dims]
            args = (hidden, token_ids, cos, sin, list(keys), list(values), attn)
            if mode != "none" and torch.is_grad_enabled():
                if mode == "selective":
                    step_fn, context = self._layer_step_uncached, {"context_fn": selective_checkpoint_context}
                else:
                    step_fn, context = self._layer_step, {}
                hidden, k, v = checkpoint(step_fn, *args, use_reentrant=False, **context)
            else:
                hidden, k, v = self._layer_step(*args)
            keys.append(k)
            values.append(v)
            yield hidden  # pre-norm: draft_logits applies `norm`

    def forward(
        self,
        batch: dict,
        *,
        ttt_steps: int = TTT_STEPS,
        gamma: float = 1.0,
        activation_checkpointing: bool | str = False,
        loss_chunk_size: int = DEFAULT_CHUNK_SIZE,
        attention: str = "auto",
        context: ContextShard = SINGLE,
        lk_weight: float = 0.0,
        walk_max_new: int = 0,
        drop_oov_targets: bool = False,
    ):
        """See `ttt_forward`."""
        return _ttt_loss(
            self,
            batch,
            ttt_steps,
            gamma,
            activation_checkpointing,
            loss_chunk_size,
            attention,
            context,
            lk_weight,
            walk_max_new,
            drop_oov_targets,
        )


# Selective activation checkpointing: what the decoder step keeps. The outputs of its matmuls (aten.mm: the linear
# layers; the attention's blockwise products are bmm and recomputed, a small share at packed document lengths) are
# expensive to recompute; everything else in the step is elementwise, a norm, RoPE or a concat: cheap to recompute
# and, summed, larger to keep. eagle3.flops counts the recomputed attention forward; eagle3.plan the kept bytes.
SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context():
    """context_fn of torch.utils.checkpoint.checkpoint for the selective mode."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _linear_rows(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(weight.dtype), weight)


def _ttt_loss(
    model: Eagle3Drafter,
    batch,
    ttt_steps,
    gamma,
    activation_checkpointing,
    loss_chunk_size,
    attention,
    context: ContextShard = SINGLE,
    lk_weight: float = 0.0,
    walk_max_new: int = 0,
    drop_oov_targets: bool = False,
):
    """The TTT steps first (every step's hidden state is kept for backward anyway: the next step's input), then
    the loss walked by chunks of *target* slots: a chunk's target logits, argmax and probabilities are made once
    and shared by every TTT step whose supervised slots fall in it (step k's slot j reads target slot j+1+k), so
    the target side costs one pass over the row whatever the chunk size, and no fp32 [positions, V] tensor
    outlives its chunk. loss_chunk_size 0: one chunk of the whole row.

    Under context parallelism (eagle3.context) the slots are this rank's [a, b) and the targets [a, end): the loss
    is their share of the row's (each step normalised by the row's supervised count) and the statistics their sums."""
    check_key("ttt_steps", ttt_steps)  # the config's own bound: one declaration
    if loss_chunk_size < 0:
        raise ConfigError(f"loss_chunk_size={loss_chunk_size} must be 0 (one pass) or a chunk size, e.g. 4096")
    a, b, end = context.held(check_batch(model.cfg, batch, context, ttt_steps), ttt_steps)
    device = model.fc.weight.device
    batch = {k: v.to(device) for k, v in batch.items()}
    last_hidden = batch["last_hidden"]  # target slots [a, end)
    chunk = min(loss_chunk_size or end - a, end - a) or 1
    hiddens = list(model.ttt_hidden_states(batch, ttt_steps, attention, activation_checkpointing, context))
    sup, weights = [], []
    for step in range(ttt_steps):
        _, supervised = step_supervision(batch["document_ids"], batch["loss_mask"], step)  # the whole row's
        own = supervised[a:b]
        sup.append((own, own.sum()))
        weights.append(own.float() * (gamma**step / supervised.sum().clamp(min=1).float()))  # [n]
    loss = last_hidden.new_zeros((), dtype=torch.float32)
    kls: list[list] = [[] for _ in range(ttt_steps)]
    ids: list[list] = [[] for _ in range(ttt_steps)]
    alphas: list[list] = [[] for _ in range(ttt_steps)]
    restricted, true = [], []
    for c in range(0, end - a, chunk):  # target slots a + c .. a + e
        e = min(c + chunk, end - a)
        best_id, true_id, (p_t, neg_entropy) = model.target_chunk(last_hidden[c:e])
        restricted.append(best_id)
        true.append(true_id)
        in_draft = _in_draft(model, batch, true_id, c, e) if drop_oov_targets else None
        for step in range(ttt_steps):
            n = weights[step].shape[0]
            # own slots j whose target j+1+step is in the chunk
            lo, hi = max(c - 1 - step, 0), min(e - 1 - step, n)
            if hi <= lo:
                continue
            t0 = lo + 1 + step - c
            weight = weights[step][lo:hi]
            if in_draft is not None:  # no loss where the target's token is one the drafter cannot propose
                weight = weight * in_draft[t0 : t0 + hi - lo]
            part, kl, draft_ids, alpha = fused_kl(
                model,
                hiddens[step][lo:hi],
                p_t[t0 : t0 + hi - lo],
                neg_entropy[t0 : t0 + hi - lo],
                weight,
                lk_weight,
            )
            loss = loss + part
            kls[step].append(kl)
            ids[step].append(draft_ids)
            alphas[step].append(alpha)
        del p_t, neg_entropy
    del hiddens
    restricted_ids = torch.cat(restricted) if restricted else torch.zeros(0, dtype=torch.long, device=device)
    true_ids = true_target_ids(model, batch, true, restricted_ids)
    # Evaluation mode (the validation) replays the rounds of a decoder; not under context parallelism: a round crosses
    # the ranks' shares of a row. -1: no walk.
    walk = -1 if model.training or context.enabled else walk_max_new
    stats = step_statistics(model, loss, kls, ids, sup, restricted_ids, true_ids, last_hidden, alphas, walk)
    return loss, {key: stats[i] for i, key in enumerate(STAT_KEYS)}


def ttt_forward(
    model,
    batch: dict,
    *,
    ttt_steps: int = TTT_STEPS,
    gamma: float = 1.0,
    activation_checkpointing: bool = False,
    loss_chunk_size: int = DEFAULT_CHUNK_SIZE,
    attention: str = "auto",
    context: ContextShard = SINGLE,
    lk_weight: float = 0.0,
    walk_max_new: int = 0,
    drop_oov_targets: bool = False,
):
    """Loss and statistics of one packed row over `ttt_steps` TTT steps.

    loss = sum_k gamma^k * mean loss_i over the supervised slots of step k (a scalar to backward), loss_i the
    KL, or (1 - lk_weight) KL + lk_weight LK (eagle3.loss: the acceptance-aware loss); with drop_oov_targets, 0 at
    the slots whose target token (the target's argmax over its whole vocabulary) is outside the draft vocabulary
    (they still count in the step's mean and in the statistics).
    stats: float64 CPU tensors [ttt_steps] as sums and counts (all-reduce them in one collective):
    loss_sum (loss_i summed over supervised slots), count (supervised slots), full_acc_sum (slots
    whose draft argmax matched at every step 0..k), cond_acc_sum / cond_acc_count (matched at k
    among slots that matched at every step < k), and the *_true_* versions that compare against
    the target's argmax over its whole vocabulary (a target token outside the draft vocab is a miss), and
    alpha_sum (the expected acceptance sum_v min(p_target, p_draft), summed over supervised slots), and in
    evaluation mode round_tokens_sum / rounds_sum (step 0's column): the rounds a greedy decoder writing at most
    `walk_max_new` tokens per response (0: all) would run over the row (eagle3.acceptance.round_walk).

    context (eagle3.context): this rank's share of the row (eagle3.context.shard_row made the batch): the loss
    and the statistics of its slots; summed over the context-parallel ranks they are the row's.

    Goes through `model(...)` so DDP / FSDP wrappers run their hooks.
    """
    return model(
        batch,
        ttt_steps=ttt_steps,
        gamma=gamma,
        activation_checkpointing=activation_checkpointing,
        loss_chunk_size=loss_chunk_size,
        attention=attention,
        context=context,
        lk_weight=lk_weight,
        walk_max_new=walk_max_new,
        drop_oov_targets=drop_oov_targets,
    )


def _in_draft(model, batch: dict, true_id, lo: int, hi: int) -> torch.Tensor:
    """1.0 where the target's token at target slots [lo, hi) (the chunk's full-vocabulary argmax, else the batch's
    `target_ids`) is in the draft vocabulary, else 0.0."""
    if true_id is None:
        if "target_ids" not in batch:
            raise ConfigError(
                "drop_oov_targets needs the target's token over its whole vocabulary: load_target_weights(..., "
                "keep_full_head=True), or `target_ids` in the batch"
            )
        true_id = batch["target_ids"][lo:hi].long()
    return model.t2d[true_id].float()


@torch.no_grad()
def ttt_logits(model: Eagle3Drafter, batch: dict, ttt_steps: int, attention: str = "auto") -> torch.Tensor:
    """Draft logits of every TTT step, [ttt_steps, S, V_draft] (small rows only: tests and export checks)."""
    check_batch(model.cfg, batch)
    device = model.fc.weight.device
    batch = {k: v.to(device) for k, v in batch.items()}
    return torch.stack([model.draft_logits(h) for h in model.ttt_hidden_states(batch, ttt_steps, attention)])
