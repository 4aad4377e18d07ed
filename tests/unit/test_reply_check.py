"""Draft replies are checked before verification: each repair is the lossless one (table-driven)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.messages import DraftBlock
from specserve.reply_check import check_block, probs_problem

V = 8


def q(rows: list[int], width: int = V) -> np.ndarray:
    """Valid rows: mass 0.6 on each drafted token, the rest spread evenly."""
    out = np.full((len(rows), width), 0.4 / (width - 1), dtype=np.float32)
    out[np.arange(len(rows)), rows] = 0.6
    return out


def block(tokens, probs=None, base_len=10):
    return DraftBlock("r", base_len, tokens, probs)


@pytest.mark.parametrize("sent, asked, expect_tokens, expect_probs, why", [
    (block([1, 2, 3]), 3, [1, 2, 3], False, None),  # fine, point masses
    (block([1, 2, 3], q([1, 2, 3])), 3, [1, 2, 3], True, None),  # fine, with q
    (block([1, 2, 3, 4, 5]), 3, [1, 2, 3], False, "5 draft tokens where 3 were asked"),
    (block([1, 2, 3, 4], q([1, 2, 3, 4])), 2, [1, 2], True, "4 draft tokens"),  # a fixed-length cut keeps q
    (block([1, 10**9, 3]), 3, [1], False, "outside the target's vocabulary"),
    (block([-5, 1]), 3, [], False, "token id -5"),
    (block([1, True]), 3, [1], False, "token id True"),  # a bool is not a token id
    (block([1, 9, 2], q([1, 7, 2], width=16)), 3, [1], False, "outside"),  # a cut that depends on the draws: point masses
    (block([1, 2], q([1, 2]) * np.float32("nan")), 2, [1, 2], False, "not finite"),
    (block([1, 2], -q([1, 2])), 2, [1, 2], False, "negative"),
    (block([1, 2], q([1, 2]) * 2), 2, [1, 2], False, "do not sum to one"),
    (block([1, 2], q([3, 2])), 2, [1, 2], True, None),  # q need not peak at the token, only be positive there
    (block([1, 2], np.eye(V, dtype=np.float32)[[3, 2]]), 2, [1, 2], False, "zero probability at a drafted token"),
    (block([1, 2], q([1, 2, 3])), 2, [1, 2], False, "shape"),
    (block([1, 2], q([1, 2], width=V + 4)), 2, [1, 2], True, None),  # a wider draft head with no mass needed there
])
def test_check_block(sent, asked, expect_tokens, expect_probs, why):
    checked, reason = check_block(sent, asked, 10, V)
    assert checked is not None and checked.draft_token_ids == expect_tokens
    assert (checked.draft_probs is not None) is expect_probs
    if expect_probs:
        assert checked.draft_probs.shape[0] == len(expect_tokens)
    assert (reason is None) if why is None else (why in reason)


def test_a_block_for_another_length_is_dropped():
    checked, reason = check_block(block([1, 2], base_len=9), 2, 10, V)
    assert checked is None and "continuing 9 tokens of a sequence that has 10" in reason
    assert check_block(block([1]), 2, None, V)[0] is None  # a sequence this target does not know


def test_probability_rows_from_a_tensor_link_are_checked_too():
    good = torch.as_tensor(q([1, 2]))
    assert probs_problem(good, [1, 2]) is None
    assert "not finite" in probs_problem(good * float("inf"), [1, 2])
