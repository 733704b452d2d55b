"""The runtime on the reference executor (every rank in one process, same driver and stage objects as a
distributed run): lossless against the greedy decoder, tick counts from the schedule formula, EOS,
short requests, and the ar / pp baselines."""
from __future__ import annotations

import functools

import pytest
from helpers import ARCHS, CHUNK, Policy, check_run, expected_ticks, full_model, random_prompts, reference, tiny_engine_config  # noqa: F401
from near_ties import assert_greedy_agrees, teacher_forced

from spd_engine.engine.protocol.messages import Kind
from spd_engine.engine.protocol.schedule import decode_ticks
from spd_engine.engine.runtime.reference import ReferenceExecutor

TOPOLOGIES = [(2, False), (3, False), (4, False), (4, True)]
TOPOLOGY_IDS = ["n2", "n3", "n4", "n4-colocated"]
LENGTHS = (1, 5, CHUNK, 23, 3 * CHUNK + 7)  # one token, one chunk exactly, several chunks
NEW = 64
# forced rejections as token indices (index 1 is the first draft after the prefill token): the first
# draft, two in a row, and the very last token; then three in a row right after an accept
FORCED = [frozenset({1, 20, 21, NEW - 1}), frozenset({2, 3, 4, 40})]
# The untrained PDM rejects nearly every draft (about n ticks per token), so the default run covers
# two (family, topology) pairs; the slow run covers every (family, topology) pair.
UNTRAINED_DEFAULT = {("qwen2", "n3"), ("llama", "n4-colocated")}
STATIC_LOGIT_BOUND = 1e-5  # static (masked bucket) vs eager steps, tiny logits O(1): observed ~1e-7


