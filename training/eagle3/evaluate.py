"""`python -m eagle3 evaluate`: the real acceptance length of a drafter, by decoding with it.

Greedy chain speculative decoding of the target: each round the drafter proposes K tokens from the target's aux
hidden states (step 0 reads the newest token and the aux states; step k reads its own draft k), the target runs
once over the sequence with the K drafts appended, and the longest prefix of drafts equal to the target's own
greedy choices is kept, plus the target's next token (the bonus). The output is therefore the target's plain
greedy decoding, token for token, whatever the drafter proposes (tests/test_evaluate.py checks it); the drafter
only decides how many tokens each target forward yields.

Reported: tau_real = the tokens the drafting rounds added to the output per drafting round (the acceptance length,
bonus included; 1 is no gain, K + 1 at most). Each prompt's prefill forward and the one token it yields are left
out: that is the convention of vLLM's counters (1 + accepted / drafts, also reported here as acceptance_length),
speculators and SpecForge, and the two differ only where a prompt's last round is cut at --max-new or at the end
of text. (Before, tau_real was tokens / target forwards with the prefills counted, which pulls the figure towards
1: 0.016 lower at tau 2 over 128 tokens; tokens_per_target_forward keeps that figure.) Beside it: a 95 % bootstrap confidence interval of tau_real
over the prompts (BOOTSTRAP_RESAMPLES resamples of the prompts, seed BOOTSTRAP_SEED: a ratio of sums, so a prompt
weighs by its rounds), each prompt's tokens, rounds, accepted drafts and tau, the acceptance rate per draft
position (position i is reached only when 1..i-1 were accepted), and the wall-clock time of speculative and plain
greedy decoding on this machine, both with the same target forward (full recompute, no KV cache: the ratio
isolates what the drafter saves in target forwards, and overstates neither). A line per prompt goes to stderr as
it is decoded, the result line to stdout.

`--engine vllm` decodes the same prompts with vLLM instead, with and without the drafter (eagle3/engine_vllm.py):
its counters give the acceptance, its KV cache the real tokens/s. This decoder stays the reference.

The simulated acceptance length the trainer reports in validation assumes every position of every document can
start a chain of ttt_steps drafts, teacher-forced; real decoding drafts K from the frontier only, feeds the drafter
its own drafts, chains end at the end of the text, and a rejected draft restarts from the target's token. Yet the
measurements so far have the real figure above the simulated one: on a real target the simulated validation figure
understated the real one by 12-18 %, and on the tiny target the real one came out above in 8 of 9 checkpoints
(docs/pipeline.md). Read the simulated figure as a cautious estimate, not an upper bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.acceptance import BOOTSTRAP_RESAMPLES, bootstrap_ci, tau_of
from eagle3.errors import ConfigError

# In the run folder: one line per `eagle3 evaluate` of one of its checkpoints.
EVALUATE_FILE = "evaluate.jsonl"


@dataclass
class DecodeStats:
    tokens: int = 0  # of the output, the prefill's token included
    target_forwards: int = 0  # a prefill per prompt, then one per drafting round
    reached: list[int] = field(default_factory=list)  # per draft position: rounds that got there
    accepted: list[int] = field(default_factory=list)  # per draft position: rounds that accepted it
    seconds: float = 0.0
    prefills: int = 0  # prompts decoded: each one's first forward yields one token and drafts nothing

    @property
    def rounds(self) -> int:
        return self.target_forwards - self.prefills

    @property
    def tau(self) -> float | None:
        """tau_real (tau_of): the tokens of the drafting rounds per round."""
        return tau_of(self.tokens, self.prefills, self.rounds)

    def add(self, other: DecodeStats) -> None:
        self.tokens += other.tokens
        self.target_forwards += other.target_forwards
        self.prefills += other.prefills
        self.seconds += other.seconds
        for mine, theirs in ((self.reached, other.reached), (self.accepted, other.accepted)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v


class TargetRunner:
    """The target's greedy next tokens and the hidden states entering its aux layers, one full forward each."""

    def __init__(self, model, aux_layers):
        from eagle3.target_hooks import HiddenStates

        self.model = model
        self.hooks = HiddenStates(model, tuple(aux_layers))

    def forward(self, ids: list[int]):
        import torch

        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0]
        aux = torch.cat([self.hooks.kept[f"aux{k}"][0] for k in range(3)], dim=-1)
        return logits.argmax(-1).tolist(), aux.float()


