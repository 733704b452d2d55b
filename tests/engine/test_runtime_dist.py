"""The distributed runtime (one process per rank, gloo): the same tokens AND tick counts as the
reference executor and the greedy decoder, on a few launches, each serving many requests."""
from __future__ import annotations

import pytest
from helpers import CHUNK, Policy, check_run, full_model, random_prompts, reference, summary, tiny_engine_config
from near_ties import assert_greedy_agrees, teacher_forced

from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor

pytestmark = pytest.mark.multiproc

NEW = 32


def make_cases(ecfg) -> list[tuple[list[int], int, list[int], dict]]:
    """(prompt, max_new, eos, policy kwargs): untrained PDM, oracle, forced rejections, EOS, short."""
    prompts = random_prompts(ecfg.model.cfg, (1, 2 * CHUNK + 5, 9), seed=4)
    ref = reference(ecfg, prompts[2], NEW)
    eos = next(t for k, t in enumerate(ref) if k > ecfg.parallel.topology.n + 1 and t not in ref[:k])
    return [
        (prompts[1], NEW, [], dict(oracle=False)),
        (prompts[1], NEW, [], {}),
        (prompts[2], NEW, [], dict(wrong=frozenset({1, 20, 21, NEW - 1}))),
        (prompts[2], NEW, [eos], {}),
        (prompts[2], NEW, [eos], dict(oracle=False)),
        (prompts[0], 2, [], dict(wrong=frozenset({1}))),
    ]


def run_cases(runtime, ecfg, cases) -> list[dict]:
    out = []
    for prompt, max_new, eos, kw in cases:
        want = reference(ecfg, prompt, max_new, eos)
        policy = Policy(want, len(prompt), ecfg.model.cfg.vocab_size, **kw) if ecfg.mode == "spd" else None
        res = runtime.generate(prompt, max_new, eos, draft_policy=policy)
        if policy is not None:
            check_run(res, want, policy, ecfg.parallel.topology.n)
        else:
            assert res.tokens == want and res.ticks == len(want) - 1
        out.append(summary(res))
    return out


@pytest.mark.parametrize("arch,mode,n,colocate", [("qwen2", "spd", 3, False), ("llama", "spd", 4, True),
                                                  ("qwen3", "pp", 2, False)],
                         ids=["qwen2-spd-n3", "llama-spd-n4-colocated", "qwen3-pp-n2"])
def test_distributed_run_matches_reference_executor(arch, mode, n, colocate):
    ecfg = tiny_engine_config(arch, n, colocate, mode=mode, threads=1)
    cases = make_cases(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        want = run_cases(ex, ecfg, cases)
    with launch(ecfg) as runtime:
        got = run_cases(runtime, ecfg, cases)
    assert got == want  # tokens, ticks, verified, accepted, rejections of every request
    if mode == "spd":
        assert any(s["rejections"] > 2 for s in got) and any(s["accepted"] > NEW // 2 for s in got)


@pytest.mark.parametrize("arch,n,colocate,width,when", [("qwen3", 3, False, 2, "refill"),
                                                         ("llama", 4, True, 4, "always")],
                         ids=["qwen3-n3-W2", "llama-n4-colocated-W4"])
def test_branch_chains_across_processes_match_the_reference_executor(arch, n, colocate, width, when):
    """Branch width W over gloo: the chains' messages, the survivor's KV entries and the flushes
    give the reference executor's tokens, ticks and branch counters (the same computation, bit for
    bit), and greedy decoding's tokens up to a near-tie."""
    ecfg = tiny_engine_config(arch, n, colocate, threads=1, branches=width, branch_when=when, suffix_min_match=1)
    prompts = random_prompts(ecfg.model.cfg, (1, 2 * CHUNK + 5, 9), seed=4)

    def run(runtime) -> list[dict]:
        out = []
        for p in prompts:
            res = runtime.generate(p, NEW)
            # W-row chain steps: greedy's tokens up to a near-tie (docs/testing.md)
            assert_greedy_agrees(res.tokens, reference(ecfg, p, NEW),
                                 teacher_forced(full_model(ecfg), p, reference(ecfg, p, NEW)), 1e-5, "W>1")
            out.append(dict(summary(res), points=res.branch_points, saves=res.branch_saves))
        return out

    with ReferenceExecutor(ecfg) as ex:
        want = run(ex)
    with launch(ecfg) as runtime:
        got = run(runtime)
    assert got == want and sum(s["points"] for s in got) > 0
