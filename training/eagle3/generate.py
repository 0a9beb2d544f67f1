"""`python -m eagle3 generate`: the training data, from the target itself.

A Hugging Face causal LM read from a local folder (`from_pretrained` on a path; never the hub) runs over a local
dataset, and what an EAGLE-3 drafter learns from is written straight into the native format (eagle3.data):

- the tokens, through the target's chat template when the data is a conversation, and the loss mask on the
  assistant turns (each turn's tokens found by rendering the conversation up to it and through it);
- the hidden states entering the aux layers (EAGLE-3's low, middle and high: by default 2, n/2 and n-3 of n
  layers, as speculators and vLLM number them: layer i's input) and the last hidden state before the final norm;
- the draft vocabulary (t2d/d2t) from the counts of supervised tokens, the target's embedding, final norm and head;
- the target's config (name, architecture, hidden size, rope, norm epsilon) in index.json, which the trainer's
  drafter and the export take the verifier's values from.

Input: JSONL with `messages` (the OpenAI layout), `conversations` (ShareGPT) or `text`, or a plain-text file, read
and tokenized by eagle3.samples. The target runs in transformers, or in vLLM with `--engine vllm`
(eagle3/generate_vllm.py: for targets that need a serving engine to run at all).

Resumable: samples are written in shards of `--shard-samples`, each to a temporary name and renamed when complete,
in an order fixed by the input; a restart (after kill -9 too) keeps every complete shard and writes the rest, so no
sample is lost or doubled. index.json comes last. Under torchrun each rank writes the shards n with
n % world_size == rank; rank 0 writes the index when all are there.

An output folder that refuses a write (full: ENOSPC/EDQUOT, read-only: EROFS, not writable: EACCES/EPERM) stops
the command with exit 5 (eagle3.errors.EXIT_STORAGE; the datagen unit never restarts on it) and one line naming
the folder, the errno and the error kind (`storage_line`); the complete shards are kept, the shard being written
is removed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from eagle3.errors import EXIT_OK, EXIT_STORAGE, ConfigError, DataError, StorageError
from eagle3.regenerate import regenerate
from eagle3.samples import Sample, build_plan, read_records
from eagle3.storage import output_writes, storage_line
from eagle3.target_hooks import HiddenStates, final_norm

SHARD_NAME = "shards/shard_{:05d}.safetensors"
PLAN_FILE = "generate_plan.json"
# Tests only: SIGKILL this process right after shard N is in place (the resume test's kill -9).
FAULT_KILL_ENV = "EAGLE3_FAULT_KILL_AFTER_SHARD"
ENGINES = ("transformers", "vllm")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's aux layers for an n-layer target: a low, the middle and a high layer, ascending (the hidden states
    entering those decoder layers, 0 being the embeddings).

    From 7 layers on this is the convention of the EAGLE-3 reference code, vLLM (`get_eagle3_aux_hidden_state_layers`)
    and speculators: (2, n // 2, n - 3). Below 7 layers those three collide or run backwards (6 layers: 2, 3, 3;
    3 layers: 2, 1, 0), so the middle stays n // 2 and the low and high layers move to its neighbours where 2 and
    n - 3 would reach it: low = min(2, n // 2 - 1), high = max(n - 3, n // 2 + 1). From 7 layers on these are
    2 and n - 3, the values exported drafters already name. They are ascending because vLLM and the reference
    concatenate the captured states in layer order, whatever order the ids are listed in. A target of fewer than
    3 layers has no 3 distinct layers: ConfigError naming its depth.

    >>> default_aux_layers(32), default_aux_layers(61), default_aux_layers(8)
    ((2, 16, 29), (2, 30, 58), (2, 4, 5))
    >>> [default_aux_layers(n) for n in range(3, 8)]
    [(0, 1, 2), (1, 2, 3), (1, 2, 3), (2, 3, 4), (2, 3, 4)]
    """
    if num_layers < 3:
        raise ConfigError(
            f"the target has {num_layers} decoder layer{'s' * (num_layers != 1)}: EAGLE-3 reads the hidden states "
            "of 3 distinct layers, so it needs a target of at least 3"
        )
    middle = num_layers // 2
    return (min(2, middle - 1), middle, max(num_layers - 3, middle + 1))


