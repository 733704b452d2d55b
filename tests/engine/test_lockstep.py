"""The reference executor's two ways of running the stage ranks give the same runs: as threads over
the in-process queues, and in lockstep (engine/comm/lockstep.py: every rank in the caller's thread,
a stage stepping as a message reaches it), which the executor picks by default where it can. Same
tokens, ticks and counters for SPD at T = 0 and seeded T > 0, with branches, suffix runs and
several requests in one batch, and for the pp baseline; a failing stage ends the request
with its own error; TP stages and an overlapped stage 0 keep their threads."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import random_prompts, tiny_engine_config

from spd_engine.engine.comm.lockstep import LockstepHub
from spd_engine.engine.comm.transport import TransportError
from spd_engine.engine.protocol.drafting import SUFFIX_RUN
from spd_engine.engine.protocol.messages import Header, Kind
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.stage_worker import StageWorker

SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=7)
NEW = 24


def summary(res) -> tuple:
    """What a run decides (not when): tokens, ticks and the drafting counters."""
    return (res.tokens, res.ticks, res.verified, res.accepted, res.by_source, res.branch_points, res.branch_saves)


def runs(ecfg, lockstep: bool, prompts, sampling) -> list[tuple]:
    with ReferenceExecutor(ecfg, lockstep=lockstep) as ex:
        assert (not ex.threads) == lockstep  # the executor really ran the way asked
        return [summary(ex.generate(p, NEW, (), sampling=sampling)) for p in prompts]


# a prompt that repeats itself, so suffix drafts and runs have matches
REPEATING = [5, 9, 13, 7, 5, 9, 13, 7, 5, 9, 13, 7, 5, 9]
CONFIGS = {
    "llama-n2": dict(),
    "qwen2-n3": dict(arch="qwen2", n=3),
    "llama-n4-colocated": dict(n=4, colocate=True),
    "llama-n3-W2": dict(n=3, branches=2, branch_when="always"),
    "llama-n2-suffix-runs": dict(suffix_drafts=True, suffix_min_match=1, suffix_run=3),
}


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", CONFIGS)
def test_lockstep_runs_equal_threaded_runs(name, sampling, one_thread):
    kw = dict(CONFIGS[name])
    arch, n, colocate = kw.pop("arch", "llama"), kw.pop("n", 2), kw.pop("colocate", False)
    ecfg = tiny_engine_config(arch, n, colocate, **kw)
    prompts = [*random_prompts(ecfg.model.cfg, (3, 17), seed=4), REPEATING]
    threaded = runs(ecfg, False, prompts, sampling)
    assert runs(ecfg, True, prompts, sampling) == threaded
    if "suffix_run" in kw:  # the check covers runs: they travelled
        assert any(r[4].get(SUFFIX_RUN, [0, 0])[1] > 0 for r in threaded), threaded


@pytest.mark.parametrize("n,colocate", [(3, False), (2, True)])
def test_lockstep_pp_baseline_equals_threaded_pp(n, colocate, one_thread):
    """The pp baseline (ar runs on one rank: nothing to step)."""
    ecfg = tiny_engine_config("llama", n, colocate, mode="pp")
    prompts = random_prompts(ecfg.model.cfg, (4, 11), seed=2)
    assert runs(ecfg, True, prompts, SamplingParams()) == runs(ecfg, False, prompts, SamplingParams())


def test_lockstep_batch_equals_threaded_batch(one_thread):
    """Three requests through two slots, one greedy and two seeded, suffix runs on: each request's
    run is the same (the run's own tick count may differ: when a slot frees depends on when exits
    arrive, which threads change)."""
    ecfg = tiny_engine_config("llama", 2, suffix_drafts=True, suffix_min_match=1, suffix_run=3)
    prompts = [*random_prompts(ecfg.model.cfg, (6, 2), seed=9), REPEATING]
    samplings = [SamplingParams(), SAMPLED, dataclasses.replace(SAMPLED, seed=8)]
    out = {}
    for lockstep in (False, True):
        with ReferenceExecutor(ecfg, lockstep=lockstep) as ex:
            run = ex.generate_batch([BatchRequest(p, NEW, sampling=s) for p, s in zip(prompts, samplings)], 2)
            out[lockstep] = [summary(r) for r in run.results]
            assert max(run.rows) > 1  # requests really shared ticks
    assert out[True] == out[False]


def test_a_failing_stage_in_lockstep_raises_its_own_error_and_is_recorded(monkeypatch, one_thread):
    compute = StageWorker._compute_batch

    def failing(self, hdr, t0):
        if self.stage == 1:
            raise RuntimeError("stage 1 broke")
        return compute(self, hdr, t0)

    monkeypatch.setattr(StageWorker, "_compute_batch", failing)
    ecfg = tiny_engine_config("llama", 3)
    with ReferenceExecutor(ecfg, lockstep=True) as ex:
        with pytest.raises(RuntimeError, match="stage 1 broke"):
            ex.generate(random_prompts(ecfg.model.cfg, [5])[0], 8)
        assert [str(e) for e in ex.errors] == ["stage 1 broke"] and ex.hub.dead == {2}  # stage 1 is rank 2


def test_tp_stages_and_an_overlapped_stage0_keep_their_threads():
    base = tiny_engine_config("llama", 2)
    tp = base.replace(topology=Topology.build(base.model.cfg.num_layers, 2, tp=2))
    with pytest.raises(ValueError, match="tp=2"):
        ReferenceExecutor(tp, lockstep=True)
    with ReferenceExecutor(tp) as ex:  # the default picks threads
        assert len(ex.threads) == 4
    overlap = tiny_engine_config("llama", 2, colocate=True, overlap_stage0=True)
    with pytest.raises(ValueError, match="overlap_stage0"):
        ReferenceExecutor(overlap, lockstep=True)
    with ReferenceExecutor(base) as ex:
        assert ex.threads == []  # tp = 1: lockstep by default


def test_a_lockstep_receive_with_nothing_queued_fails_at_once():
    hub = LockstepHub(2, [])
    t0, t1 = hub.transport(0), hub.transport(1)
    t0.send(1, Header(Kind.END), [torch.zeros(2)])  # rank 1 has no worker: the message just waits
    assert t1.recv_header(0, timeout=None).kind == Kind.END
    t1.recv_into(0, torch.empty(2), timeout=None)
    with pytest.raises(TransportError, match="nothing queued"):
        t1.recv_header(0, timeout=None)
