"""A tiny real target model, trained here from text every Linux machine has, and cached.

Nothing may be downloaded at run time, yet `eagle3 generate` and `eagle3 evaluate` need a real Hugging Face
causal LM with a tokenizer and a chat template. This builds one: a byte-level BPE tokenizer (the `tokenizers`
library) and a small `LlamaForCausalLM` (transformers), both trained on the Python standard library's own
sources (the interpreter that runs this), deterministic from a seed, saved with `save_pretrained` into a folder
that `from_pretrained` reads like any downloaded model. The folder is built once per settings and corpus and
reused: its name holds a digest of both, and it appears under its final name only when complete.

    python -m eagle3 tiny-target OUT_DIR [--steps 300] [--seed 0]       (prints the held-out loss)

It is a stand-in for a real verifier in tests and in the docs' walkthrough, not a useful model: a held-out loss of
a few nats per token on Python source, enough that its next tokens are far from uniform and a drafter can learn
them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.errors import ConfigError

# The chat format of the tiny target: one special token per role, each turn closed by <|end|>.
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", *(f"<|{r}|>" for r in ROLES)]
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
INFO_FILE = "eagle3_tiny_target.json"
# Where the tests and the walkthrough keep it (beside the local CT's root file system).
DEFAULT_CACHE_DIR = os.environ.get("EAGLE3_CACHE_DIR", "/var/cache/eagle3-pve")


@dataclass(frozen=True)
class TinyTargetConfig:
    vocab_size: int = 1024
    hidden_size: int = 64
    num_layers: int = 8  # default aux layers (eagle3.generate.default_aux_layers): 2, 4, 5
    # head_dim 64 / 2 = 32: the smallest vLLM's CPU attention takes (CPUAttentionBackend.get_supported_head_sizes in
    # vllm/v1/attention/backends/cpu_attn.py), so vLLM serves it and drafters trained on it; still GQA (2 heads, 1 KV)
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 176
    seq_len: int = 128
    batch: int = 32
    steps: int = 300
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 3_000_000
    rope_theta: float = 10000.0

    def validate(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_len", "batch", "steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"tiny-target: {key}={getattr(self, key)} must be at least 1")
        if self.vocab_size < 300:
            raise ConfigError(f"tiny-target: vocab_size={self.vocab_size} must be at least 300 (256 bytes + merges)")
        if self.num_layers < 3:
            raise ConfigError(f"tiny-target: num_layers={self.num_layers} must be at least 3 (3 distinct aux layers)")


def corpus_files(limit_bytes: int) -> list[Path]:
    """The standard library's top-level .py files in name order, up to about `limit_bytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= limit_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise ConfigError(f"tiny-target: no Python sources under {stdlib} to train on")
    return files


def corpus_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def cache_name(cfg: TinyTargetConfig) -> str:
    """The folder name of a build: settings and corpus digest, so another corpus or setting is another folder."""
    files = corpus_files(cfg.corpus_bytes)
    settings = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return f"tiny-target-{settings}-{corpus_digest(files)}"


def _train_tokenizer(cfg: TinyTargetConfig, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _token_ids(tokenizer, texts: list[str]):
    """The texts as one long[N] stream of token ids, each text followed by EOS."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


def _new_model(cfg: TinyTargetConfig, tokenizer):
    """A randomly initialised Llama of `cfg`'s shape over the tokenizer's vocabulary (seeded by cfg.seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _train(model, cfg: TinyTargetConfig, train_ids, log) -> None:
    """cfg.steps AdamW steps on random windows of the training tokens: linear warmup over the first 5 %, then a
    cosine decay to a tenth of cfg.lr; the loss logged every 50 steps."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    warmup = max(1, cfg.steps // 20)
    model.train()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        batch = torch.stack([train_ids[s : s + cfg.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"tiny-target: step {step + 1}/{cfg.steps} loss {loss.item():.3f}", flush=True)
    model.eval()


def _save(out: Path, model, tokenizer, record: dict) -> None:
    """Model, tokenizer and record written to a temporary folder beside `out`, then renamed into its place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build(out_dir: str | os.PathLike, cfg: TinyTargetConfig = TinyTargetConfig(), log=print) -> dict:
    """Train the tokenizer and the model and save both into `out_dir` (written to a temporary folder beside it,
    renamed into place when complete). Returns the build's record (also in OUT_DIR/eagle3_tiny_target.json)."""
    cfg.validate()
    out = Path(out_dir)
    started = time.monotonic()
    files = corpus_files(cfg.corpus_bytes)
    texts = [p.read_text(errors="replace") for p in files]
    # Held out: every tenth file, so the loss reported is on code the model never saw.
    train_texts = [t for i, t in enumerate(texts) if i % 10 != 9]
    held_texts = [t for i, t in enumerate(texts) if i % 10 == 9]
    tokenizer = _train_tokenizer(cfg, train_texts)
    train_ids, held_ids = _token_ids(tokenizer, train_texts), _token_ids(tokenizer, held_texts)
    model = _new_model(cfg, tokenizer)
    _train(model, cfg, train_ids, log)
    held_loss = held_out_loss(model, held_ids, cfg.seq_len)
    record = {
        "settings": asdict(cfg),
        "corpus": {
            "python": sys.version.split()[0],
            "files": len(files),
            "digest": corpus_digest(files),
            "train_tokens": int(train_ids.numel()),
            "held_out_tokens": int(held_ids.numel()),
        },
        "held_out_loss": round(held_loss, 4),
        "held_out_perplexity": round(math.exp(held_loss), 2),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    _save(out, model, tokenizer, record)
    log(
        f"tiny-target: held-out loss {held_loss:.3f} nats/token (perplexity {math.exp(held_loss):.1f}) on "
        f"{held_ids.numel()} tokens, built in {record['build_seconds']} s -> {out}",
        flush=True,
    )
    return record


def held_out_loss(model, ids, seq_len: int) -> float:
    """Mean next-token loss over the held-out tokens, in windows of `seq_len`."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, seq_len):
            window = ids[start : start + seq_len + 1]
            if window.numel() < 2:
                break
            logits = model(input_ids=window[None, :-1]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
            count += window.numel() - 1
    return total / max(1, count)


def cached(
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, cfg: TinyTargetConfig = TinyTargetConfig(), log=print
) -> Path:
    """The tiny target under `cache_dir`, built first if this settings-and-corpus pair has no complete folder."""
    import fcntl

    folder = Path(cache_dir) / cache_name(cfg)
    if (folder / INFO_FILE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second caller finds it built
        if not (folder / INFO_FILE).is_file():
            build(folder, cfg, log)
    return folder


def main(argv: list[str]) -> int:
    from eagle3.helptext import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="python -m eagle3 tiny-target",
        description="Train the tiny Llama target on the Python standard library's sources and save it "
        "(save_pretrained: config, weights, tokenizer with its chat template).",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("out_dir", help="folder to write (replaced when complete)")
    defaults = TinyTargetConfig()
    for key in ("steps", "seed", "vocab_size", "hidden_size", "num_layers", "batch", "seq_len"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=getattr(defaults, key))
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when OUT_DIR holds a complete build")
    args = ap.parse_args(argv)
    if args.if_missing and (Path(args.out_dir) / INFO_FILE).is_file():
        print(f"tiny-target: {args.out_dir} is complete already", flush=True)
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    values = {
        k: getattr(args, k) for k in ("steps", "seed", "vocab_size", "hidden_size", "num_layers", "batch", "seq_len")
    }
    build(args.out_dir, TinyTargetConfig(**values))
    return 0
