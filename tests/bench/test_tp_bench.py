"""The tensor-parallel measurements behind docs/results/tp-cpu.md: TP split vs unsharded greedy on the
eval prompts, TP shard step times with all shards stepping at once, and the two ways of crossing
a stage boundary; on a tiny random model (structure, not speed)."""
from __future__ import annotations

import dataclasses

import pytest

from spd_engine.bench.tp_shard_time import shard_layer_ms
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime
from spd_engine.tools.experiments.tp_agreement import main as agreement_main
from spd_engine.tools.experiments.tp_crossing import CrossingConfig, measure_crossing


def test_tp_agreement_reports_every_set(capsys):
    assert agreement_main(["--model", "random:tiny-llama", "--tp", "2", "--limit", "1", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    for name in ("mt_bench", "humaneval", "gsm8k"):
        assert f"{name}: " in out and "of 1 outputs part" in out
    assert "overall: " in out and "of 3 outputs part, tp=2" in out
    assert agreement_main(["--model", "random:smollm2-135m", "--tp", "2"]) == 2  # 3 KV heads


@pytest.mark.multiproc
def test_tp_shard_time_and_crossing_measure_something():
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 1), threads=1),
                     runtime=Runtime(capacity=128))
    assert 0 < shard_layer_ms(ecfg, 2, steps=4, warmup=1) < 1e3
    assert 0 < shard_layer_ms(ecfg, 2, steps=4, warmup=1, lockstep=True) < 1e3  # real all-reduces, left out
    got = measure_crossing(dataclasses.replace(CrossingConfig(tp=2, hidden=64), iters=5, warmup=1))
    assert set(got) == {"peer", "broadcast"} and all(0 < v < 1e6 for v in got.values())
