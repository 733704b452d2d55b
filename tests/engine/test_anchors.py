"""Anchor plan: default anchors, aggregation types per depth, producers, pruning, validation."""
from __future__ import annotations

import itertools
import json

import pytest

from spd_engine.engine.protocol.anchors import AnchorPlan, default_anchors, prune_anchors
from spd_engine.engine.protocol.topology import default_stage_layers, stage_bounds

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def brute_type(plan: AnchorPlan, depth: int) -> int:
    """A(d) by definition: the largest a with b_a <= B_d."""
    return max(a for a, b in enumerate(plan.anchors) if b <= plan.bounds[depth])


def brute_producer(bounds, anchor: int) -> int | None:
    """The stage holding layer anchor-1, by scanning the stages."""
    if anchor == 0:
        return None
    return next(p for p in range(len(bounds) - 1) if bounds[p] <= anchor - 1 < bounds[p + 1])


def compositions(total: int, parts: int):
    """All splits of `total` layers into `parts` stages of >= 1 layer."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [b - a for a, b in zip(edges, edges[1:])]


def test_smollm2_split_8_8_7_7():
    plan = AnchorPlan.build(stage_bounds([8, 8, 7, 7]))
    assert plan.bounds == (0, 8, 16, 23, 30)
    assert plan.anchors == (0, 8, 23, 29)
    assert [plan.type_at_depth(d) for d in range(5)] == [0, 1, 1, 2, 3]
    assert plan.num_types == 4
    assert [plan.producer_stage(a) for a in range(4)] == [None, 0, 2, 3]  # layers -, 7, 22, 28
    assert [plan.anchors_of_stage(p) for p in range(4)] == [(1,), (), (2,), (3,)]
    assert [plan.anchor_layer(a) for a in range(4)] == [None, 7, 22, 28]


def test_two_stages_uneven():
    plan = AnchorPlan.build(stage_bounds([10, 20]))  # B = 0, 10, 30
    assert plan.anchors == (0, 10, 29)
    assert plan.depth_types == (0, 1, 2)
    assert [plan.anchors_of_stage(p) for p in range(2)] == [(1,), (2,)]


def test_eight_stages_uneven():
    counts = [3, 5, 2, 4, 4, 3, 6, 3]
    bounds = stage_bounds(counts)  # 0, 3, 8, 10, 14, 18, 21, 27, 30
    plan = AnchorPlan.build(bounds)
    assert plan.anchors == (0, 3, 10, 21, 29)  # B_1, B_3, B_6, L-1
    assert plan.depth_types == (0, 1, 1, 2, 2, 2, 3, 3, 4)
    assert [plan.producer_stage(a) for a in range(5)] == [None, 0, 2, 5, 7]


def test_one_stage():
    plan = AnchorPlan.build([0, 30])
    assert plan.anchors == (0, 29)  # B_1 = L is not an index < n
    assert plan.depth_types == (0, 1)
    assert plan.producer_stage(1) == 0
    assert plan.anchors_of_stage(0) == (1,)


def test_explicit_anchor_dropped():
    bounds = [0, 8, 16]
    # 3 and 5 both lie inside stage 0: depth 1 already sees 8, so types 1 and 2 are never used
    kept, dropped = prune_anchors(bounds, [0, 3, 5, 8, 12])
    assert kept == (0, 8, 12) and dropped == (3, 5)
    plan = AnchorPlan.build(bounds, [0, 3, 5, 8, 12])
    assert plan.anchors == (0, 8, 12)
    assert plan.depth_types == (0, 1, 2)
    with pytest.raises(ValueError, match="never selected"):
        AnchorPlan(tuple(bounds), (0, 3, 5, 8, 12))


def test_explicit_anchor_kept_when_selected():
    plan = AnchorPlan.build([0, 8, 16], [0, 5, 15])
    assert plan.anchors == (0, 5, 15)
    assert plan.depth_types == (0, 1, 2)
    assert plan.producer_stage(1) == 0 and plan.producer_stage(2) == 1


@pytest.mark.parametrize("bad, message", [
    ([], "start with 0"),
    ([1, 8], "start with 0"),
    ([0, 8, 8], "sorted and unique"),
    ([0, 12, 8], "sorted and unique"),
    ([0, 16], "L-1"),
    ([0, 2.5], "integers"),
])
def test_explicit_anchors_validated(bad, message):
    with pytest.raises(ValueError, match=message):
        AnchorPlan.build([0, 8, 16], bad)


@pytest.mark.parametrize("bounds", [[], [0], [1, 8], [0, 8, 8], [0, 9, 4]])
def test_bounds_validated(bounds):
    with pytest.raises(ValueError, match="stage bounds"):
        AnchorPlan.build(bounds)


def test_type_at_depth_range_checked():
    plan = AnchorPlan.build(stage_bounds([8, 8, 7, 7]))
    for depth in (-1, 5):
        with pytest.raises(ValueError, match="depth"):
            plan.type_at_depth(depth)
    with pytest.raises(ValueError, match="stage"):
        plan.anchors_of_stage(4)


@pytest.mark.parametrize("num_layers", [9, 12])
def test_properties_over_every_split(num_layers):
    """For every split into 1..8 stages: definitions hold, and the default anchors need no pruning."""
    for n in range(1, 9):
        for counts in compositions(num_layers, n):
            bounds = stage_bounds(counts)
            plan = AnchorPlan.build(bounds)
            assert plan.anchors == default_anchors(bounds)  # the default never selects a dead type
            types = plan.depth_types
            assert types == tuple(brute_type(plan, d) for d in range(n + 1))
            assert types[0] == 0 and types[-1] == plan.num_types - 1
            assert set(types) == set(range(plan.num_types))
            assert list(types) == sorted(types)  # deeper tokens never use a shallower type
            produced = [a for p in range(n) for a in plan.anchors_of_stage(p)]
            assert produced == list(range(1, plan.num_types))  # each anchor > 0 from exactly one stage
            for a in range(plan.num_types):
                assert plan.producer_stage(a) == brute_producer(bounds, plan.anchors[a])
            for d in range(n + 1):
                # a row at depth d only reads anchors from stages 0..d-1
                assert all(plan.producer_stage(a) is None or plan.producer_stage(a) < d
                           for a in range(types[d] + 1))


def test_dict_round_trip_through_json():
    plan = AnchorPlan.build(stage_bounds(default_stage_layers(30, 8)))
    again = AnchorPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    with pytest.raises(ValueError, match="keys"):
        AnchorPlan.from_dict({"anchors": [0, 29]})
    with pytest.raises(ValueError, match="never selected"):
        AnchorPlan.from_dict({"stage_bounds": [0, 8, 16], "anchors": [0, 3, 5, 8]})