def matrix(default: set | None = None) -> list:
    out = []
    for arch in ARCHS:
        for (n, colocate), tid in zip(TOPOLOGIES, TOPOLOGY_IDS):
            slow = default is not None and (arch, tid) not in default
            out.append(pytest.param(arch, n, colocate, id=f"{arch}-{tid}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@functools.lru_cache(maxsize=None)
def prompts_and_refs(arch: str) -> tuple[list[list[int]], list[list[int]]]:
    """The same prompts and greedy outputs serve every topology of a family."""
    ecfg = tiny_engine_config(arch, 1)
    prompts = random_prompts(ecfg.model.cfg, LENGTHS, seed=1)
    refs = [reference(ecfg, p, NEW) for p in prompts]
    assert all(len(r) == NEW for r in refs)
    return prompts, refs


def setup(arch: str, n: int, colocate: bool):
    return (tiny_engine_config(arch, n, colocate), *prompts_and_refs(arch))


@pytest.mark.parametrize("arch,n,colocate", matrix())
def test_lossless_with_oracle_and_forced_rejections(arch, n, colocate, one_thread):
    ecfg, prompts, refs = setup(arch, n, colocate)
    V = ecfg.model.cfg.vocab_size
    with ReferenceExecutor(ecfg) as ex:  # one runtime, many requests: each starts after a flush or not
        for p, ref in zip(prompts, refs):
            policy = Policy(ref, len(p), V)
            res = ex.generate(p, NEW, (), draft_policy=policy)
            check_run(res, ref, policy, n)
            assert res.ticks == (NEW - 1) + (n - 1) and res.alpha == 1.0
        for k, wrong in enumerate(FORCED):
            p, ref = prompts[k + 1], refs[k + 1]
            policy = Policy(ref, len(p), V, wrong=wrong)
            res = ex.generate(p, NEW, (), draft_policy=policy)
            assert policy.rejected(NEW) == sorted(wrong)  # rejected where asked, nowhere else
            check_run(res, ref, policy, n)


@pytest.mark.parametrize("arch,n,colocate", matrix(UNTRAINED_DEFAULT))
def test_lossless_with_the_untrained_pdm(arch, n, colocate, one_thread):
    ecfg, prompts, refs = setup(arch, n, colocate)
    V = ecfg.model.cfg.vocab_size
    with ReferenceExecutor(ecfg) as ex:
        policies = []
        for p, ref in zip(prompts, refs):
            policy = Policy(ref, len(p), V, oracle=False)  # records the PDM's drafts, changes nothing
            res = ex.generate(p, NEW, (), draft_policy=policy)
            check_run(res, ref, policy, n)
            policies.append(policy)
        short = 16
        plain = ex.generate(prompts[0], short)  # no policy at all; drafts depend on the history only
    R = sum(1 for i in policies[0].rejected(short) if i < short - 1)
    assert plain.tokens == refs[0][:short] and plain.ticks == decode_ticks(short, n, R)


def eos_index(ref: list[int], lo: int) -> int:
    """An index k >= lo whose token does not occur earlier in ref (so it ends greedy output at k)."""
    for k in range(lo, len(ref) - 1):
        if ref[k] not in ref[:k]:
            return k
    raise AssertionError(f"no first-occurrence token after index {lo} in {ref}")


def varied_prompt(ecfg, lo: int) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy output has two first-occurrence tokens after index lo (random models
    often repeat one token forever); returns (prompt, output, index of the first of them)."""
    for seed in range(50):
        prompt = random_prompts(ecfg.model.cfg, [9], seed=seed)[0]
        ref = reference(ecfg, prompt, NEW)
        fresh = [k for k in range(lo, NEW - 1) if ref[k] not in ref[:k]]
        if len(fresh) >= 2:
            return prompt, ref, fresh[0]
    raise AssertionError("no prompt with a varied greedy output")


@pytest.mark.parametrize("arch,n,colocate", [("llama", 2, False), ("qwen2", 4, False), ("qwen3", 4, True)],
                         ids=["llama-n2", "qwen2-n4", "qwen3-n4-colocated"])
def test_eos_inside_the_pipeline_stops_output_there(arch, n, colocate, one_thread):
    ecfg = tiny_engine_config(arch, n, colocate)
    V = ecfg.model.cfg.vocab_size
    prompt, ref, k = varied_prompt(ecfg, n + 2)  # drafts after index k are in flight when k is verified
    later = eos_index(ref, k + 1)
    with ReferenceExecutor(ecfg) as ex:
        for eos in ([ref[k]], [ref[later], ref[k]]):  # an EOS list: the first one committed wins
            want = reference(ecfg, prompt, NEW, eos)
            assert want == ref[:k + 1]
            for policy in (Policy(ref, len(prompt), V), Policy(ref, len(prompt), V, oracle=False),
                           Policy(ref, len(prompt), V, wrong=frozenset({k})),  # the correction is the EOS
                           Policy(ref, len(prompt), V, wrong=frozenset({k - 1}))):
                res = ex.generate(prompt, NEW, eos, draft_policy=policy)
                check_run(res, want, policy, n)  # no unverified draft after the EOS
        res = ex.generate(prompt, NEW, [ref[0]])  # the prefill token itself is an EOS
        assert res.tokens == [ref[0]] and res.ticks == 0 and res.verified == 0


@pytest.mark.parametrize("n,colocate", [(2, False), (3, True), (4, False), (4, True)],
                         ids=["n2", "n3-colocated", "n4", "n4-colocated"])
def test_one_token_prompt_and_fewer_new_tokens_than_stages(n, colocate, one_thread):
    ecfg = tiny_engine_config("qwen3", n, colocate)
    V = ecfg.model.cfg.vocab_size
    prompt = random_prompts(ecfg.model.cfg, [1], seed=5)[0]
    ref = reference(ecfg, prompt, n + 2)
    with ReferenceExecutor(ecfg) as ex:
        for max_new in range(1, n + 3):
            want = ref[:max_new]
            policies = [Policy(want, 1, V), Policy(want, 1, V, oracle=False)]
            if max_new > 1:
                policies.append(Policy(want, 1, V, wrong=frozenset({max_new - 1})))  # rejection at the end
            for policy in policies:
                res = ex.generate(prompt, max_new, (), draft_policy=policy)
                check_run(res, want, policy, n)  # max_new 1: no decode tick at all


def test_one_stage_spd_is_lossless_with_one_tick_per_token(one_thread):
    ecfg = tiny_engine_config("llama", 1)
    prompt = random_prompts(ecfg.model.cfg, [CHUNK + 3], seed=2)[0]
    ref = reference(ecfg, prompt, 24)
    with ReferenceExecutor(ecfg) as ex:
        for policy in (Policy(ref, len(prompt), ecfg.model.cfg.vocab_size, oracle=False),
                       Policy(ref, len(prompt), ecfg.model.cfg.vocab_size, wrong=frozenset({1, 5, 6}))):
            res = ex.generate(prompt, 24, (), draft_policy=policy)
            assert res.tokens == ref and res.ticks == 23 == expected_ticks(policy, 24, 1)
            assert res.accepted == 23 - len(policy.rejected(24))


def test_one_stage_spd_counts_its_rejections(one_thread):
    ecfg = tiny_engine_config("llama", 1)
    prompt = random_prompts(ecfg.model.cfg, [7], seed=2)[0]
    ref = reference(ecfg, prompt, 12)
    policy = Policy(ref, len(prompt), ecfg.model.cfg.vocab_size, wrong=frozenset({1, 5, 6}))
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, 12, (), draft_policy=policy)
    assert res.rejections == 3  # rejections followed by another committed token (metrics.py)


BASELINES = {"llama": (("ar", 1), ("pp", 2), ("pp", 3), ("pp", 4)), "qwen2": (("ar", 1), ("pp", 3)),
             "qwen3": (("pp", 2), ("pp", 4))}


@pytest.mark.parametrize("arch", ARCHS)
def test_ar_and_pp_baselines_equal_the_reference(arch, one_thread):
    ecfg0 = tiny_engine_config(arch, 1, mode="ar")
    prompts = random_prompts(ecfg0.model.cfg, (1, CHUNK + 1, 2 * CHUNK + 3), seed=3)
    refs = [reference(ecfg0, p, 32) for p in prompts]
    eos_prompt, eos_ref, eos_k = varied_prompt(ecfg0, 3)
    for mode, n in BASELINES[arch]:
        ecfg = tiny_engine_config(arch, n, mode=mode)
        with ReferenceExecutor(ecfg) as ex:
            for p, ref in zip(prompts, refs):
                res = ex.generate(p, 32)
                assert res.tokens == ref, (mode, n)
                assert res.ticks == len(ref) - 1
            res = ex.generate(eos_prompt, NEW, [eos_ref[eos_k]])
            assert res.tokens == eos_ref[:eos_k + 1], (mode, n)


@pytest.mark.parametrize("arch,n,colocate", [("llama", 3, False), ("qwen2", 4, True), ("qwen3", 2, False)])
def test_static_steps_are_lossless(arch, n, colocate, one_thread, monkeypatch):
    """--step-mode static runs the CUDA-graph path's code (static buffers, device-side positions
    and masks, one PDM step per row count) without capture. Its steps attend over a masked length
    bucket (other sums than the eager steps), so its greedy decoding, the pp baseline on the same
    steps, equals eager greedy decoding up to near-ties; SPD on the static steps equals that
    greedy decoding token for token, with the tick counts of the formula."""
    from spd_engine.engine.model.graphs import PDMStep, VerifyStep

    rows_run, verified = set(), []  # the row counts of the PDM steps that really ran; static verifications
    run, verify = PDMStep.run, VerifyStep.run
    monkeypatch.setattr(PDMStep, "run", lambda self, pos, rows: rows_run.add(self.rows) or run(self, pos, rows))
    monkeypatch.setattr(VerifyStep, "run", lambda self, h: verified.append(1) or verify(self, h))
    _, prompts, refs = setup(arch, n, colocate)
    ecfg = tiny_engine_config(arch, n, colocate, step_mode="static")
    V = ecfg.model.cfg.vocab_size
    with ReferenceExecutor(tiny_engine_config(arch, n, mode="pp", step_mode="static")) as ex:
        static_refs = [ex.generate(p, NEW).tokens for p in prompts[:3]]
    model = full_model(ecfg)
    for p, sref, ref in zip(prompts, static_refs, refs):
        assert_greedy_agrees(sref, ref, teacher_forced(model, p, ref), STATIC_LOGIT_BOUND, "static vs eager greedy")
    with ReferenceExecutor(ecfg) as ex:
        assert ex.driver.step_mode == "static"
        for k, (p, ref) in enumerate(zip(prompts[:3], static_refs)):
            policy = Policy(ref, len(p), V, wrong=FORCED[k % 2])
            res = ex.generate(p, NEW, (), draft_policy=policy)
            check_run(res, ref, policy, n)
            assert ex.generate(p, NEW).tokens == ref  # the head's own drafts
        assert sorted(ex.driver.pdm_steps) == list(range(1, n + 2))  # built (prepared) when the driver starts
        assert sorted(rows_run) == list(range(1, n + 2))  # and every one ran: fills 1..n, with and without pending
        assert len(verified) > 0  # T=0 verification went through the static step


def test_step_mode_is_validated_and_auto_resolves_by_device():
    assert tiny_engine_config("llama", 2).resolved_step_mode() == "eager"
    assert tiny_engine_config("llama", 2, device="cuda").resolved_step_mode() == "graph"
    with pytest.raises(ValueError, match="step mode"):
        tiny_engine_config("llama", 2, step_mode="fast")


@pytest.mark.parametrize("mode,n,colocate", [("spd", 3, False), ("spd", 2, True), ("pp", 2, True)])
def test_on_token_false_stops_the_request_and_the_next_is_unaffected(mode, n, colocate, one_thread):
    """Cancellation: on_token returning False ends the request right after that token; the
    pipeline drains as at any end, so the next request on the same ranks is still lossless."""
    ecfg = tiny_engine_config("llama", n, colocate, mode=mode)
    prompts, refs = prompts_and_refs("llama")
    seen: list[int] = []

    def stop_after_five(token: int) -> bool:
        seen.append(token)
        return len(seen) < 5

    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompts[1], NEW, (), on_token=stop_after_five)
        assert res.tokens == refs[1][:5] == seen
        again = ex.generate(prompts[2], NEW, ())
        assert again.tokens == refs[2]
        first = ex.generate(prompts[1], NEW, (), on_token=lambda t: False)  # stop at the prefill token
        assert first.tokens == refs[1][:1] and first.ticks == 0
        assert ex.generate(prompts[3], NEW, ()).tokens == refs[3]


@pytest.mark.parametrize("step_mode", ["eager", "static"])
def test_a_request_alone_is_a_batch_of_one_on_the_static_steps(step_mode, one_thread):
    """Driver.generate runs the one decode loop: a request alone takes slot 0, its decode entries
    travel as one-row BATCH messages (never TOKEN), and with static steps stage 0 steps each plain
    token on its static step and the driver drafts on its static PDM steps. Lossless through
    forced rejections."""
    ecfg = tiny_engine_config("llama", 3, True, step_mode=step_mode)
    _, prompts, refs = setup("llama", 3, True)
    with ReferenceExecutor(ecfg) as ex:
        driver = ex.driver
        kinds, slots, static_steps, pdm_steps = [], [], [0], [0]
        send = driver.stage0.send

        def spy(hdr, payloads=(), **kw):
            kinds.append(hdr.kind)
            if hdr.kind == Kind.BATCH:
                slots.append(payloads[0][:, 0].tolist())  # each row's request slot
            return send(hdr, payloads, **kw)

        def counting(step, counter: list[int]) -> None:
            run = step.run

            def counted(*args, **kw):
                counter[0] += 1
                return run(*args, **kw)
            step.run = counted

        driver.stage0.send = spy
        stage0 = driver.stage0.local
        if step_mode == "static":
            counting(stage0.static, static_steps)
            for step in driver.pdm_steps.values():
                counting(step, pdm_steps)
        p, ref = prompts[3], refs[3]
        policy = Policy(ref, len(p), ecfg.model.cfg.vocab_size, wrong=FORCED[0])
        res = ex.generate(p, NEW, (), draft_policy=policy)
        check_run(res, ref, policy, 3)
    assert Kind.TOKEN not in kinds and Kind.PREFILL in kinds and Kind.END in kinds
    assert len(slots) == res.ticks and all(s == [0] for s in slots)
    if step_mode == "static":
        assert static_steps[0] == res.ticks and pdm_steps[0] == res.ticks
    else:
        assert stage0.static is None and not driver.pdm_steps


def test_colocated_driver_reads_an_arrived_exit_before_the_pdm(one_thread):
    """The exit is read before the PDM when it has already arrived (docs/design.md 3.3): stage 0
    (inline on the driver) is padded to 15 ms and stage 1 is not, so stage 1's exit of a full tick
    is in by the time stage 0's step returns, and the tick's read of it comes before its PDM."""
    ecfg = tiny_engine_config("llama", 2, True, stage_ms=(15.0, 0.0), trace=True)
    _, prompts, refs = setup("llama", 2, True)
    events: list[tuple[str, int]] = []  # ("exit" | "pdm", tick) in the order they happened
    with ReferenceExecutor(ecfg) as ex:
        loop, lane = ex.driver.batch, ex.driver.lane
        pump, drafts = loop.links.pump, lane.drafts

        def pump_spy(s, tick):
            if s == 1:
                events.append(("exit", loop.tick))
            return pump(s, tick)

        def drafts_spy(req, plan):
            events.append(("pdm", loop.tick))
            return drafts(req, plan)

        loop.links.pump, lane.drafts = pump_spy, drafts_spy
        res = ex.generate(prompts[0], 12, ())
    assert res.tokens == refs[0][:12]
    full = sorted({t for (what, t) in events if what == "exit"} & {t for (what, t) in events if what == "pdm"})
    assert len(full) == 11
    early = [t for t in full if events.index(("exit", t)) < events.index(("pdm", t))]
    # a thread the host delays can miss one tick; a driver that never reads early misses them all
    assert len(early) >= len(full) - 2, (early, full)
