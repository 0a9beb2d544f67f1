"""A small random target language model and a learnable dataset made from it.

The "target" is a random recurrent model (fixed seed):

    h_t    = tanh(A h_{t-1} + E[x_t])                       # [H] state after reading token x_t
    last_t = h_t with dimension 0 set to a constant          # the "last hidden state" (before the final norm)
    p(x_{t+1}) = softmax(lm_head @ rms_norm(last_t) * final_norm / temperature)

`lm_head[:, 0]` carries a Zipf-like bias (through the constant dimension), so token frequencies are skewed
as in real text and a draft vocab smaller than the target vocab covers most of the mass. The three "aux
layers" are fixed random rotations of E[x_t] (an early layer), of A h_{t-1} (a middle layer) and of h_t (a
late layer). The next token is therefore a learnable function of what an EAGLE-3 drafter sees (aux states at
position j and the embedding of token j+1), and the trainer's target distribution, computed from
`last_hidden` with the frozen `final_norm` and `lm_head`, is exactly the distribution tokens were sampled from.

Documents are chat-like: 1-3 turns of a prompt (uniform random tokens, loss_mask 0) followed by a response
sampled from the target (loss_mask 1), with lengths varied per document.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.data import DatasetWriter, build_vocab_mapping, masked_token_counts
from eagle3.errors import ConfigError
from eagle3.progress import Progress


@dataclass
class SynthConfig:
    num_samples: int = 512
    hidden_size: int = 64
    target_vocab: int = 1024
    draft_vocab: int = 512
    min_len: int = 48
    max_len: int = 512
    seed: int = 0
    temperature: float = 0.7
    zipf: float = 1.0
    context: float = 0.6  # spectral scale of A: how much the past matters beyond the current token
    dtype: str = "bfloat16"
    aux_layer_ids: tuple[int, int, int] = (2, 8, 13)  # of a pretend 16-layer target
    shard_tokens: int = 1 << 18

    def validate(self) -> None:
        if self.num_samples < 1:
            raise ConfigError(f"num_samples={self.num_samples} must be at least 1")
        if self.hidden_size < 8:
            raise ConfigError(f"hidden_size={self.hidden_size} must be at least 8")
        if not 1 <= self.draft_vocab <= self.target_vocab:
            raise ConfigError(
                f"draft_vocab={self.draft_vocab} must be between 1 and target_vocab={self.target_vocab}; "
                "the draft vocab is a subset of the target vocab"
            )
        if not 8 <= self.min_len <= self.max_len:
            raise ConfigError(f"min_len={self.min_len}, max_len={self.max_len}: need 8 <= min_len <= max_len")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} must be positive")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype={self.dtype!r} must be bfloat16, float16 or float32")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Llama RMSNorm in fp32: the same normalisation the trainer applies with the frozen final norm.

    >>> [round(v, 3) for v in rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2))[0].tolist()]
    [0.849, 1.131]
    """
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class RandomTarget:
    """The frozen random target model; all weights drawn from one seeded generator."""

    BIAS_DIM_VALUE = 1.0

    def __init__(self, cfg: SynthConfig):
        g = torch.Generator().manual_seed(cfg.seed)
        h, v = cfg.hidden_size, cfg.target_vocab
        self.cfg = cfg
        self.embed = torch.randn(v, h, generator=g) * 0.9  # [V, H]
        a = torch.randn(h, h, generator=g) / math.sqrt(h)  # [H, H]
        self.A = a / torch.linalg.matrix_norm(a, ord=2) * cfg.context  # [H, H] spectral norm = context
        self.final_norm = 0.75 + 0.5 * torch.rand(h, generator=g)  # [H]
        lm_head = torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))  # [V, H]
        # Zipf-like prior over a random permutation of the vocab, carried by the constant dimension 0.
        rank = torch.randperm(v, generator=g).float()  # [V]
        bias = -cfg.zipf * torch.log1p(rank)  # [V]
        lm_head[:, 0] = bias * cfg.temperature  # logits/temperature keep the prior at its intended strength
        self.lm_head = lm_head
        self.rotations = [torch.linalg.qr(torch.randn(h, h, generator=g)).Q for _ in range(3)]  # 3 x [H, H]
        self.generator = g

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V]: what the trainer computes from `last_hidden` with the frozen weights."""
        return rms_norm(last_hidden, self.final_norm) @ self.lm_head.T

    def generate(self, lengths: list[int], prompt_spans: list[list[tuple[int, int]]]) -> list[dict]:
        """Run a batch of documents step by step; prompt positions take uniform random tokens."""
        cfg, g = self.cfg, self.generator
        b, t_max, h = len(lengths), max(lengths), cfg.hidden_size
        is_prompt = torch.zeros(b, t_max, dtype=torch.bool)  # [B, T]
        for i, spans in enumerate(prompt_spans):
            for start, end in spans:
                is_prompt[i, start:end] = True
        random_tokens = torch.randint(0, cfg.target_vocab, (b, t_max), generator=g)  # [B, T]
        tokens = torch.zeros(b, t_max, dtype=torch.long)  # [B, T]
        aux = torch.zeros(b, t_max, 3 * h)  # [B, T, 3H]
        last = torch.zeros(b, t_max, h)  # [B, T, H]
        state = torch.zeros(b, h)  # [B, H]
        x = random_tokens[:, 0]  # [B]
        for t in range(t_max):
            tokens[:, t] = x
            carry = state @ self.A.T  # [B, H]
            emb = self.embed[x]  # [B, H]
            state = torch.tanh(carry + emb)  # [B, H]
            out = state.clone()
            out[:, 0] = self.BIAS_DIM_VALUE
            last[:, t] = out
            aux[:, t] = torch.cat(
                [emb @ self.rotations[0], torch.tanh(carry) @ self.rotations[1], state @ self.rotations[2]],
                dim=-1,
            )  # [B, 3H]
            # Gumbel-max: a sample from softmax(logits / T), much faster than torch.multinomial here.
            u = torch.rand(b, cfg.target_vocab, generator=g).clamp_(min=1e-12)  # [B, V]
            sampled = (self.logits(out) / cfg.temperature - torch.log(-torch.log(u))).argmax(-1)  # [B]
            if t + 1 < t_max:
                x = torch.where(is_prompt[:, t + 1], random_tokens[:, t + 1], sampled)
        docs = []
        for i, n in enumerate(lengths):
            docs.append(
                {
                    "input_ids": tokens[i, :n].clone(),
                    "loss_mask": ~is_prompt[i, :n],
                    "aux_hidden": aux[i, :n].clone(),
                    "last_hidden": last[i, :n].clone(),
                }
            )
        return docs


def document_layout(length: int, g: torch.Generator) -> list[tuple[int, int]]:
    """Prompt spans of a 1-3 turn document of `length` tokens; the rest are responses.

    Each prompt takes 10-40 % of its turn; the first token is always prompt.
    """
    turns = int(torch.randint(1, 4, (1,), generator=g))
    bounds = [round(length * k / turns) for k in range(turns + 1)]
    spans = []
    for start, end in itertools.pairwise(bounds):
        frac = 0.1 + 0.3 * float(torch.rand(1, generator=g))
        spans.append((start, start + max(1, int((end - start) * frac))))
    return spans


def sample_lengths(cfg: SynthConfig, g: torch.Generator) -> list[int]:
    """Log-uniform lengths in [min_len, max_len]: many short documents, some long ones."""
    lo, hi = math.log(cfg.min_len), math.log(cfg.max_len)
    u = torch.rand(cfg.num_samples, generator=g)
    return [round(math.exp(lo + (hi - lo) * float(v))) for v in u]


def synthesize(
    out_dir: str | os.PathLike, cfg: SynthConfig, batch: int = 128, log=print, progress: bool = False
) -> Path:
    """Write a native dataset of `cfg.num_samples` documents to `out_dir`; returns the index path. `progress`:
    a bar on stderr (plain lines when it is not a terminal), documents generated."""
    cfg.validate()
    threads = torch.get_num_threads()
    # The per-token steps are tiny matrix products: one thread is fastest and does not fight other processes.
    torch.set_num_threads(1)
    try:
        return _synthesize(out_dir, cfg, batch, log, progress)
    finally:
        torch.set_num_threads(threads)


def _synthesize(out_dir: str | os.PathLike, cfg: SynthConfig, batch: int, log, progress: bool) -> Path:
    started = time.monotonic()
    target = RandomTarget(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    lengths = sample_lengths(cfg, g)
    dtype = getattr(torch, cfg.dtype)
    writer = DatasetWriter(out_dir, cfg.hidden_size, dtype, shard_tokens=cfg.shard_tokens)
    counts = torch.zeros(cfg.target_vocab, dtype=torch.long)
    layouts = [document_layout(n, g) for n in lengths]
    # Batches of similar lengths waste few steps; documents are still written in id order.
    by_length = sorted(range(cfg.num_samples), key=lambda i: lengths[i])
    docs: list[dict | None] = [None] * cfg.num_samples
    bar = Progress(cfg.num_samples, "synth: documents") if progress else None
    for start in range(0, cfg.num_samples, batch):
        ids = by_length[start : start + batch]
        for i, doc in zip(ids, target.generate([lengths[i] for i in ids], [layouts[i] for i in ids]), strict=True):
            docs[i] = doc
        if bar is not None:
            bar.update(len(ids))
    if bar is not None:
        bar.close()
    for doc in docs:
        assert doc is not None
        writer.add(doc["input_ids"], doc["loss_mask"], doc["aux_hidden"], doc["last_hidden"])
        counts += masked_token_counts(doc["input_ids"], doc["loss_mask"], cfg.target_vocab)
    d2t, t2d = build_vocab_mapping(counts, cfg.draft_vocab)
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))
    index = writer.finish(
        target_vocab_size=cfg.target_vocab,
        draft_vocab_size=cfg.draft_vocab,
        aux_layer_ids=cfg.aux_layer_ids,
        t2d=t2d,
        d2t=d2t,
        embed=target.embed.to(dtype),
        final_norm=target.final_norm.to(dtype),
        lm_head=target.lm_head.to(dtype),
        extra={"source": "synth", "synth": {k: v for k, v in vars(cfg).items() if k != "aux_layer_ids"}},
    )
    log(
        f"synth: {cfg.num_samples} documents, {sum(lengths)} tokens, hidden {cfg.hidden_size}, "
        f"vocab {cfg.target_vocab} -> draft {cfg.draft_vocab} (covers {coverage:.1%} of supervised tokens), "
        f"{time.monotonic() - started:.1f}s -> {out_dir}",
        flush=True,
    )
    return index


SYNTH_HELP = {
    "num_samples": "documents to write",
    "hidden_size": "hidden size of the random target (the drafter's hidden size)",
    "target_vocab": "target vocab size",
    "draft_vocab": "draft vocab size: the most frequent supervised target tokens",
    "min_len": "shortest document in tokens (at least 8)",
    "max_len": "longest document in tokens",
    "seed": "seed of the target's weights and of the documents",
    "temperature": "sampling temperature of the target (lower: more predictable responses)",
    "zipf": "strength of the Zipf-like token-frequency prior",
    "context": "how much the past beyond the current token matters (spectral scale of the recurrence)",
    "dtype": "dtype of the stored hidden states",
    "aux_layer_ids": "the three pretend target layers recorded in the index",
}


def build_parser() -> argparse.ArgumentParser:
    from eagle3.helptext import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m eagle3 synth",
        description="Write a learnable synthetic dataset: a random recurrent target model writes chat-like "
        "documents (prompt masked, response supervised) with their hidden states.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("out_dir", help="the new dataset directory")
    d = SynthConfig()
    for name in ("num_samples", "hidden_size", "target_vocab", "draft_vocab", "min_len", "max_len", "seed"):
        p.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(d, name), metavar="INT", help=SYNTH_HELP[name]
        )
    for name in ("temperature", "zipf", "context"):
        p.add_argument("--" + name, type=float, default=getattr(d, name), metavar="FLOAT", help=SYNTH_HELP[name])
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"), help=SYNTH_HELP["dtype"])
    p.add_argument(
        "--aux-layer-ids",
        default=",".join(map(str, d.aux_layer_ids)),
        metavar="A,B,C",
        help=SYNTH_HELP["aux_layer_ids"],
    )
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    values = vars(args)
    out_dir = values.pop("out_dir")
    try:
        values["aux_layer_ids"] = tuple(int(v) for v in values["aux_layer_ids"].split(","))
    except ValueError as e:
        raise ConfigError(f"--aux-layer-ids {values['aux_layer_ids']!r} must be 3 integers like 2,8,13") from e
    if len(values["aux_layer_ids"]) != 3:
        raise ConfigError(f"--aux-layer-ids {values['aux_layer_ids']} must name exactly 3 layers")
    synthesize(out_dir, SynthConfig(**values), progress=True)
    return 0