def greedy(runner: TargetRunner, prompt: list[int], max_new: int, eos: int | None = None) -> tuple[list[int], float]:
    """Plain greedy decoding, one full target forward per token: (new tokens, seconds)."""
    started = time.perf_counter()
    seq = list(prompt)
    for _ in range(max_new):
        token = runner.forward(seq)[0][-1]
        seq.append(token)
        if token == eos:
            break
    return seq[len(prompt) :], time.perf_counter() - started


class DrafterProposer:
    """K draft tokens from an Eagle3Drafter at the frontier of a sequence (target ids)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def propose(self, seq: list[int], aux, k: int) -> list[int]:
        import torch

        h = self.drafter.cfg.hidden_size
        length = len(seq) + k
        input_ids = torch.zeros(length, dtype=torch.long)
        input_ids[: len(seq)] = torch.tensor(seq)
        aux_row = torch.zeros(length, 3 * h)
        known = len(seq) - 1  # aux states of the positions before the newest token (later ones are not read)
        aux_row[:known] = aux[:known]
        batch = {
            "input_ids": input_ids,
            "aux_hidden": aux_row.to(self.drafter.fc.weight.dtype),
            "last_hidden": torch.zeros(length, h, dtype=self.drafter.fc.weight.dtype),
            "loss_mask": torch.ones(length, dtype=torch.bool),
            "document_ids": torch.zeros(length, dtype=torch.long),
            "position_ids": torch.arange(length),
        }
        frontier = len(seq) - 2  # its step 0 reads the newest token, seq[-1]
        drafts: list[int] = []
        with torch.no_grad():
            for step, hidden in enumerate(self.drafter.ttt_hidden_states(batch, k, attention="exact")):
                d = int(self.drafter.draft_logits(hidden[frontier : frontier + 1]).argmax(-1))
                token = d + int(self.drafter.d2t[d])
                drafts.append(token)
                if step + 1 < k:  # step k reads draft k (the generator reads input_ids at each step)
                    input_ids[frontier + step + 2] = token
        return drafts


class FrequentTokenProposer:
    """The baseline: always the target's most frequent supervised token, K times."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, seq, aux, k: int) -> list[int]:
        return [self.token] * k


def speculative(
    runner: TargetRunner, proposer, prompt: list[int], max_new: int, k: int, eos: int | None = None
) -> tuple[list[int], DecodeStats]:
    """Greedy chain speculative decoding: the target's greedy tokens, and how many each target forward gave."""
    stats = DecodeStats(reached=[0] * k, accepted=[0] * k)
    started = time.perf_counter()
    preds, aux = runner.forward(prompt)
    stats.target_forwards += 1
    stats.prefills += 1
    seq = [*prompt, preds[-1]]
    while len(seq) - len(prompt) < max_new and seq[-1] != eos:
        drafts = proposer.propose(seq, aux, k)
        preds, aux = runner.forward(seq + drafts)
        stats.target_forwards += 1
        base = len(seq) - 1  # the target's prediction for the token after seq[-1]
        n = 0
        while n < k:
            stats.reached[n] += 1
            if preds[base + n] != drafts[n]:
                break
            stats.accepted[n] += 1
            n += 1
        new = [*drafts[:n], preds[base + n]]
        if eos in new:
            new = new[: new.index(eos) + 1]
        seq += new
    out = seq[len(prompt) :][:max_new]
    stats.tokens = len(out)
    stats.seconds = time.perf_counter() - started
    return out, stats


