"""T=0 verification on the last stage (RunConfig.parallel.verify_at, docs/design.md 3.5): the last stage
holds the head and sends the target's argmax with its exit; the driver then only compares ids.
Lossless either way, the driver really stops computing the head (a suffix run's rows included),
T > 0 and branch chains still verify on the driver, and the setting is validated."""
from __future__ import annotations

import pytest
from helpers import Policy, check_run, random_prompts, reference, tiny_engine_config

from spd_engine.engine.protocol.drafting import SUFFIX_RUN
from spd_engine.engine.protocol.messages import WireFormat
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 40
WRONG = frozenset({1, 9, 10, NEW - 1})  # forced rejections: the first draft, two in a row, the last token


def head_calls(driver) -> list[int]:
    """Counts the driver's own head passes (final norm + LM head: its logits or its greedy token,
    which may use the head's int8 screen) from now on; a greedy token without the screen counts twice."""
    calls = [0]

    def counting(fn):
        def counted(h):
            calls[0] += 1
            return fn(h)
        return counted

    driver.head.logits = counting(driver.head.logits)
    driver.head.greedy_token = counting(driver.head.greedy_token)
    driver.head.greedy_tokens = counting(driver.head.greedy_tokens)  # a suffix run's rows
    return calls


@pytest.mark.parametrize("verify_at", ["last", "driver"])
@pytest.mark.parametrize("colocate", [True, False])
def test_suffix_runs_verified_where_verification_runs(verify_at, colocate, one_thread):
    """A suffix run's rows: the verifying last stage replies every row's argmax, so the driver runs
    no head pass for them; verified on the driver, it runs one per run."""
    ecfg = tiny_engine_config("llama", 2, colocate, verify_at=verify_at, suffix_run=4, suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, [12], seed=1)[0] * 3  # a repeated prompt: long suffix matches
    want = reference(ecfg, prompt, NEW)
    with ReferenceExecutor(ecfg) as ex:
        calls = head_calls(ex.driver)
        res = ex.generate(prompt, NEW)
    assert res.tokens == want
    runs = res.by_source.get(SUFFIX_RUN, [0, 0, 0])[1]
    assert runs > 5  # run tokens travelled and were verified
    if verify_at == "last":
        assert calls[0] == 1  # the prefill's last position only
    else:
        assert calls[0] > 1


@pytest.mark.parametrize("verify_at", ["last", "driver"])
@pytest.mark.parametrize("n,colocate,step_mode", [(2, True, "eager"), (3, False, "eager"), (2, True, "static"),
                                                  (4, False, "static")])
def test_lossless_wherever_verification_runs(verify_at, n, colocate, step_mode, one_thread):
    ecfg = tiny_engine_config("llama", n, colocate, verify_at=verify_at, step_mode=step_mode)
    prompts = random_prompts(ecfg.model.cfg, [5, 19], seed=3)
    with ReferenceExecutor(ecfg) as ex:
        calls = head_calls(ex.driver)
        for k, p in enumerate(prompts):
            want = reference(ecfg, p, NEW)
            policy = Policy(want, len(p), ecfg.model.cfg.vocab_size, wrong=WRONG if k else frozenset())
            res = ex.generate(p, NEW, (), draft_policy=policy)
            check_run(res, want, policy, n)
            last = res.stages[-1]
            if verify_at == "last":  # the stage computed every exit's argmax; the driver only the first token's
                assert last["verify_s"] > 0
            else:
                assert last["verify_s"] == 0
    if verify_at == "last":
        assert calls[0] == len(prompts)  # one head pass per request: the prefill's last position
    elif step_mode == "eager":
        assert calls[0] >= len(prompts) * (NEW - 1)  # and one per verification
    assert ex.driver.wire.verify_on_last == (verify_at == "last")


def test_sampling_is_the_same_wherever_t0_verification_would_run(one_thread):
    """At T > 0 the last stage does not verify (it replies -1) and the driver verifies against its
    q as before: with the same seed the tokens are identical to a run verifying on the driver."""
    prompt = random_prompts(tiny_engine_config().model.cfg, [11], seed=4)[0]
    out = {}
    for verify_at in ("last", "driver"):
        ecfg = tiny_engine_config("llama", 3, True, verify_at=verify_at)
        with ReferenceExecutor(ecfg) as ex:
            res = ex.generate(prompt, NEW, (), sampling=SamplingParams(temperature=0.8, top_k=20, seed=7))
            out[verify_at] = res.tokens
            assert res.stages[-1]["verify_s"] == 0
    assert out["last"] == out["driver"] and len(out["last"]) == NEW


def test_branch_chains_verify_on_the_driver_and_stay_lossless(one_thread):
    """A chains message (W rows) carries no argmax (-1): the driver verifies the branch point itself;
    one-row exits around it still come verified from the last stage."""
    ecfg = tiny_engine_config("llama", 3, False, branches=2, branch_when="always", verify_at="last")
    prompt = random_prompts(ecfg.model.cfg, [9], seed=5)[0]
    want = reference(ecfg, prompt, NEW)
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, ())
    assert res.tokens == want and res.branch_points > 0


def test_verify_at_is_validated():
    with pytest.raises(ValueError, match="verify_at must be one of"):
        tiny_engine_config("llama", 2, verify_at="gpu")
    # auto (the default): on the last stage when co-located, where the driver's rank also runs stage 0
    assert tiny_engine_config("llama", 2, True).verifies_on_last
    assert not tiny_engine_config("llama", 2, False).verifies_on_last  # the driver has a rank of its own
    assert tiny_engine_config("llama", 2, False, verify_at="last").verifies_on_last
    assert not tiny_engine_config("llama", 1).verifies_on_last  # n = 1: the last stage is the driver's own
    assert not tiny_engine_config("llama", 2, mode="pp").verifies_on_last  # pp's head stage replies a token
    assert not tiny_engine_config("llama", 2, verify_at="driver").verifies_on_last
    with pytest.raises(AssertionError):
        WireFormat(8, (1, 1), head_on_last=True, verify_on_last=True)
