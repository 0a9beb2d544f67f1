"""Simulated acceptance length: the tokens one draft-and-verify round of chain drafting is expected to yield.

Chain drafting proposes K tokens d_0 .. d_{K-1}, one per TTT step; the verifier (greedy) keeps the longest
prefix that matches its own argmax and then adds one token of its own (the correction at the first mismatch,
or the bonus token after the last draft). With c_j the conditional accuracy of TTT step j (`cond_acc_j`: the
draft argmax at step j is right, among positions whose steps 0..j-1 were all right), the probability that the
first k+1 drafted tokens are all accepted is

    p_k = c_0 * c_1 * ... * c_k

and the expected number of tokens per round, counting the verifier's own token, is

    tau = 1 + p_0 + p_1 + ... + p_{K-1}

so a drafter that is never right gives 1.0 and a perfect one K + 1. This is the "average acceptance length"
the EAGLE papers report (tokens per verifier forward), and Leviathan et al. (2023) "Fast Inference from
Transformers via Speculative Decoding" eq. (1) with per-position rather than one shared acceptance rate.

It is an estimate: TTT feeds the teacher-forced data token to step k, which is the token an accepted draft
would have produced only where the data is the target's own greedy output (regenerated data); elsewhere it
is the step's accuracy given the data's prefix. The `*_true` accuracies (against the target's argmax over its
whole vocabulary, a token outside the draft vocab being a miss) are what a server sees; the draft-vocab ones
(speculators' definition) give an upper bound.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def acceptance_length(cond_acc: Sequence[float | None], depth: int | None = None) -> float | None:
    """Expected tokens per round of chain drafting, 1 + sum_k prod_{j<=k} cond_acc[j], over `depth` steps
    (all of them when None).

    A step without any supervised position (None: its conditional accuracy is unknown) ends the sum there: the
    result then counts only the steps that were measured, a lower bound. A step whose predecessors were never
    all right is None too, but the product is already 0 there, so nothing is lost. None when step 0 itself has
    no measurement.

    Worked example, by hand: conditional accuracies 0.8, 0.5, 0.25 give p = 0.8, 0.8*0.5 = 0.4,
    0.4*0.25 = 0.1, so tau = 1 + 0.8 + 0.4 + 0.1 = 2.3; drafting only 2 tokens gives 1 + 0.8 + 0.4 = 2.2.

    >>> acceptance_length([0.8, 0.5, 0.25])
    2.3
    >>> acceptance_length([0.8, 0.5, 0.25], depth=2)
    2.2
    >>> acceptance_length([0.0, None, None]), acceptance_length([1.0, 1.0]), acceptance_length([None])
    (1.0, 3.0, None)
    """
    values = list(cond_acc if depth is None else cond_acc[:depth])
    if not values or values[0] is None:
        return None
    tau, prefix = 1.0, 1.0
    for c in values:
        if c is None or prefix == 0.0:
            break
        prefix *= c
        tau += prefix
    return round(tau, 12)  # 2.3, not 2.3000000000000003: the records are read by people


def round_walk(chain: Sequence[int], supervised: Sequence[bool], max_new: int = 0) -> tuple[int, int]:
    """(round tokens, rounds) of greedy chain drafting replayed over one row, round by round from the frontier
    as a decoder meets it: the prediction the validation makes of tau_real.

    In the trainer's alignment (eagle3.model) slot j's step 0 reads token j+1 and drafts token j+2.
    `supervised[j]`: that draft is supervised (loss_mask[j+1], the same document), so a run of True starting at j0
    is a response whose first token, j0+1, the decoder's prefill wrote (not counted, as in tau_real). `chain[j]`:
    how many drafts made at slot j the verifier accepts (the leading TTT steps whose draft is the target's greedy
    token). The first round is at j0; a round at slot j yields chain[j] + 1 tokens (the accepted drafts and the
    target's own), clipped at the response's end, and the next round is chain[j] + 1 slots on. Only the slots a
    decoder reaches count: the stationary estimate (acceptance_length) counts every slot, where a round that
    starts after a rejection is harder than the average. Exact where the responses are the target's own greedy
    tokens; on other data the replay follows the data's tokens. `max_new` (0: all): each response ends after that
    many tokens, the prefill's included, as a decoder writing `max_new` tokens per prompt stops.

    >>> # a response after slot 1: rounds at slots 1 (two drafts accepted: three tokens), 4 and 5
    >>> round_walk([0, 2, 0, 1, 0, 0, 0], [False, True, True, True, True, True, False])
    (5, 3)
    >>> round_walk([0, 2, 0, 1, 0, 0, 0], [False, True, True, True, True, True, False], max_new=3)
    (2, 1)
    >>> round_walk([5, 5, 5], [True, True, True]), round_walk([0, 0], [False, False])
    ((3, 1), (0, 0))
    """
    n = len(supervised)
    remaining = [0] * (n + 1)  # supervised slots from j on, within the run
    for j in range(n - 1, -1, -1):
        remaining[j] = remaining[j + 1] + 1 if supervised[j] else 0
    tokens = rounds = 0
    j = 0
    while j < n:
        if not supervised[j]:
            j += 1
            continue
        end = j + remaining[j]
        stop = min(end, j + max_new - 1) if max_new > 0 else end
        while j < stop:
            step = min(int(chain[j]) + 1, stop - j)
            tokens, rounds, j = tokens + step, rounds + 1, j + step
        j = end
    return tokens, rounds


# ------------------------------------------------------------------------------------------------ measured
# What `eagle3 evaluate` measures by decoding (both engines), beside the simulated figure above.
# The confidence interval of tau_real: prompts resampled with replacement this many times, from this seed (the
# same prompts and drafter give the same interval).
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def tau_of(tokens: int, prefills: int, rounds: int) -> float | None:
    """tau_real's convention: the tokens of the drafting rounds per round; each prompt's prefill forward and the
    token it yields are not counted (vLLM's counters, speculators, SpecForge). None without a round.

    >>> tau_of(128, 4, 101), tau_of(1, 1, 0)
    (1.2277, None)
    """
    return round((tokens - prefills) / rounds, 4) if rounds else None


def bootstrap_ci(
    prompts: list[tuple[int, int]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> list[float] | None:
    """95 % percentile bootstrap interval of sum(round tokens) / sum(rounds) over prompts given as (round tokens,
    rounds): the prompts are resampled with replacement `resamples` times (random.Random(seed)), a resample
    without a round is skipped. None when no prompt has a round; one prompt gives its own tau twice.

    >>> prompts = [(30, 15), (45, 15), (60, 20), (20, 16), (70, 25), (33, 14)]  # tau_real 258 / 105 = 2.457
    >>> bootstrap_ci(prompts)
    [1.8922, 2.8772]
    >>> bootstrap_ci([(12, 6)]), bootstrap_ci([(0, 0)])
    ([2.0, 2.0], None)
    """
    if not any(rounds for _, rounds in prompts):
        return None
    rng, n, taus = random.Random(seed), len(prompts), []
    for _ in range(resamples):
        sample = rng.choices(prompts, k=n)
        rounds = sum(r for _, r in sample)
        if rounds:
            taus.append(sum(t for t, _ in sample) / rounds)
    taus.sort()

    def quantile(q: float) -> float:  # linear between the two nearest order statistics
        x = q * (len(taus) - 1)
        i = int(x)
        return taus[i] + (taus[min(i + 1, len(taus) - 1)] - taus[i]) * (x - i)

    return [round(quantile(0.025), 4), round(quantile(0.975), 4)]
