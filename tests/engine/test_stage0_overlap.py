"""The co-located driver with stage 0 on its own thread (engine/runtime/stage0_overlap.py): the same tokens
and tick counts as the inline driver and the greedy decoder, in threads and processes, at T=0 and
T>0; an error of stage 0's step reaches the driver's thread."""
from __future__ import annotations

import pytest
import torch
from helpers import Policy, check_run, random_prompts, reference, summary, tiny_engine_config

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.stage0_overlap import Stage0Runner

NEW = 40


def runs(runtime, ecfg, prompts, wrong):
    out = []
    for p in prompts:
        want = reference(ecfg, p, NEW)
        policy = Policy(want, len(p), ecfg.model.cfg.vocab_size, wrong=wrong)
        res = runtime.generate(p, NEW, (), draft_policy=policy)
        check_run(res, want, policy, ecfg.parallel.topology.n)
        out.append(summary(res))
        out.append(summary(runtime.generate(p, NEW, ())))  # the untrained PDM's own drafts
    return out


@pytest.mark.parametrize("arch,n", [("llama", 2), pytest.param("qwen3", 4, marks=pytest.mark.slow)])
def test_overlapped_stage0_is_the_inline_driver(arch, n, one_thread):
    inline = tiny_engine_config(arch, n, colocate=True)
    overlap = inline.replace(overlap_stage0=True)
    prompts = random_prompts(inline.model.cfg, (1, 30), seed=3)
    wrong = frozenset({1, 7, 8, NEW - 1})
    with ReferenceExecutor(inline) as ex:
        want = runs(ex, inline, prompts, wrong)
        sampled = [ex.generate(p, NEW, (), sampling=SamplingParams(1.0, seed=5)).tokens for p in prompts]
    with ReferenceExecutor(overlap) as ex:
        assert ex.driver.stage0.runner is not None
        assert runs(ex, overlap, prompts, wrong) == want
        assert [ex.generate(p, NEW, (), sampling=SamplingParams(1.0, seed=5)).tokens for p in prompts] == sampled


@pytest.mark.multiproc
def test_overlapped_stage0_over_processes():
    ecfg = tiny_engine_config("llama", 3, colocate=True, threads=1, overlap_stage0=True)
    prompts = random_prompts(ecfg.model.cfg, (5, 17), seed=6)
    with ReferenceExecutor(ecfg.replace(overlap_stage0=False)) as ex:
        want = runs(ex, ecfg, prompts, frozenset({2, 3, 30}))
    with launch(ecfg) as runtime:
        res = runtime.generate(prompts[0], NEW, ())
        assert set(res.driver) >= {"stage0", "pdm", "send"}  # stage0: the wait at the tick's end
        assert runs(runtime, ecfg, prompts, frozenset({2, 3, 30})) == want


def test_an_error_in_stage0s_step_is_raised_at_join():
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stage 0 failed")

    runner = Stage0Runner(step, torch.device("cpu"))
    runner.start()
    runner.join()
    runner.start()
    with pytest.raises(RuntimeError, match="stage 0 failed"):
        runner.join()
    runner.start()  # the runner still serves
    runner.join()
    runner.close()
    assert len(calls) == 3
