"""The tensor-parallel runtime: --mode tp, pp x tp and SPD x TP give greedy decoding with the same
TP split token for token (and SPD the tick count of its formula), ranks as threads and as
processes; every TP rank holds about 1/T of its stage's parameters; against the unsharded model
the outputs agree except where the reduction order decides a near-tie."""
from __future__ import annotations

import pytest
from helpers import CHUNK, Policy, check_run, full_model, random_prompts, reference, summary
from near_ties import assert_greedy_agrees, teacher_forced
from tp_cases import tp_engine_config, tp_reference

from spd_engine.engine.model.tp_model import resident_bytes
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.build import build_stage_model
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 24


def cases(ecfg) -> list[tuple[list[int], int, list[int], dict]]:
    """(prompt, max_new, eos, draft policy kwargs): untrained PDM, oracle with forced rejections,
    EOS, a prompt of several prefill chunks, a one-token prompt."""
    prompts = random_prompts(ecfg.model.cfg, (1, 2 * CHUNK + 5, 9), seed=4)
    ref = tp_reference(ecfg, prompts[2], NEW)
    eos = next(t for k, t in enumerate(ref) if k > ecfg.parallel.topology.n + 1 and t not in ref[:k])
    return [(prompts[1], NEW, [], dict(oracle=False)),
            (prompts[2], NEW, [], dict(wrong=frozenset({1, 9, 10, NEW - 1}))),
            (prompts[2], NEW, [eos], {}),
            (prompts[0], 3, [], dict(wrong=frozenset({1})))]


def run_cases(runtime, ecfg, todo) -> list[dict]:
    out = []
    for prompt, max_new, eos, kw in todo:
        want = tp_reference(ecfg, prompt, max_new, eos)
        policy = Policy(want, len(prompt), ecfg.model.cfg.vocab_size, **kw) if ecfg.mode == "spd" else None
        res = runtime.generate(prompt, max_new, eos, draft_policy=policy)
        if policy is not None:
            check_run(res, want, policy, ecfg.parallel.topology.n)
        else:
            assert res.tokens == want and res.ticks == len(want) - 1
        out.append(summary(res))
    return out


THREADED = [("tp", 1, 2, True), ("tp", 1, 3, True), ("pp", 2, 2, True), ("pp", 3, 3, True), ("spd", 1, 2, False),
            ("spd", 2, 2, False), ("spd", 4, 2, True), ("spd", 2, 3, False), ("spd", 4, 3, False)]


@pytest.mark.parametrize("mode,n,tp,colocate", THREADED, ids=[f"{m}-n{n}-tp{t}{'-co' if c and m == 'spd' else ''}"
                                                             for m, n, t, c in THREADED])
def test_threaded_tp_runtime_equals_greedy_with_the_same_split(mode, n, tp, colocate, one_thread):
    ecfg = tp_engine_config(mode, n, tp, colocate, threads=1)
    with ReferenceExecutor(ecfg) as ex:
        run_cases(ex, ecfg, cases(ecfg))


def test_each_tp_rank_holds_about_one_tth_of_its_stage(one_thread):
    for tp in (2, 3):
        ecfg = tp_engine_config("pp", 2, tp, threads=1)
        with ReferenceExecutor(ecfg) as ex:
            res = ex.generate([5, 6, 7], 2)
        got = res.to_json()["stage_param_bytes"]
        topo = ecfg.parallel.topology
        whole = [resident_bytes(build_stage_model(ecfg, topo.layers_of(s), s == 0, s == topo.n - 1))
                 for s in range(topo.n)]
        assert all(abs(g / w - 1 / tp) < 0.01 for g, w in zip(got, whole)), (tp, got, whole)


