"""Tensor parallelism on the real SmolLM2-135M-Instruct (T = 3, the split its 3 KV heads allow):
--mode tp and SPD x TP equal greedy decoding with the same split, each rank holding a third of
the weights, and the split parts from unsharded greedy decoding only at near-ties. Slow: the
T ranks of the real model on 2 cores."""
from __future__ import annotations

import pytest
import torch
from near_ties import assert_greedy_agrees, teacher_forced
from tp_cases import tp_reference

from spd_engine.engine.model.checkpoint import read_index
from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.tp_model import resident_bytes
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_stage_model
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime

pytestmark = pytest.mark.slow
NEW = 24


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.tools.model_args import resolve_model

    engine_dir, tok_dir = resolve_model("smollm2-135m")
    return engine_dir, read_index(engine_dir).cfg, Tokenizer.from_dir(tok_dir)


def run_config(smollm2, mode: str, n: int, colocate: bool) -> RunConfig:
    engine_dir, cfg, _ = smollm2
    return RunConfig(model=ModelSpec(source=engine_dir, cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n, colocate=colocate, tp=3), threads=1),
                     mode=mode, runtime=Runtime(capacity=256, prefill_chunk=16))


@pytest.mark.parametrize("mode,n,colocate", [("tp", 1, True), ("spd", 2, False)])
def test_smollm2_tp3_equals_greedy_with_the_same_split(smollm2, mode, n, colocate, one_thread):
    ecfg = run_config(smollm2, mode, n, colocate)
    prompt = smollm2[2].chat_ids("Explain how a bicycle works.")
    want = tp_reference(ecfg, prompt, NEW, smollm2[1].eos_token_ids)
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, smollm2[1].eos_token_ids)
    assert res.tokens == want
    whole = resident_bytes(build_stage_model(ecfg, ecfg.parallel.topology.layers_of(0), True, mode == "tp"))  # stage 0, unsharded
    assert abs(res.to_json()["stage_param_bytes"][0] / whole - 1 / 3) < 0.01
    full = build_stage_model(ecfg, range(30), True, True)
    torch.set_num_threads(1)
    unsharded = greedy_generate(full, prompt, NEW, smollm2[1].eos_token_ids, chunk=16)
    k = assert_greedy_agrees(res.tokens, unsharded, teacher_forced(full, prompt, unsharded), 2e-4, "tp=3")
    print(f"SmolLM2 {mode} tp=3: parts from unsharded greedy at {k}")
    if mode == "tp":
        with launch(ecfg) as runtime:  # processes: the same tokens
            assert runtime.generate(prompt, NEW, smollm2[1].eos_token_ids).tokens == want
