"""An emulated link latency (--link-delay-us) is named in every report that used it and refused
outside [0, 1e6): spd netbench's text report and config, RunConfig's check."""
from __future__ import annotations

import argparse

import pytest

from spd_engine.bench.plot import format_report
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime
from spd_engine.tools import netbench

pytestmark = pytest.mark.pure


def _report(delay_us: float) -> dict:
    return {"backend": "gloo", "world_size": 2, "ranks": [{"node_rank": 0}, {"node_rank": 1}], "p2p": [],
            "fanin": [], "transport": [], "link_delay_us": delay_us}


def test_netbench_names_the_emulated_latency_only_when_one_was_asked():
    assert "EMULATED LINK LATENCY: 250 us" in format_report(_report(250.0))
    assert "EMULATED" not in format_report(_report(0.0))


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    netbench.add_arguments(p)
    return p.parse_args(list(extra))


def test_netbench_carries_the_delay_and_refuses_a_negative_one():
    assert netbench.build_config(_args("--link-delay-us", "40"), 2).link_delay_us == 40.0
    assert netbench.build_config(_args(), 2).link_delay_us == 0.0
    with pytest.raises(ValueError, match="--link-delay-us"):
        netbench.build_config(_args("--link-delay-us", "-1"), 2)


def test_run_config_refuses_a_delay_outside_its_range():
    cfg = PRESETS["tiny-llama"]
    topo = Topology.build(cfg.num_layers, 2)
    ok = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                   parallel=ParallelLayout(topology=topo, link_delay_us=50.0), runtime=Runtime(capacity=256))
    assert ok.parallel.link_delay_us == 50.0
    for bad in (-1.0, float("nan"), 1e6):
        with pytest.raises(ValueError, match="--link-delay-us"):
            RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                      parallel=ParallelLayout(topology=topo, link_delay_us=bad), runtime=Runtime(capacity=256))