def _plan_digest(samples: list[Sample], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for s in samples:
        h.update(json.dumps([s.input_ids, s.loss_mask]).encode())
    return h.hexdigest()[:16]


def target_config_record(config, target_dir: Path) -> dict:
    """What index.json records of the target: the verifier's identity and the values a drafter takes from it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    from eagle3.rope import normalize_rope_scaling

    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    theta = params.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0
    return {
        "name_or_path": str(target_dir),
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": getattr(text, "model_type", ""),
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "rope_theta": float(theta),
        "rope_scaling": normalize_rope_scaling(dict(params), "the target's rope_parameters"),
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
    }


def generate(
    target_dir: str | os.PathLike,
    data: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_len: int = 2048,
    aux_layers: tuple[int, int, int] | None = None,
    draft_vocab: int = 0,
    dtype: str = "bfloat16",
    shard_samples: int = 64,
    device: str = "auto",
    rank: int = 0,
    world_size: int = 1,
    regenerate_responses: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
    regenerate_max_new: int = 512,
    engine: str = "transformers",
    engine_args: dict | None = None,
    log=print,
) -> Path | None:
    """Write the dataset (see the module's docstring); returns index.json's path on rank 0, None elsewhere.
    engine "vllm" takes the hidden states from vLLM (eagle3/generate_vllm.py), `engine_args` its LLM(...) extras."""
    from transformers import AutoConfig

    from eagle3.tokenizer import load_tokenizer

    target, out = Path(target_dir), Path(out_dir)
    store = _check_arguments(target, out, dtype, shard_samples, max_len)
    _check_engine(engine, regenerate_responses, world_size)
    config = AutoConfig.from_pretrained(target, local_files_only=True)
    layers, vocab, draft = _target_shape(config, aux_layers, draft_vocab)
    tokenizer, model = (
        _load_target(target, device) if engine == "transformers" else (load_tokenizer(target, "generate"), None)
    )
    records = read_records(Path(data))
    with output_writes(out):  # a folder that refuses a write: StorageError naming it (exit EXIT_STORAGE)
        out.mkdir(parents=True, exist_ok=True)
        if regenerate_responses:
            if world_size > 1:
                raise ConfigError("generate: --regenerate runs on one rank (run it once, then generate under torchrun)")
            records = regenerate(
                records, model, tokenizer, out, temperature=temperature, seed=seed, max_new=regenerate_max_new, log=log
            )
        samples = build_plan(records, tokenizer, max_len)
        settings = {
            "target": str(target.resolve()),
            "data": str(Path(data).resolve()),
            "max_len": max_len,
            "aux_layers": list(layers),
            "dtype": dtype,
            "shard_samples": shard_samples,
            "regenerate": {"temperature": temperature, "seed": seed, "max_new": regenerate_max_new}
            if regenerate_responses
            else None,
            **({"engine": engine} if engine != "transformers" else {}),  # older folders' digests stay valid
        }
        digest = _plan_digest(samples, settings)
        (out / "shards").mkdir(exist_ok=True)
        if rank == 0:
            _claim_folder(out, digest, settings, len(samples))
        shards = [range(s, min(s + shard_samples, len(samples))) for s in range(0, len(samples), shard_samples)]
        complete = _shard_check(out, shards, store)
        mine = [n for n in range(len(shards)) if n % world_size == rank]
        todo = [n for n in mine if not complete(n)]
        if len(todo) < len(mine):
            log(f"generate: resuming: {len(mine) - len(todo)} of {len(mine)} shards are complete", flush=True)
        if todo:
            source = _hidden_states_source(engine, model, target, config, layers, samples, out, engine_args, log)
            try:
                _write_shards(source.states, samples, shards, todo, out, store, rank, log)
            finally:
                source.close()
        if rank != 0:
            return None
        weights = _target_tensors(model, target, config, store)
        return _finish(
            config, target, samples, shards, complete, out, store, vocab, draft, layers, settings, weights, log
        )


def _check_engine(engine: str, regenerate_responses: bool, world_size: int) -> None:
    """What the engine cannot do; ConfigError before anything is written (and before vLLM is imported)."""
    if engine not in ENGINES:
        raise ConfigError(f"generate: engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine != "vllm":
        return
    if regenerate_responses:
        raise ConfigError(
            "generate: --regenerate runs the target through transformers; leave out --engine vllm "
            "to regenerate, or generate from data that already holds the target's responses"
        )
    if world_size > 1:
        raise ConfigError(
            "generate: --engine vllm runs as one process (vLLM spreads the target over GPUs itself: "
            """--vllm-args '{"tensor_parallel_size": 8}'); do not start it under torchrun"""
        )


def _target_tensors(model, target: Path, config, store) -> dict:
    """The target's embedding, final norm and head in the storage dtype: from the loaded model, or (vLLM ran the
    target) read from its safetensors files."""
    if model is not None:
        weights = {
            "embed": model.get_input_embeddings().weight,
            "final_norm": final_norm(model).weight,
            "lm_head": model.get_output_embeddings().weight,
        }
    else:
        from eagle3.generate_vllm import target_weights

        weights = target_weights(target, config)
    return {k: v.detach().to(store).cpu() for k, v in weights.items()}


def _hidden_states_source(engine, model, target, config, layers, samples, out, engine_args, log):
    """What runs the target: states(samples) -> [(aux [T, 3H], last [T, H])] per sample, and close()."""
    if engine == "vllm":
        from eagle3.generate_vllm import HiddenStatesSource

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        longest = max(len(s.input_ids) for s in samples)
        return HiddenStatesSource(target, layers, text.num_hidden_layers, longest, out, engine_args, log)
    return TransformersStates(model, layers)


class TransformersStates:
    """The target in transformers, one sample per forward, its hidden states kept by HiddenStates' hooks."""

    def __init__(self, model, layers):
        self.model, self.hooks = model, HiddenStates(model, layers)

    def states(self, samples: list[list[int]]):
        import torch

        dev, result = next(self.model.parameters()).device, []
        for input_ids in samples:
            ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
            with torch.inference_mode():
                self.model.model(input_ids=ids[None])  # the decoder stack: the head is not needed
            aux = torch.cat([self.hooks.kept[f"aux{k}"][0] for k in range(3)], dim=-1)
            result.append((aux.cpu(), self.hooks.kept["last"][0].cpu()))
        return result

    def close(self) -> None:
        self.hooks.close()


