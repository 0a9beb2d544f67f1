"""The statistics of one TTT row, beside its loss (eagle3.model.ttt_forward returns both): sums and counts per TTT
step, summed over rows and ranks in one collective and turned into rates by eagle3.metrics.summarize."""

from __future__ import annotations

import torch

from eagle3.errors import ConfigError
from eagle3.loss import _joined

STAT_KEYS = (
    "loss_sum",
    "full_acc_sum",
    "cond_acc_sum",
    "cond_acc_count",
    "full_acc_true_sum",
    "cond_acc_true_sum",
    "cond_acc_true_count",
    "count",
    "alpha_sum",
    # validation only, in step 0's column: the rounds a greedy decoder would run over the row (eagle3.acceptance
    # .round_walk) and the tokens they yield
    "round_tokens_sum",
    "rounds_sum",
)


def true_target_ids(model, batch: dict, true: list, restricted_ids: torch.Tensor) -> torch.Tensor:
    """The target's argmax over its whole vocabulary per slot (the true-target accuracy): from the chunks, or the
    batch's `target_ids`; an error when neither can give it."""
    if true and true[0] is not None:
        true_ids = torch.cat(true)
    else:  # an empty row has no chunk: no ids, but the head decides whether there would be
        true_ids = restricted_ids if not true and getattr(model, "_full_head", False) else None
    if "target_ids" in batch:
        true_ids = batch["target_ids"].long()
    if true_ids is None:
        raise ConfigError(
            "true-target accuracy needs the target head rows outside the draft vocab: call "
            "load_target_weights(..., keep_full_head=True) or put `target_ids` (target argmax per slot) in the batch"
        )
    return true_ids


def step_statistics(
    model, loss, kls, ids, sup, restricted_ids, true_ids, last_hidden, alphas, walk: int = -1
) -> torch.Tensor:
    """[len(STAT_KEYS), ttt_steps] float64 sums and counts on the CPU: the loss, the accuracies within the draft
    vocabulary and against the true target (a slot counts at step k when it and every step before were right), and
    the expected acceptance alpha (eagle3.loss); with `walk` >= 0 the rounds a greedy decoder would run over the
    row, writing at most `walk` tokens per response (0: whole responses; eagle3.acceptance.round_walk)."""
    device, seq_len, ttt_steps = last_hidden.device, last_hidden.shape[0], len(sup)
    stats = torch.zeros(len(STAT_KEYS), ttt_steps, dtype=torch.float64, device=device)
    all_right = torch.ones(seq_len, dtype=torch.bool, device=device)  # every step so far correct
    all_right_true = all_right.clone()
    accepted = all_right.clone()  # every step so far right against the target and supervised: a decoder accepts it
    chain = torch.zeros(seq_len, dtype=torch.long, device=device)  # drafts accepted at each slot
    zero = torch.zeros((), dtype=torch.float64, device=device)
    for step in range(ttt_steps):
        supervised, count = sup[step]
        n = supervised.shape[0]
        _, kl, draft_ids = _joined(loss, kls[step], ids[step], last_hidden)
        alpha = torch.cat(alphas[step]) if alphas[step] else torch.zeros_like(kl)  # a row without positions
        target_slot = torch.arange(n, device=device) + 1 + step
        right = draft_ids == restricted_ids[target_slot]  # [n]
        right_true = (draft_ids + model.d2t[draft_ids]) == true_ids[target_slot]  # [n]
        before, before_true = all_right[:n].clone(), all_right_true[:n].clone()
        all_right[:n] &= right
        all_right_true[:n] &= right_true
        accepted[:n] &= right_true & supervised
        accepted[n:] = False
        chain += accepted
        s = supervised
        stats[:, step] = torch.stack(
            [
                (kl * s).sum().double(),
                (all_right[:n] & s).sum().double(),
                (all_right[:n] & s).sum().double(),
                (before & s).sum().double(),
                (all_right_true[:n] & s).sum().double(),
                (all_right_true[:n] & s).sum().double(),
                (before_true & s).sum().double(),
                count.double(),
                (alpha * s).sum().double(),
                zero,
                zero,
            ]
        )
    stats = stats.cpu()  # one transfer for all statistics
    if walk >= 0 and sup:
        from eagle3.acceptance import round_walk

        step0 = sup[0][0]
        tokens, rounds = round_walk(chain[: step0.shape[0]].tolist(), step0.tolist(), max_new=walk)
        stats[STAT_KEYS.index("round_tokens_sum"), 0] = tokens
        stats[STAT_KEYS.index("rounds_sum"), 0] = rounds
    return stats
