"""Branch width W in the exact T=0 replay (train/branch_replay.py, engine/protocol/branching.py)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.drafting import DraftChooser
from spd_engine.engine.protocol.suffix import SuffixSettings
from spd_engine.train.branch_replay import replay_branches
from spd_engine.train.fast_eval import DraftTable, replay_table

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def random_table(n: int, N: int, vocab: int, seed: int) -> tuple[DraftTable, list[int]]:
    """A draft table whose top-4 are random distinct ids (the reference among them or not)."""
    rng = random.Random(seed)
    y = [rng.randrange(vocab) for _ in range(N)]
    top = torch.tensor([[rng.sample(range(vocab), 4) for _ in range(N - 1)] for _ in range(n)])
    margins = torch.tensor([[rng.choice([0.5, 3.0]) for _ in range(N - 1)] for _ in range(n)])
    return DraftTable(top[:, :, 0].clone(), margins, top), y


CHOOSERS = {"pdm": DraftChooser(), "suffix": DraftChooser(SuffixSettings(16, 2), 2.0)}


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("chooser", list(CHOOSERS))
def test_width_one_is_todays_replay(n, chooser):
    for seed in range(6):
        table, y = random_table(n, 40, 6, seed)  # a small vocabulary: suffixes match, drafts hit
        want = replay_table(table, y, 3, n, CHOOSERS[chooser], prompt=[1, 2, 3]).acceptance
        for when in ("refill", "always"):
            got = replay_branches(table, y, 3, n, CHOOSERS[chooser], BranchPolicy(1, when), [1, 2, 3])
            assert got.acceptance == want and got.acceptance.by_source == want.by_source
            assert got.branch_points == 0 and got.tokens_per_step == 1.0


def test_a_branch_point_is_right_when_any_candidate_is():
    """n=2, the PDM's top-1 always wrong and its top-2 always right: W=1 rejects every draft
    (two ticks per token); W=2 at refill saves every branch point (worked in docs/design.md 3.11)."""
    N, n = 6, 2
    y = list(range(10, 10 + N))
    top = torch.tensor([[[99, y[t + 1], 98, 97] for t in range(N - 1)] for _ in range(n)])
    table = DraftTable(top[:, :, 0].clone(), torch.full((n, N - 1), math.inf), top)
    one = replay_branches(table, y, 0, n, DraftChooser(), BranchPolicy(1))
    two = replay_branches(table, y, 0, n, DraftChooser(), BranchPolicy(2, "refill"))
    assert one.acceptance.ticks == 10 and one.acceptance.accepted == 0
    assert two.acceptance.ticks == 8 and two.acceptance.accepted == 3 and two.branch_saves == 3
    assert two.tokens_per_step > 1.0
    assert two.acceptance.by_source == {"pdm": [5, 3]}


def test_wider_branches_never_lose_on_random_tables():
    """Summed over many requests, more candidates at the branch points accept more drafts."""
    for n in (2, 4):
        eal = {}
        for w in (1, 2, 4):
            runs = [replay_branches(*random_table(n, 60, 5, s), 0, n, DraftChooser(), BranchPolicy(w, "always"))
                    for s in range(20)]
            eal[w] = sum(r.acceptance.accepted for r in runs) / sum(r.acceptance.verified for r in runs)
        assert eal[1] < eal[2] < eal[4], eal


def test_candidates_and_policy_validation():
    p = BranchPolicy(3)
    assert p.candidates((5, "pdm"), [5, 7, 8, 9], 7) == [(5, "pdm"), (7, "suffix"), (8, "pdm")]
    assert p.candidates((4, "suffix"), [5, 4, 8], None) == [(4, "suffix"), (5, "pdm"), (8, "pdm")]
    assert p.branches(1, False) and not p.branches(2, False) and not p.branches(1, True)
    assert BranchPolicy(2, "always").branches(3, False) and not BranchPolicy(1, "always").branches(1, False)
    with pytest.raises(ValueError, match="--branches"):
        BranchPolicy(0)
    with pytest.raises(ValueError, match="branch policy"):
        BranchPolicy(2, "sometimes")
    table, y = random_table(2, 10, 6, 0)
    with pytest.raises(ValueError, match="ranks 4 PDM drafts"):
        replay_branches(table, y, 0, 2, DraftChooser(), BranchPolicy(5))
