"""Engine checkpoints of any TP split (`spd convert hf2mcore --tp`) load into any runtime TP split
the heads allow: each TP rank gets exactly its shard of every tensor, and the runs decode as
greedy decoding of the same weights with that split."""
from __future__ import annotations

import pytest
import torch
from tp_cases import tp_cfg, tp_reference

from spd_engine.checkpoint_tools.shard import write_engine
from spd_engine.engine.comm.tp_group import LocalTPHub
from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.model.tp_shard import shard_tensor
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_tp_stage_model
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime


@pytest.mark.parametrize("ckpt_tp", [1, 2])
def test_a_checkpoint_of_any_tp_split_runs_at_any_runtime_split(tmp_path, ckpt_tp, one_thread):
    cfg = tp_cfg(2)
    state = dict(init_random_(StageModel.full(cfg), seed=5).state_dict())
    write_engine(tmp_path / "ckpt", cfg, state, pp=2, tp=ckpt_tp)
    prompt = [7, 3, 11, 5, 9, 2, 40, 41]

    def run_config(tp: int) -> RunConfig:
        return RunConfig(model=ModelSpec(source=str(tmp_path / "ckpt"), cfg=cfg),
                         parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 1, colocate=True, tp=tp), threads=1),
                         mode="tp" if tp > 1 else "ar", runtime=Runtime(capacity=64, prefill_chunk=16))

    hub = LocalTPHub(range(2), 10.0)
    for r in range(2):  # each TP rank holds exactly its pieces, whatever split the files have
        shard = build_tp_stage_model(run_config(2), range(cfg.num_layers), True, True, hub.group(r))
        for name, p in shard.state_dict().items():
            assert torch.equal(p, shard_tensor(name, state[name], cfg, 2)[r]), name
    full = StageModel.full(cfg)
    full.load_state_dict(state)
    with ReferenceExecutor(run_config(1)) as ex:
        assert ex.generate(prompt, 12).tokens == greedy_generate(full.eval(), prompt, 12, chunk=16)
    with ReferenceExecutor(run_config(2)) as ex:
        assert ex.generate(prompt, 12).tokens == tp_reference(run_config(2), prompt, 12)
