"""engine/protocol/topology.py: layer counts per stage, boundaries, and the rank of every stage (pure)."""
from __future__ import annotations

import pytest

from spd_engine.engine.protocol.topology import Topology, default_stage_layers, parse_stage_layers, stage_bounds

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


@pytest.mark.parametrize("layers,n,want", [(30, 4, [8, 8, 7, 7]), (6, 3, [2, 2, 2]), (7, 3, [3, 2, 2]),
                                           (5, 1, [5]), (4, 4, [1, 1, 1, 1]), (36, 8, [5, 5, 5, 5, 4, 4, 4, 4])])
def test_default_split_gives_the_first_stages_the_extra_layers(layers, n, want):
    assert default_stage_layers(layers, n) == want


def test_default_split_refuses_impossible_stage_counts():
    with pytest.raises(ValueError, match="must be >= 1"):
        default_stage_layers(6, 0)
    with pytest.raises(ValueError, match="7 stages is more than the model's 6 layers"):
        default_stage_layers(6, 7)


def test_parse_stage_layers():
    assert parse_stage_layers("8,8,7,7", 30) == [8, 8, 7, 7]
    assert parse_stage_layers(" 3, 3 ,", 6) == [3, 3]  # blanks and a trailing comma
    assert parse_stage_layers([1, 5], 6) == [1, 5]
    for spec, msg in (("3,x", "comma-separated integers"), ("", "empty"), ([], "empty"),
                      ("6,0", "at least one layer"), ("4,-1,3", "at least one layer"), ("3,2", "sum to 5")):
        with pytest.raises(ValueError, match=msg):
            parse_stage_layers(spec, 6)


def test_stage_bounds():
    assert stage_bounds([8, 8, 7, 7]) == [0, 8, 16, 23, 30]
    assert stage_bounds([6]) == [0, 6]


def test_build_from_n_or_an_explicit_split():
    assert Topology.build(30, 4).stage_layers == (8, 8, 7, 7)
    assert Topology.build(30).stage_layers == (30,)  # no n: one stage
    assert Topology.build(6, stage_layers="1,5").stage_layers == (1, 5)
    assert Topology.build(6, 2, stage_layers=[1, 5]).stage_layers == (1, 5)  # n agrees
    with pytest.raises(ValueError, match="--stages 3 disagrees with the 2 stage layer counts"):
        Topology.build(6, 3, stage_layers="1,5")
    for bad in ((), (3, 0)):
        with pytest.raises(ValueError, match="invalid stage layers"):
            Topology(bad)


def test_layers_of_every_stage_cover_the_model_once():
    topo = Topology.build(30, 4)
    assert (topo.n, topo.num_layers, topo.bounds) == (4, 30, [0, 8, 16, 23, 30])
    ranges = [topo.layers_of(p) for p in range(topo.n)]
    assert ranges == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [i for r in ranges for i in r] == list(range(30))


@pytest.mark.parametrize("colocate", [False, True])
def test_ranks_of_the_driver_and_the_stages(colocate):
    topo = Topology.build(6, 3, colocate=colocate)
    assert topo.driver_rank == 0
    assert topo.world_size == (3 if colocate else 4)
    ranks = [topo.stage_rank(p) for p in range(3)]
    assert ranks == ([0, 1, 2] if colocate else [1, 2, 3])  # co-located: stage 0 shares the driver's rank
    assert [topo.stage_of_rank(r) for r in ranks] == [0, 1, 2]
    assert topo.stage_of_rank(0) == (0 if colocate else None)  # a driver-only rank runs no stage
    assert topo.stage_of_rank(topo.world_size) is None and topo.stage_of_rank(-1) is None
    with pytest.raises(AssertionError):
        topo.stage_rank(3)
