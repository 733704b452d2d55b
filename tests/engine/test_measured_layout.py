"""Measured weight layouts (engine/runtime/measured_layout.py): the fastest one-row step picks the
layout, a tie goes to the cheaper several-row step, mixed's times follow from col's and packed's,
the store keeps one record per model and device, and a run's `auto` takes it only on a CPU, only
for its own thread count, never over a layout given by hand."""
from __future__ import annotations

import json

import pytest

from spd_engine.engine.model.linear import resolve_layout
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.measured_layout import LayoutKey, LayoutStore, choose_layout, with_mixed
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime

pytestmark = pytest.mark.pure

# one stage step of 15 SmolLM2 layers, one thread (docs/design.md 3.14)
AMD_1T = {("row", 1): 21.2, ("row", 4): 28.7, ("col", 1): 17.8, ("col", 4): 32.3, ("packed", 1): 18.7, ("packed", 4): 18.8}
INTEL_1T = {("row", 1): 24.6, ("row", 4): 38.2, ("col", 1): 23.4, ("col", 4): 31.9, ("packed", 1): 32.2, ("packed", 4): 33.1}
KEY = LayoutKey("smollm2-135m-a4f8", "Intel(R) Xeon(R) Processor, 2 cores, 2 thread(s)")


def test_mixed_runs_col_for_one_row_and_packed_for_more():
    got = with_mixed(AMD_1T)
    assert got[("mixed", 1)] == 17.8 and got[("mixed", 4)] == 18.8
    assert ("mixed", 1) not in with_mixed({("row", 1): 1.0, ("col", 1): 2.0})  # no packed timed: no mixed


def test_the_fastest_one_row_step_wins_and_ties_go_to_the_cheaper_several_row_step():
    assert choose_layout(AMD_1T) == "mixed"  # col's one row (mixed's) with packed's four rows
    assert choose_layout(INTEL_1T) == "col"  # packed's one-row step is the slowest there
    assert choose_layout({("row", 1): 10.0, ("row", 4): 30.0, ("col", 1): 12.0, ("col", 4): 13.0}) == "row"
    assert choose_layout({("row", 1): 10.0, ("row", 4): 30.0, ("col", 1): 10.2, ("col", 4): 13.0}) == "col"
    with pytest.raises(ValueError, match="one-row step for every layout"):
        choose_layout({("row", 4): 1.0})


def test_the_store_keeps_one_record_per_key_and_names_a_malformed_one(tmp_path):
    store = LayoutStore(tmp_path / "sub" / "layouts.json")
    assert store.lookup(KEY) is None
    assert store.record(KEY, INTEL_1T) == "col" and store.lookup(KEY) == "col"
    assert store.lookup(LayoutKey(KEY.model, "AMD EPYC, 2 cores, 2 thread(s)")) is None
    store.record(KEY, AMD_1T)  # a newer measurement replaces it
    doc = json.loads(store.path.read_text())
    assert store.lookup(KEY) == "mixed" and len(doc["layouts"]) == 1
    assert doc["layouts"][KEY.text()]["ms"]["packed x4"] == 18.8 and doc["layouts"][KEY.text()]["date"]
    doc["layouts"][KEY.text()]["layout"] = "diagonal"
    store.path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="malformed"):
        store.lookup(KEY)


def test_auto_takes_the_record_for_its_own_threads_on_a_cpu_only():
    assert resolve_layout("auto", "cuda:0", measured="col") == "row"
    cfg = PRESETS["tiny-llama"]
    base = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 1), threads=2), mode="ar",
                     runtime=Runtime(capacity=64))
    rule = base.resolved_weight_layout
    measured = base.replace(measured_layouts=((1, "row"), (2, "col" if rule != "col" else "row")))
    assert measured.resolved_weight_layout == dict(measured.model.measured_layouts)[2] != rule
    assert measured.replace(threads=3).resolved_weight_layout == base.replace(threads=3).resolved_weight_layout
    assert measured.replace(weight_layout="packed").resolved_weight_layout == "packed"  # given by hand: kept
    with pytest.raises(ValueError, match="measured layout"):
        base.replace(measured_layouts=((2, "diagonal"),))
    with pytest.raises(ValueError, match="measured layout"):
        base.replace(measured_layouts=((0, "col"),))