def _check_arguments(target: Path, out: Path, dtype: str, shard_samples: int, max_len: int):
    """The storage dtype; ConfigError for a target that is no model, bad settings or a finished `out`."""
    from eagle3.data import DTYPES, INDEX_FILE

    if not (target / "config.json").is_file():
        raise ConfigError(f"generate: {target} is not a model folder (no config.json); give a local target folder")
    if dtype not in DTYPES:
        raise ConfigError(f"generate: dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if shard_samples < 1 or max_len < 2:
        raise ConfigError("generate: --shard-samples must be at least 1 and --max-len at least 2")
    if (out / INDEX_FILE).is_file():
        raise ConfigError(f"generate: {out} already holds a finished dataset ({INDEX_FILE}); choose another folder")
    return DTYPES[dtype]


def _target_shape(config, aux_layers, draft_vocab: int) -> tuple[tuple[int, int, int], int, int]:
    """(aux layers, target vocab, draft vocab), the defaults where none is given; ConfigError if they don't fit."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = aux_layers or default_aux_layers(text_config.num_hidden_layers)
    if len(set(layers)) != 3 or not all(0 <= i < text_config.num_hidden_layers for i in layers):
        raise ConfigError(
            f"generate: aux layers {list(layers)} must be 3 distinct layers of the target's "
            f"{text_config.num_hidden_layers} (0 .. {text_config.num_hidden_layers - 1})"
        )
    vocab = text_config.vocab_size
    draft = draft_vocab or vocab
    if not 1 <= draft <= vocab:
        raise ConfigError(f"generate: --draft-vocab {draft_vocab} must be between 1 and the target's vocab {vocab}")
    return layers, vocab, draft


def _load_target(target: Path, device: str):
    """(tokenizer, model in eval mode); device "auto" is CUDA in bf16 when there is a GPU, else CPU in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target, "generate")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    model_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=model_dtype).to(dev).eval()
    return tokenizer, model


