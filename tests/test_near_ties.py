"""The near-tie helpers the portability-aware tests rely on (tests/near_ties.py) can fail."""
from __future__ import annotations

import pytest
import torch
from near_ties import assert_greedy_agrees, first_difference

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def test_first_difference_sees_tokens_and_lengths():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one output stopped early


def test_a_real_divergence_is_not_a_near_tie():
    logits = torch.tensor([0.0, 5.0, 4.99999])  # tokens 1 and 2 tie; token 0 is far off
    assert assert_greedy_agrees([1, 2], [1, 1], lambda k: logits, 1e-4) == 1
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_agrees([1, 0], [1, 1], lambda k: logits, 1e-4)
    with pytest.raises(AssertionError, match="stops"):
        assert_greedy_agrees([1], [1, 1], lambda k: logits, 1e-4)
