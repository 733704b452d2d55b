"""Suffix runs end to end (docs/design.md 3.13): the runtime (reference executor) commits the greedy
output, and the exact replay (train/run_replay.py) predicts its counters, per fill and per draft
source, tick for tick; runs cut ticks against one token per entry; ranks as processes agree with
the in-process reference at T=0 and T>0."""
from __future__ import annotations

import pytest
from helpers import full_model, random_prompts, reference, summary, tiny_engine_config

from spd_engine.engine.protocol.drafting import SUFFIX_RUN
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.build import build_pdm
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.kernels.packed_linear import packed_kernel_available
from spd_engine.train.fast_eval import fast_generate

NEW = 40
# (arch, n, co-located driver, PDM layers K): K = 2 makes every key of the PDM cache depend on the
# depths it saw, so a wrong staircase for a run in flight would show
CASES = [("llama", 2, True, 1), ("qwen3", 3, False, 2), ("llama", 4, False, 2)]


def counters(res) -> tuple:
    return (res.ticks, res.verified, res.accepted, res.rejections, res.verified_by_fill, res.accepted_by_fill)


@pytest.mark.parametrize("arch,n,colocate,K", CASES, ids=[f"{a}-n{n}-K{k}{'-colocated' if c else ''}"
                                                           for a, n, c, k in CASES])
def test_runtime_equals_replay_and_greedy(arch, n, colocate, K, one_thread):
    ecfg = tiny_engine_config(arch, n, colocate, pdm_layers=K, suffix_run=4, suffix_min_match=1)
    target, pdm = full_model(ecfg), build_pdm(ecfg)
    loop = random_prompts(ecfg.model.cfg, [12], seed=1)[0]
    prompts = [loop * 3, random_prompts(ecfg.model.cfg, [20], seed=2)[0]]  # a repeated prompt: long matches
    runs_verified = rejected_in_runs = 0
    with ReferenceExecutor(ecfg, pdm=pdm) as ex:
        for prompt in prompts:
            want = reference(ecfg, prompt, NEW)
            stop = [want[25]]  # an EOS inside the request
            for eos in ((), stop):
                ref = reference(ecfg, prompt, NEW, eos)
                res = ex.generate(prompt, NEW, eos)
                assert res.tokens == ref
                fast = fast_generate(target, pdm, prompt, NEW, eos, chunk=ecfg.runtime.prefill_chunk,
                                     chooser=ex.driver.drafter.chooser)
                assert fast.tokens == ref
                assert counters(fast.acceptance) == counters(res)
                assert fast.acceptance.by_source == {k: v[1:] for k, v in res.by_source.items() if v[1]}
                verified, accepted = res.by_source.get(SUFFIX_RUN, [0, 0, 0])[1:]
                runs_verified += verified
                rejected_in_runs += verified - accepted
                assert fast.stage_tokens > fast.stage_slots or verified == 0
    assert runs_verified > 10 and rejected_in_runs > 0  # runs travelled, and some were cut short


def test_runs_cut_ticks(one_thread):
    ecfg = tiny_engine_config("llama", 2, True, suffix_run=4, suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, [12], seed=1)[0] * 3
    with ReferenceExecutor(ecfg) as ex:
        runs = ex.generate(prompt, NEW)
    with ReferenceExecutor(ecfg.replace(suffix_run=1)) as ex:
        one = ex.generate(prompt, NEW)
    assert runs.tokens == one.tokens
    assert runs.ticks < one.ticks


def test_where_runs_cannot_travel_is_refused():
    with pytest.raises(ValueError, match="n >= 2"):
        tiny_engine_config("llama", 1, suffix_run=4)
    with pytest.raises(ValueError, match="--branches"):
        tiny_engine_config("llama", 2, suffix_run=4, branches=2)
    with pytest.raises(ValueError, match="suffix-drafts on"):
        tiny_engine_config("llama", 2, suffix_run=4, suffix_drafts=False)
    with pytest.raises(ValueError, match=">= 1"):
        tiny_engine_config("llama", 2, suffix_run=0)
    with pytest.raises(ValueError, match="float32"):  # docs/design.md 3.13: rounding
        tiny_engine_config("llama", 2, suffix_run=4, dtype="bfloat16")
    assert tiny_engine_config("llama", 2, suffix_run=None, dtype="bfloat16").max_run == 1
    assert tiny_engine_config("llama", 2, suffix_run=None).max_run > 1  # the default where runs travel
    assert tiny_engine_config("llama", 2, suffix_run=None, branches=2).max_run == 1
    assert tiny_engine_config("llama", 2, suffix_run=None).replace(mode="pp").max_run == 1


@pytest.mark.parametrize("colocate,transport", [(True, "shm"), (False, "gloo")])
def test_processes_equal_the_reference_executor(colocate, transport):
    """Ranks as processes (runs travel as TOKEN messages of several positions over the transport):
    tokens and counters of every request equal the threads' at T=0 and seeded T>0."""
    ecfg = tiny_engine_config("qwen2", 2, colocate, suffix_run=4, suffix_min_match=1, threads=1,
                              transport=transport)
    loop = random_prompts(ecfg.model.cfg, [10], seed=4)[0]
    prompts = [loop * 3, random_prompts(ecfg.model.cfg, [17], seed=5)[0]]
    cases = [(p, s) for p in prompts for s in (None, SamplingParams(temperature=1.0, top_k=3, seed=11))]
    with ReferenceExecutor(ecfg) as ex:
        want = [summary(ex.generate(p, NEW, (), sampling=s or SamplingParams())) for p, s in cases]
    with launch(ecfg) as runtime:
        got = [summary(runtime.generate(p, NEW, (), sampling=s or SamplingParams())) for p, s in cases]
    assert got == want
    assert want[0]["tokens"] == reference(ecfg, prompts[0], NEW)
    assert any(r["ticks"] < NEW - 1 for r in want)  # some request committed several tokens per tick


@pytest.mark.parametrize("colocate", [True, False])
def test_static_steps_carry_runs_eagerly(colocate, one_thread):
    """The static (graph-path) one-token steps share the KV cache with the eager steps that carry runs."""
    ecfg = tiny_engine_config("llama", 2, colocate, suffix_run=4, suffix_min_match=1, step_mode="static")
    prompt = random_prompts(ecfg.model.cfg, [12], seed=1)[0] * 3
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW)
    assert res.tokens == reference(ecfg, prompt, NEW)
    assert res.by_source[SUFFIX_RUN][1] > 0


@pytest.mark.skipif(not packed_kernel_available(), reason="this torch has no oneDNN CPU linear")
@pytest.mark.parametrize("colocate", [True, False])
def test_packed_weights_carry_runs_losslessly(colocate, one_thread):
    """`--weight-layout packed` (kernels/packed_linear.py), where a run's rows cost about what one
    token's do: ranks as processes commit the greedy output of the same layout, runs included."""
    ecfg = tiny_engine_config("qwen2", 2, colocate, suffix_run=4, suffix_min_match=1, threads=1,
                              weight_layout="packed")
    loop = random_prompts(ecfg.model.cfg, [10], seed=6)[0]
    prompts = [loop * 3, random_prompts(ecfg.model.cfg, [17], seed=7)[0]]
    with launch(ecfg) as runtime:
        got = [runtime.generate(p, NEW, ()) for p in prompts]
    assert [r.tokens for r in got] == [reference(ecfg, p, NEW) for p in prompts]
    assert got[0].by_source.get(SUFFIX_RUN, [0, 0, 0])[1] > 0  # runs travelled
