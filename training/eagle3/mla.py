"""Multi-head latent attention (MLA, DeepSeek-V2/V3) for a drafter's decoder layer, over the TTT steps.

The weights are named and shaped as transformers' DeepseekV3Attention and vLLM's EAGLE-3 DeepSeek drafter
(deepseek_eagle3) name them, for an input of `input_size` (2H in the drafter: the concat of the normed embedding and
the normed hidden state):

    q_a_proj            input -> q_lora_rank          (q_lora_rank 0: q_proj, input -> heads * qk_head_dim)
    q_a_layernorm       RMSNorm(q_lora_rank)
    q_b_proj            q_lora_rank -> heads * (qk_nope_head_dim + qk_rope_head_dim)
    kv_a_proj_with_mqa  input -> kv_lora_rank + qk_rope_head_dim   (the latent and the one shared rotary key)
    kv_a_layernorm      RMSNorm(kv_lora_rank)
    kv_b_proj           kv_lora_rank -> heads * (qk_nope_head_dim + v_head_dim)
    o_proj              heads * v_head_dim -> hidden

Only the decoupled qk_rope_head_dim part of queries and keys is rotated (DeepSeek lays those dimensions out in
interleaved pairs: `rope_interleave`), with the verifier's rope scaling (eagle3.rope: YaRN's attention factor on cos
and sin); the softmax scale is qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when a YaRN config gives
mscale_all_dim, as DeepSeek-V3 does.

Across TTT steps the attention runs in the latent space (the "absorbed" form of DeepSeek-V2, section 2.1.2 of
arXiv:2405.04434): each step keeps only its latent c = kv_a_layernorm(...) [S, kv_lora_rank] and its rotated shared
key [S, qk_rope_head_dim], the same for every head; a query's no-position part is taken into the latent by the key
half of kv_b_proj, the attention's values are the latents, and its output leaves the latent by the value half of
kv_b_proj. So a later step attends to kv_lora_rank + qk_rope_head_dim numbers per token and step, one "key/value
head" for all heads, where the expanded form would hold heads x (qk_head_dim + v_head_dim). The scores and the
output equal the expanded form's (tests/test_mla.py holds both to transformers' attention).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle3.rope import yarn_mscale
from eagle3.spec import MLAShape


def softmax_scale(shape: MLAShape, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a YaRN scaling that gives mscale_all_dim.

    >>> softmax_scale(MLAShape(4, 0, 32, 16, 16, 16), None) == 32 ** -0.5
    True
    >>> yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
    ...         "mscale_all_dim": 1.0}
    >>> round(softmax_scale(MLAShape(4, 0, 32, 16, 16, 16), yarn) / 32 ** -0.5, 4)  # (0.1 ln 40 + 1)^2
    1.8739
    """
    scale = shape.qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., S, d] rotated by position with cos, sin [S, d] (rotate-half tables, eagle3.rope.rope_cos_sin).

    interleave: the pairs are (x0, x1), (x2, x3), ... as DeepSeek's weights lay them out; the result holds the
    rotated pairs' first members, then their second ones (queries and keys alike, so their dot products are those
    of the pairs). Otherwise NeoX rotate-half pairs (x_i, x_{i+d/2}).
    """
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    if interleave:
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    else:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class MLAAttention(nn.Module):
    """The MLA block of a drafter's decoder layer; `forward` runs one TTT step against the latents of the steps
    before it. `norm` is the RMSNorm class of the layer (eagle3.model.RMSNorm)."""

    def __init__(self, input_size: int, hidden_size: int, shape: MLAShape, norm, eps: float, interleave: bool):
        super().__init__()
        shape.validate()
        self.shape = shape
        self.interleave = interleave
        heads, qk = shape.num_heads, shape.qk_head_dim
        if shape.q_lora_rank:
            self.q_a_proj = nn.Linear(input_size, shape.q_lora_rank, bias=False)
            self.q_a_layernorm = norm(shape.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(shape.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(input_size, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, shape.latent_dim, bias=False)
        self.kv_a_layernorm = norm(shape.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * shape.v_head_dim, hidden_size, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[heads, S, qk_head_dim], before the rotation."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.shape.q_lora_rank else self.q_proj(x)
        return q.view(x.shape[0], self.shape.num_heads, self.shape.qk_head_dim).transpose(0, 1)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """This step's key for every head: [1, S, kv_lora_rank + qk_rope_head_dim] = (normed latent, rotated key)."""
        compressed = self.kv_a_proj_with_mqa(x)  # [S, r + rope], in the matmul dtype (bf16 under autocast)
        c, k_rot = compressed.split([self.shape.kv_lora_rank, self.shape.qk_rope_head_dim], dim=-1)
        normed = self.kv_a_layernorm(c).to(compressed.dtype)  # kept in the matmul dtype, as the queries are
        return torch.cat([normed, rotate(k_rot, cos, sin, self.interleave)], dim=-1)[None]

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's halves per head: keys' [heads, qk_nope_head_dim, r], values' [heads, v_head_dim, r]."""
        s = self.shape
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]

    def forward(self, x, cos, sin, past_latents, attention, scale: float):
        """One TTT step on x [S, input_size] (cos, sin [S, qk_rope_head_dim]): the output [S, hidden] and this
        step's latent [1, S, latent_dim], which the later steps attend to.

        `attention` is eagle3.attention.TTTAttention: called with queries [heads, S, D] and the steps' latents
        [1, S, D] as keys and as values (one key/value head for all), it scales the scores by D^-0.5; the queries
        are pre-scaled so that the scores carry `scale` instead.
        """
        s = self.shape
        q = self.queries(x)  # [heads, S, qk]
        q_nope, q_rot = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self.up_projections()
        q_latent = torch.einsum("hsn,hnr->hsr", q_nope, w_uk)  # the no-position part, taken into the latent
        query = torch.cat([q_latent, rotate(q_rot, cos, sin, self.interleave)], dim=-1)  # [heads, S, r + rope]
        query = query * (scale * math.sqrt(s.latent_dim))
        # context parallelism (eagle3.context): a share of the heads over the whole row, and every rank the whole
        # latent (the one key/value head of all); the identity on one rank
        query = attention.to_heads(query)
        latent = attention.to_heads(self.latent(x, cos, sin), kv=True)  # [1, S, r + rope]
        keys = [*past_latents, latent]
        # The values are the latents: the keys' first kv_lora_rank numbers. Passing the keys as the values keeps one
        # tensor per step (no copy for either attention path) and the output's last qk_rope_head_dim are dropped.
        per_head = attention(query, keys, keys)[..., : s.kv_lora_rank]  # [heads/cp, S, r]: this rank's heads
        out_latent = attention.to_sequence(per_head)  # [heads, S, r]: this rank's slots
        out = torch.einsum("hsr,hvr->shv", out_latent, w_uv).reshape(x.shape[0], s.num_heads * s.v_head_dim)
        return self.o_proj(out), latent