def _shard_check(out: Path, shards: list[range], store):
    """complete(n): shard n is on disk with all its tensors (4 per sample, 6 with 8-bit scales); resume skips it."""
    from safetensors import safe_open

    from eagle3.data import FP8

    def complete(n: int) -> bool:
        path = out / SHARD_NAME.format(n)
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), framework="pt") as f:
                return len(list(f.keys())) == (6 if store == FP8 else 4) * len(shards[n])
        except Exception:
            return False

    return complete


def _claim_folder(out: Path, digest: str, settings: dict, count: int) -> None:
    """Record which generation this folder holds (generate_plan.json), or refuse one that holds another."""
    plan_path = out / PLAN_FILE
    if plan_path.is_file():
        old = json.loads(plan_path.read_text())
        if old.get("digest") != digest:
            raise ConfigError(
                f"generate: {out} holds shards of another generation (other target, data or settings: "
                f"{old.get('settings')}); resume with the same arguments or choose another folder"
            )
    else:
        tmp = plan_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"digest": digest, "settings": settings, "samples": count}) + "\n")
        os.replace(tmp, plan_path)


def _finish(
    config,
    target: Path,
    samples: list[Sample],
    shards: list[range],
    complete,
    out: Path,
    store,
    vocab: int,
    draft: int,
    layers,
    settings: dict,
    weights: dict,
    log,
) -> Path:
    """Rank 0, once every shard is complete: the draft vocabulary, the target's weights and config, index.json."""
    import torch

    from eagle3.data import DatasetWriter, build_vocab_mapping, masked_token_counts

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    deadline = time.monotonic() + 24 * 3600
    while not all(complete(n) for n in range(len(shards))):  # the other ranks' shards
        if time.monotonic() > deadline:
            raise DataError(f"generate: shards of other ranks did not appear in {out}")
        time.sleep(2)
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += masked_token_counts(torch.tensor(s.input_ids), torch.tensor(s.loss_mask), vocab)
    d2t, t2d = build_vocab_mapping(counts, draft)
    writer = DatasetWriter(out, text_config.hidden_size, store)
    writer.adopt_shards(
        [
            {
                "file": SHARD_NAME.format(n),
                "first_sample": shards[n].start,
                "lengths": [len(samples[i].input_ids) for i in shards[n]],
            }
            for n in range(len(shards))
        ]
    )
    record = target_config_record(config, target)
    index = writer.finish(
        target_vocab_size=vocab,
        draft_vocab_size=draft,
        aux_layer_ids=tuple(layers),
        t2d=t2d,
        d2t=d2t,
        embed=weights["embed"],
        final_norm=weights["final_norm"],
        lm_head=weights["lm_head"],
        extra={
            "source": "generate",
            "target_config": record,
            "verifier": {"name_or_path": record["name_or_path"], "architectures": record["architectures"]},
            "generate": settings,
        },
    )
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))
    log(
        f"generate: {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens "
        f"({int(counts.sum())} supervised), draft vocab {draft} of {vocab} covers {coverage:.1%}, "
        f"aux layers {list(layers)} -> {index}",
        flush=True,
    )
    return index


def _write_shards(
    states, samples: list[Sample], shards: list[range], todo: list[int], out: Path, store, rank: int, log
) -> None:
    """The hidden states of each shard in `todo` (states(list of token ids) -> [(aux, last)]) written under a
    temporary name, renamed when complete; a progress line at most every 10 s."""
    import torch
    from safetensors.torch import save_file

    from eagle3.data import sample_tensors

    todo_samples = sum(len(shards[n]) for n in todo)
    todo_tokens = sum(len(samples[i].input_ids) for n in todo for i in shards[n])
    started, done_samples, done_tokens, last_line = time.monotonic(), 0, 0, 0.0
    for n in todo:
        tensors = {}
        shard = [samples[i] for i in shards[n]]
        for i, sample, (aux, last) in zip(shards[n], shard, states([s.input_ids for s in shard]), strict=True):
            ids = torch.tensor(sample.input_ids, dtype=torch.long)
            tensors.update(sample_tensors(i, ids, torch.tensor(sample.loss_mask), aux, last, store))
            done_samples += 1
            done_tokens += ids.numel()
        path = out / SHARD_NAME.format(n)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            save_file(tensors, str(tmp))
            with open(tmp, "rb") as f:  # a write error that shows only at sync (NFS, quota) shows here
                os.fsync(f.fileno())
            os.replace(tmp, path)  # complete: only now does it have the name a resume trusts
        except BaseException:
            tmp.unlink(missing_ok=True)  # a half-written shard never stays behind, and frees its space
            raise
        if os.environ.get(FAULT_KILL_ENV, "") == str(n):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        now = time.monotonic()
        if now - last_line >= 10 or done_samples == todo_samples:
            rate = done_tokens / max(now - started, 1e-9)
            eta = (todo_tokens - done_tokens) / max(rate, 1e-9)
            log(
                f"generate: rank {rank}: {done_samples}/{todo_samples} samples, {done_tokens} tokens, "
                f"{rate:,.0f} tokens/s, ETA {eta:.0f} s",
                flush=True,
            )
            last_line = now


