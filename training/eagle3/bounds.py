"""The bounds of the trainer's config keys (eagle3.config declares which key has which), and the length rule.

A Bound is a check with the words a message and the README use for it. SEQ_MULTIPLE is the one statement of the
rule for max_seq_len: the trainer's config check, the planner's --lengths and the Ansible role's early check
(plugins/filter/role_inputs.py, through eagle3.config) all read it; tests/test_contracts.py fails on a restatement.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass

# flex_attention works on 128-token blocks; rows are padded to exactly max_seq_len.
SEQ_BLOCK = 128


@dataclass(frozen=True)
class Bound:
    """A value check, shown as `label` in --help and the README; `says` completes "<key>=<value> ..."."""

    label: str
    holds: Callable[[typing.Any], bool]
    says: str


REQUIRED = Bound("required", bool, "is empty")
AT_LEAST_1 = Bound(">= 1", lambda v: v >= 1, "must be at least 1")
NON_NEGATIVE = Bound(">= 0", lambda v: v >= 0, "must be 0 or more")
POSITIVE = Bound("> 0", lambda v: v > 0, "must be positive")
UNIT_INTERVAL = Bound("(0, 1]", lambda v: 0 < v <= 1, "must be in (0, 1]")
FRACTION = Bound("[0, 1)", lambda v: 0 <= v < 1, "must be in [0, 1)")
UNIT_CLOSED = Bound("[0, 1]", lambda v: 0 <= v <= 1, "must be in [0, 1]")
CHECKPOINT_MODE = Bound(
    "false, selective, full (true = full)",
    lambda v: v in (False, True, "selective", "full"),
    "is not one of false, selective, full (true means full)",
)
SEQ_MULTIPLE = Bound(
    f"multiple of {SEQ_BLOCK}",
    lambda v: v > 0 and v % SEQ_BLOCK == 0,
    f"is not a positive multiple of {SEQ_BLOCK} (the flex_attention block size)",
)


def seq_len_for(tokens: int) -> int:
    """The smallest valid max_seq_len that holds `tokens`.

    >>> seq_len_for(1), seq_len_for(128), seq_len_for(129)
    (128, 128, 256)
    """
    return max(-(-tokens // SEQ_BLOCK), 1) * SEQ_BLOCK


def suggest_seq_len(value: int) -> str:
    """Nearest valid lengths for a message.

    >>> suggest_seq_len(24000)
    'try 23936 or 24064'
    >>> suggest_seq_len(100)
    'try 128'
    """
    lower = (value // SEQ_BLOCK) * SEQ_BLOCK
    upper = lower + SEQ_BLOCK
    if lower <= 0:
        return f"try {upper}"
    return f"try {lower} or {upper}"
