"""RunConfig's groups (engine/runtime/run_groups.py): each checks its own fields, RunConfig the checks
that need two, and `replace` routes a group's field by its own name."""
from __future__ import annotations

import dataclasses

import pytest

from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import (
    GROUP_OF,
    PRESETS,
    Drafting,
    ModelSpec,
    ParallelLayout,
    RunConfig,
    Runtime,
    run_fields,
)

pytestmark = pytest.mark.pure

CFG = PRESETS["tiny-llama"]


def _config(n: int = 2, **groups) -> RunConfig:
    groups.setdefault("runtime", Runtime(capacity=64))  # the tiny model's 512 positions, under the default 2048
    return RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=CFG),
                     parallel=ParallelLayout(topology=Topology.build(CFG.num_layers, n)), **groups)


def test_replace_routes_a_field_to_its_group_and_keeps_the_rest():
    base = _config()
    got = base.replace(suffix_run=4, prefill_chunk=16, threads=1)
    assert (got.drafting.suffix_run, got.runtime.prefill_chunk, got.parallel.threads) == (4, 16, 1)
    assert got.runtime.capacity == 64 and got.model == base.model
    whole = base.replace(drafting=Drafting(pdm_layers=2), suffix_min_match=3)  # a group and one of its fields
    assert (whole.drafting.pdm_layers, whole.drafting.suffix_min_match) == (2, 3)
    with pytest.raises(TypeError, match="no setting 'suffix_runs'"):
        base.replace(suffix_runs=4)


def test_a_baseline_copy_gets_one_chain_and_no_runs():
    got = _config(1).replace(mode="ar")
    assert (got.drafting.branches, got.max_run) == (1, 1)


def test_each_group_checks_its_own_fields():
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelSpec(source="random:tiny-llama", cfg=CFG, dtype="int4")
    with pytest.raises(ValueError, match="backend must be gloo or nccl"):
        ParallelLayout(topology=Topology.build(CFG.num_layers, 2), backend="mpi")
    with pytest.raises(ValueError, match="--suffix-run must be >= 1"):
        Drafting(suffix_run=0)
    with pytest.raises(ValueError, match="step mode must be one of"):
        Runtime(step_mode="jit")
    with pytest.raises(dataclasses.FrozenInstanceError):
        _config().drafting.pdm = "elsewhere"


def test_checks_across_groups_stay_on_run_config():
    with pytest.raises(ValueError, match="needs --mode spd"):
        _config(1, mode="ar", drafting=Drafting(branches=2))
    with pytest.raises(ValueError, match="KV capacity"):
        _config(runtime=Runtime(capacity=CFG.max_position + 1))
    with pytest.raises(ValueError, match="branch"):
        _config(drafting=Drafting(branch_when="sometimes"))  # checked once the width is resolved


def test_every_setting_has_one_dotted_name():
    fields = run_fields()
    assert len(GROUP_OF) == len(fields) - 1  # all but `mode`
    assert all(fields[f"{group}.{name}"].name == name for name, group in GROUP_OF.items())