def prompts_from(records: list[dict], tokenizer, limit: int, max_prompt: int) -> list[list[int]]:
    """Prompt tokens of held-out samples: a conversation up to its last assistant turn (with the template's
    generation prompt), or the first half of a text."""
    out = []
    for record in records[:limit]:
        if "messages" in record:
            turns = record["messages"]
            last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=len(turns))
            rendered = tokenizer.apply_chat_template(turns[:last], add_generation_prompt=True, return_dict=True)
            ids = list(rendered["input_ids"])
        else:
            ids = tokenizer(record["text"])["input_ids"]
            ids = ids[: max(2, len(ids) // 2)]
        out.append(ids[-max_prompt:])
    return out


def load_drafter(path: str | Path, checkpoint: str = "best"):
    """A drafter from a run folder (its `checkpoint`: best, latest or a checkpoint folder) or an export folder;
    (model, run config or None). Either is verified first (eagle3.trained.pick_checkpoint, export.verify_export):
    damaged weights are never evaluated, so no result of theirs is recorded."""
    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        from eagle3.export import load_exported

        return load_exported(path), None
    from eagle3 import checkpoint as ckpt
    from eagle3.trained import load_trained

    model, used, cfg = load_trained(str(path), checkpoint)
    manifest = json.loads((used / ckpt.MARKER).read_text())
    cfg.evaluated_step = int(manifest["step"])  # the step the report plots tau_real at
    return model, cfg


def simulated_tau(run_dir: Path, step: int, field: str = "acceptance_length") -> float | None:
    """The validation figure `field` the run recorded at `step` (metrics.jsonl), if it validated there: the
    stationary acceptance_length, or tau_predicted (the replayed rounds, the prediction of tau_real)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "val" and record.get("step") == step and record.get(field) is not None:
            return float(record[field])
    return None


def evaluate(
    target_dir,
    drafter_path,
    data,
    *,
    k: int = 3,
    max_new: int = 64,
    prompts: int = 16,
    max_prompt: int = 512,
    baseline: bool = True,
    checkpoint: str = "best",
    log=print,
) -> dict:
    """Decode the first `prompts` samples of `data` with the target and the drafter, and with the target alone;
    the result dict (the module's docstring). `log` gets a line per prompt (file=sys.stderr) and the result line."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.samples import read_records
    from eagle3.tokenizer import load_tokenizer

    if k < 1 or max_new < 1 or prompts < 1:
        raise ConfigError("evaluate: --k, --max-new and --prompts must be at least 1")
    check_target(target_dir)
    tokenizer = load_tokenizer(target_dir, "evaluate")
    drafter, run_cfg = load_drafter(drafter_path, checkpoint)
    drafter = drafter.float().eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=torch.float32).eval()
    if target.config.hidden_size != drafter.cfg.hidden_size:
        raise ConfigError(
            f"evaluate: the drafter's hidden size {drafter.cfg.hidden_size} is not the target's "
            f"{target.config.hidden_size}: it was trained for another target"
        )
    runner = TargetRunner(target, drafter.cfg.aux_layer_ids)
    eos = tokenizer.eos_token_id
    prompt_ids = prompts_from(read_records(Path(data)), tokenizer, prompts, max_prompt)
    total, plain_seconds, exact = DecodeStats(reached=[0] * k, accepted=[0] * k), 0.0, True
    per_prompt = []
    for n, ids in enumerate(prompt_ids, 1):
        out, stats = speculative(runner, DrafterProposer(drafter), ids, max_new, k, eos)
        plain, seconds = greedy(runner, ids, max_new, eos)
        exact &= out == plain
        total.add(stats)
        plain_seconds += seconds
        per_prompt.append(
            {"tokens": stats.tokens, "rounds": stats.rounds, "accepted": sum(stats.accepted), "tau": stats.tau}
        )
        log(
            f"evaluate: prompt {n}/{len(prompt_ids)}: {stats.tokens} tokens in {stats.rounds} rounds, tau "
            f"{_fmt(stats.tau)}; running tau_real {_fmt(total.tau)}"
            + ("" if out == plain else "; its output differs from greedy decoding"),
            file=sys.stderr,
            flush=True,
        )
    result = _result(k, len(prompt_ids), total, per_prompt, plain_seconds, exact)
    if run_cfg is not None:
        result["step"] = run_cfg.evaluated_step
        result["tau_simulated"] = simulated_tau(Path(run_cfg.run_dir), result["step"])
        result["tau_predicted"] = simulated_tau(Path(run_cfg.run_dir), result["step"], "tau_predicted")
    if baseline:
        result["tau_frequent_token"] = frequent_token_tau(runner, target.config.vocab_size, prompt_ids, max_new, k, eos)
    log(summary_line(result), flush=True)
    return result


def _result(k: int, prompts: int, total: DecodeStats, per_prompt: list, plain_seconds: float, exact: bool) -> dict:
    """The result dict of `evaluate` (the module's docstring) from its decoding's counts."""
    rounds, accepted = total.rounds, sum(total.accepted)
    return {
        "engine": "eagle3",
        "k": k,
        "prompts": prompts,
        "tokens": total.tokens,
        "target_forwards": total.target_forwards,
        "tau_real": total.tau,
        # its 95 % bootstrap interval over the prompts (bootstrap_ci)
        "tau_real_ci95": bootstrap_ci([(p["tokens"] - 1, p["rounds"]) for p in per_prompt]),
        "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
        # tau_real as recorded before it left the prefill out: tokens / target forwards (prefills included)
        "tokens_per_target_forward": round(total.tokens / max(1, total.target_forwards), 4),
        # vLLM's figure (1 + accepted / drafts), here for comparison with `--engine vllm`
        "drafting_rounds": rounds,
        "accepted_tokens": accepted,
        "acceptance_length": round(1 + accepted / rounds, 4) if rounds else None,
        "acceptance_per_position": [
            round(a / r, 4) if r else None for a, r in zip(total.accepted, total.reached, strict=True)
        ],
        "per_prompt": per_prompt,
        "speculative_seconds": round(total.seconds, 3),
        "greedy_seconds": round(plain_seconds, 3),
        "speedup": round(plain_seconds / max(total.seconds, 1e-9), 3),
        "exact": exact,
    }


def frequent_token_tau(runner, vocab_size: int, prompt_ids: list[list[int]], max_new: int, k: int, eos) -> float | None:
    """The baseline: tau_real of a drafter that always proposes the prompts' most frequent token."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in prompt_ids:
        counts += torch.bincount(torch.tensor(ids), minlength=counts.numel())
    frequent = int(counts.argmax())
    base = DecodeStats(reached=[0] * k, accepted=[0] * k)
    for ids in prompt_ids:
        base.add(speculative(runner, FrequentTokenProposer(frequent), ids, max_new, k, eos)[1])
    return base.tau


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_line(result: dict) -> str:
    """The result line on stdout: it starts with `evaluate: tau_real` (roles/eagle3_evaluate prints the last line
    that starts with `evaluate:`, and molecule's lxc scenario looks for that prefix).

    >>> print(summary_line({"tau_real": 2.1234, "tau_real_ci95": [1.9, 2.31], "bootstrap_resamples": 2000, "k": 3,
    ...     "prompts": 16, "tokens": 1024, "drafting_rounds": 480, "acceptance_per_position": [0.6, 0.5, 0.4],
    ...     "speedup": 1.5, "exact": True, "tau_simulated": 1.9, "tau_predicted": 2.05, "tau_frequent_token": 1.1}))
    evaluate: tau_real 2.123 (95 % CI 1.900-2.310 over the 16 prompts, bootstrap) tokens per drafting round, the prefill's token not counted (K=3, 16 prompts, 1024 tokens, 480 rounds); acceptance per position [0.6, 0.5, 0.4]; speedup 1.50x on this machine (full-recompute target forward); output equals greedy: True; simulated tau 1.900; predicted tau 2.050; most-frequent-token drafter: tau 1.100
    """
    ci, simulated, predicted, frequent = (
        result.get("tau_real_ci95"),
        result.get("tau_simulated"),
        result.get("tau_predicted"),
        result.get("tau_frequent_token"),
    )
    return (
        f"evaluate: tau_real {_fmt(result['tau_real'])}"
        + (f" (95 % CI {ci[0]:.3f}-{ci[1]:.3f} over the {result['prompts']} prompts, bootstrap)" if ci else "")
        + f" tokens per drafting round, the prefill's token not counted (K={result['k']}, {result['prompts']} "
        f"prompts, {result['tokens']} tokens, {result['drafting_rounds']} rounds); acceptance per position "
        f"{result['acceptance_per_position']}; speedup {result['speedup']:.2f}x on this machine (full-recompute "
        f"target forward); output equals greedy: {result['exact']}"
        + (f"; simulated tau {simulated:.3f}" if simulated is not None else "")
        + (f"; predicted tau {predicted:.3f}" if predicted is not None else "")
        + (f"; most-frequent-token drafter: tau {_fmt(frequent)}" if "tau_frequent_token" in result else "")
    )


def check_target(target_dir) -> None:
    """ConfigError unless `target_dir` is a local model folder (its config.json), before anything is loaded."""
    if not (Path(target_dir) / "config.json").is_file():
        raise ConfigError(
            f"evaluate: {target_dir} is not a model folder (no config.json); give the target's local folder"
        )


def evaluate_vllm(
    target_dir,
    drafter_path,
    data,
    *,
    k: int = 3,
    max_new: int = 64,
    prompts: int = 16,
    max_prompt: int = 512,
    checkpoint: str = "best",
    engine_args: dict | None = None,
    engines=None,
    log=print,
) -> dict:
    """`--engine vllm`: the same prompts decoded by vLLM with the drafter and without (eagle3/engine_vllm.py).
    `engines` (with, without), started by the caller on this drafter's export and left running, replace the two
    it would start; `drafter_path` then gives the run's step and simulated figure only."""
    from eagle3.engine_vllm import log_line, measure
    from eagle3.samples import read_records
    from eagle3.tokenizer import load_tokenizer

    if k < 1 or max_new < 1 or prompts < 1:
        raise ConfigError("evaluate: --k, --max-new and --prompts must be at least 1")
    check_target(target_dir)
    tokenizer = load_tokenizer(target_dir, "evaluate")
    drafter, run_cfg = load_drafter(drafter_path, checkpoint)  # verified before vLLM reads a byte of it
    prompt_ids = prompts_from(read_records(Path(data)), tokenizer, prompts, max_prompt)
    if not prompt_ids:
        raise ConfigError(f"{data} holds no samples to take prompts from")
    result = measure(
        target_dir,
        drafter,
        run_cfg,
        Path(drafter_path),
        prompt_ids,
        tokenizer.eos_token_id,
        k=k,
        max_new=max_new,
        engine_args=engine_args,
        engines=engines,
    )
    if run_cfg is not None:
        result["step"] = run_cfg.evaluated_step
        result["tau_simulated"] = simulated_tau(Path(run_cfg.run_dir), result["step"])
        result["tau_predicted"] = simulated_tau(Path(run_cfg.run_dir), result["step"], "tau_predicted")
    log(log_line(result), flush=True)
    return result


def main(argv: list[str]) -> int:
    from eagle3.helptext import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="python -m eagle3 evaluate", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    ap.add_argument("drafter", help="a run folder (its best checkpoint) or an export folder")
    ap.add_argument("--target", required=True, help="the target model's folder (local only)")
    ap.add_argument("--data", required=True, help="held-out samples (the generate formats): prompts")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--max-new", type=int, default=64, help="tokens to generate per prompt")
    ap.add_argument("--prompts", type=int, default=16, help="prompts to use (the first N samples)")
    ap.add_argument("--checkpoint", default="best", help="of a run folder: best, latest or a checkpoint folder")
    ap.add_argument("--json", default="", help="also write the result here (a run folder appends to evaluate.jsonl)")
    ap.add_argument(
        "--engine",
        choices=("eagle3", "vllm"),
        default="eagle3",
        help="eagle3: the project's exact decoder (the reference); vllm: vLLM with and without the drafter, "
        "tokens/s with its KV cache (eagle3/engine_vllm.py)",
    )
    ap.add_argument(
        "--vllm-args",
        default="{}",
        metavar="JSON",
        help="with --engine vllm: more LLM(...) arguments, e.g. '{\"tensor_parallel_size\": 8}'",
    )
    args = ap.parse_args(argv)
    options = dict(k=args.k, max_new=args.max_new, prompts=args.prompts, checkpoint=args.checkpoint)
    if args.engine == "vllm":
        from eagle3.engine_vllm import parse_engine_args

        engine_args = parse_engine_args(args.vllm_args)
        result = evaluate_vllm(args.target, args.drafter, args.data, engine_args=engine_args, **options)
    else:
        result = evaluate(args.target, args.drafter, args.data, **options)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if "step" in result:
        record_evaluation(Path(args.drafter), result)
    return 0 if result["exact"] else 1


def record_evaluation(run_dir: Path, result: dict) -> None:
    """One line in RUN/evaluate.jsonl per evaluation of one of the run's checkpoints: `eagle3 report` plots its
    tau_real beside the validation's simulated acceptance length."""
    with (run_dir / EVALUATE_FILE).open("a") as f:
        f.write(json.dumps({"time": time.time(), **result}) + "\n")