def test_tp_stages_count_their_collectives_per_decode_message(one_thread):
    """Two all-reduces per layer, one for a vocab-parallel embedding and one all_gather for the
    head's greedy argmax: the count the cost model prices (costmodel/cost_alternatives.py tp_token_ms)."""
    ecfg = tp_engine_config("pp", 2, 2, threads=1)
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate([5, 6, 7], 6)
    per = res.breakdown_ms_per_tick()
    topo = ecfg.parallel.topology
    want = [2 * len(topo.layers_of(s)) + (s == 0) + (s == topo.n - 1) for s in range(topo.n)]
    assert [per[f"stage{s}_tp_collectives"] for s in range(topo.n)] == want
    assert all(0 < per[f"stage{s}_tp_collective_ms"] <= per[f"stage{s}_compute_ms"] for s in range(topo.n))


def test_tp_against_the_unsharded_model_differs_only_at_near_ties(one_thread):
    """Greedy with a TP split and unsharded greedy agree, or part at a near-tie of the logits (the
    split only changes the reduction order: within BOUND of each other); the partings are printed."""
    BOUND = 1e-4
    for tp in (2, 3):
        ecfg = tp_engine_config("tp", 1, tp, threads=1)
        parted = []
        for prompt in random_prompts(ecfg.model.cfg, (5, 17, 40), seed=9):
            got, want = tp_reference(ecfg, prompt, NEW), reference(ecfg, prompt, NEW)
            k = assert_greedy_agrees(got, want, teacher_forced(full_model(ecfg), prompt, want), BOUND, f"tp={tp}")
            parted += [k] if k is not None else []
        print(f"tp={tp}: {len(parted)} of 3 outputs part from unsharded greedy decoding, at tokens {parted}")


def _sampled(runtime, prompt: list[int]) -> list[list[int]]:
    return [runtime.generate(prompt, 12, sampling=SamplingParams(temperature=1.0, top_k=20, seed=s)).tokens
            for s in (1, 2)]


PROCESS = [pytest.param("tp", 1, 2, True, id="tp-n1-tp2"),
           pytest.param("spd", 2, 2, False, id="spd-n2-tp2"),
           pytest.param("tp", 1, 3, True, id="tp-n1-tp3", marks=pytest.mark.slow),
           pytest.param("pp", 2, 2, True, id="pp-n2-tp2", marks=pytest.mark.slow),
           pytest.param("spd", 1, 3, False, id="spd-n1-tp3", marks=pytest.mark.slow),
           pytest.param("spd", 4, 2, True, id="spd-n4-tp2-co", marks=pytest.mark.slow),
           pytest.param("spd", 2, 3, False, id="spd-n2-tp3", marks=pytest.mark.slow)]


@pytest.mark.multiproc
@pytest.mark.parametrize("mode,n,tp,colocate", PROCESS)
def test_tp_processes_equal_threads_and_greedy_with_the_same_split(mode, n, tp, colocate):
    ecfg = tp_engine_config(mode, n, tp, colocate, threads=1)
    todo = cases(ecfg)[1:3]
    prompt = todo[0][0]
    with ReferenceExecutor(ecfg) as ex:
        want = run_cases(ex, ecfg, todo), _sampled(ex, prompt)
    with launch(ecfg) as runtime:
        got = run_cases(runtime, ecfg, todo), _sampled(runtime, prompt)
    assert got == want  # greedy: tokens and tick counts; T>0: the same draws for the same seeds


def test_eval_with_tp_checks_the_runtime_against_the_same_split(one_thread):
    from spd_engine.train.evaluate import EvalSettings, open_runner

    ecfg = tp_engine_config("spd", 2, 2, threads=1)
    with pytest.raises(ValueError, match="fast executor replays the unsharded model"):
        with open_runner(ecfg, EvalSettings(executor="fast")):
            pass
    prompt = random_prompts(ecfg.model.cfg, (12,), seed=3)[0]
    with open_runner(ecfg, EvalSettings(max_new_tokens=16, executor="reference")) as runner:
        outcome = runner.run(prompt, 16, ())
    assert outcome.lossless is True and outcome.tokens == tp_reference(ecfg, prompt, 16)