def build_parser() -> argparse.ArgumentParser:
    from eagle3.helptext import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="python -m eagle3 generate",
        description="Write an EAGLE-3 training set from a local Hugging Face causal LM (the target) and a local "
        "JSONL (messages / conversations / text) or text file.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("out_dir", help="dataset folder to write (a restart with the same arguments resumes)")
    ap.add_argument("--target", required=True, help="the target model's folder (from_pretrained, local only)")
    ap.add_argument("--data", required=True, help="JSONL with messages, conversations or text; or a text file")
    ap.add_argument("--max-len", type=int, default=2048, help="tokens per sample at most (longer are cut)")
    ap.add_argument(
        "--aux-layers",
        default="",
        help="three target layers, e.g. 2,16,29; empty: 2, n/2, n-3 (see default_aux_layers)",
    )
    ap.add_argument("--draft-vocab", type=int, default=0, help="draft vocab size; 0: the target's vocab")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="dtype of the stored hidden states: bfloat16, float16, "
        "float32, or float8_e4m3fn (8-bit with a scale per token and layer, read back as bfloat16)",
    )
    ap.add_argument("--shard-samples", type=int, default=64, help="samples per shard (the unit of resuming)")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    ap.add_argument(
        "--regenerate",
        action="store_true",
        help="replace every assistant turn by the target's own response first (the distribution the "
        "drafter will serve); kept in OUT_DIR/regenerated.jsonl, resumable",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="regenerate: 0 greedy, else sampled")
    ap.add_argument("--seed", type=int, default=0, help="regenerate: seed (plus the record number) when sampling")
    ap.add_argument("--max-new", type=int, default=512, help="regenerate: tokens per response at most")
    ap.add_argument(
        "--engine",
        choices=ENGINES,
        default="transformers",
        help="what runs the target: transformers (one process per rank), or vllm (one process; vLLM's tensor "
        "parallel and kernels; eagle3/generate_vllm.py)",
    )
    ap.add_argument("--vllm-args", default="{}", help="with --engine vllm: more LLM(...) arguments (JSON)")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    layers = None
    if args.aux_layers:
        try:
            layers = tuple(int(x) for x in args.aux_layers.split(","))
        except ValueError as e:
            raise ConfigError(f"generate: --aux-layers {args.aux_layers!r} is not three integers (2,16,29)") from e
        if len(layers) != 3:
            raise ConfigError(f"generate: --aux-layers {args.aux_layers!r} is not three integers (2,16,29)")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = args.device
    if device == "auto" and world > 1:
        import torch

        if torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    try:
        generate(
            args.target,
            args.data,
            args.out_dir,
            max_len=args.max_len,
            aux_layers=layers,
            draft_vocab=args.draft_vocab,
            dtype=args.dtype,
            shard_samples=args.shard_samples,
            device=device,
            rank=rank,
            world_size=world,
            regenerate_responses=args.regenerate,
            temperature=args.temperature,
            seed=args.seed,
            regenerate_max_new=args.max_new,
            engine=args.engine,
            engine_args=_engine_args(args),
        )
    except StorageError as e:  # a restart cannot help: the unit's RestartPreventExitStatus holds EXIT_STORAGE
        print(storage_line(e), file=sys.stderr, flush=True)
        return EXIT_STORAGE
    return EXIT_OK


def _engine_args(args) -> dict | None:
    if args.engine != "vllm":
        if args.vllm_args != "{}":
            raise ConfigError("generate: --vllm-args needs --engine vllm")
        return None
    from eagle3.engine_vllm import parse_engine_args

    return parse_engine_args(args.vllm_args)
