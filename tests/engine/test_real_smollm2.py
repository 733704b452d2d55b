"""SPD on the real SmolLM2-135M-Instruct (converted from its GGUF into the engine layout): the
output equals the greedy decoder's on chat prompts with the untrained head and with forced
rejections, on the reference executor at n = 2 (3 and 4 with the slow tests) and on one distributed
n = 4 run. The wider matrix (more prompts, 64 tokens, co-located driver, oracle drafts) and the
shipped head at W = 2 are marked slow."""
from __future__ import annotations

import functools

import pytest
import torch
from helpers import Policy, check_run  # noqa: F401
from near_ties import assert_greedy_agrees, teacher_forced

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import Drafting, ModelSpec, ParallelLayout, RunConfig, Runtime

CHUNK = 16  # chat prompts are ~40 tokens: several prefill chunks
PROMPTS = ["Write a short poem about the sea.",
           "Explain how a bicycle works.",  # its answer ends with an EOS after 25 tokens
           "List five fruits and describe each one briefly.",
           "What are the benefits of learning a second language?",
           "Describe the water cycle to a ten year old."]
NEW = 32


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(engine checkpoint dir, model config, full model, tokenizer) of SmolLM2-135M-Instruct."""
    from helpers import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def refs(smollm2):
    """text -> (prompt ids, greedy output) for a number of new tokens, computed once."""
    engine_dir, cfg, full, tok = smollm2

    @functools.lru_cache(maxsize=None)
    def ref(text: str, max_new: int) -> tuple[list[int], list[int]]:
        prompt = tok.chat_ids(text)
        torch.set_num_threads(1)
        return prompt, greedy_generate(full, prompt, max_new, eos_ids=cfg.eos_token_ids, chunk=CHUNK)
    return ref


def engine_config(smollm2, n: int, colocate: bool = False, branches: int = 1) -> RunConfig:
    """W = 1 unless asked: the tick formulas these tests check are W = 1's."""
    engine_dir, cfg, _, _ = smollm2
    return RunConfig(model=ModelSpec(source=str(engine_dir), cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n, colocate=colocate), threads=1),
                     drafting=Drafting(branches=branches),
                     runtime=Runtime(capacity=160, prefill_chunk=CHUNK, timeout_s=120.0))


def run(runtime, smollm2, refs, n: int, text: str, max_new: int, **policy_kw) -> None:
    cfg = smollm2[1]
    prompt, want = refs(text, max_new)
    policy = Policy(want, len(prompt), cfg.vocab_size, **policy_kw)
    res = runtime.generate(prompt, max_new, cfg.eos_token_ids, draft_policy=policy)
    check_run(res, want, policy, n)


# The untrained head rejects nearly every draft (about n ticks per token): 32 tokens at n=2, 16 above.
# n = 3 and 4 run with the slow tests (n = 4's forced rejections also run distributed below).
@pytest.mark.parametrize("n,untrained_tokens", [(2, NEW), pytest.param(3, 16, marks=pytest.mark.slow),
                                                pytest.param(4, 16, marks=pytest.mark.slow)],
                         ids=["n2", "n3", "n4"])
def test_reference_executor_is_lossless_on_smollm2(n, untrained_tokens, smollm2, refs, one_thread):
    eos = smollm2[1].eos_token_ids
    assert len(refs(PROMPTS[1], NEW)[1]) < NEW and refs(PROMPTS[1], NEW)[1][-1] in eos  # EOS in the pipeline
    with ReferenceExecutor(engine_config(smollm2, n)) as ex:
        run(ex, smollm2, refs, n, PROMPTS[n % 2], untrained_tokens, oracle=False)
        run(ex, smollm2, refs, n, PROMPTS[1], NEW, wrong=frozenset({1, 10, 11, 24}))  # 24: the token before EOS
        if n > 2:
            run(ex, smollm2, refs, n, PROMPTS[0], NEW, wrong=frozenset({2, 3, NEW - 1}))


@pytest.mark.multiproc
def test_distributed_n4_with_forced_rejections_on_smollm2(smollm2, refs, one_thread):
    with launch(engine_config(smollm2, 4)) as runtime:
        run(runtime, smollm2, refs, 4, PROMPTS[1], NEW, wrong=frozenset({1, 12, 13, 24}))


@pytest.mark.slow
@pytest.mark.parametrize("n,colocate", [(2, False), (3, False), (4, False), (4, True)],
                         ids=["n2", "n3", "n4", "n4-colocated"])
def test_wider_matrix_on_smollm2(n, colocate, smollm2, refs, one_thread):
    with ReferenceExecutor(engine_config(smollm2, n, colocate)) as ex:
        for text in PROMPTS:
            for kw in (dict(oracle=False), {}, dict(wrong=frozenset({1, 2, 30, 63}))):
                run(ex, smollm2, refs, n, text, 64, **kw)


@pytest.mark.slow
@pytest.mark.multiproc
def test_distributed_colocated_oracle_and_untrained_on_smollm2(smollm2, refs, one_thread):
    with launch(engine_config(smollm2, 4, colocate=True)) as runtime:
        for text in PROMPTS[:3]:
            run(runtime, smollm2, refs, 4, text, 64)
            run(runtime, smollm2, refs, 4, text, 64, oracle=False)


def shipped_head_config(smollm2, colocate: bool = False) -> RunConfig:
    from spd_engine.tools.model_args import default_head

    head = default_head("smollm2-135m", 4)
    assert head != "random", "the repository ships a trained head for smollm2-135m at n=4"
    return engine_config(smollm2, 4, colocate).replace(pdm=head)


def test_shipped_head_is_lossless_and_accepts_drafts(smollm2, refs, one_thread):
    """The trained head's own drafts (no policy): greedy output token for token, and some accepted
    (losslessness does not depend on the head; acceptance shows the head is really drafting)."""
    eos = smollm2[1].eos_token_ids
    accepted = verified = 0
    with ReferenceExecutor(shipped_head_config(smollm2)) as ex:
        for text in PROMPTS[:3]:
            prompt, want = refs(text, NEW)
            res = ex.generate(prompt, NEW, eos)
            assert res.tokens == want, text
            accepted, verified = accepted + res.accepted, verified + res.verified
    assert verified > 0 and accepted / verified > 0.1, (accepted, verified)


@pytest.mark.slow  # W = 2 on the tiny models in the default run (test_branches_runtime.py)
def test_shipped_head_with_branches_is_lossless_and_ticks_as_the_exact_replay(smollm2, refs, one_thread):
    """W = 2 at refill with the shipped head and suffix drafts: greedy output token for
    token, and the exact T=0 replay with branch width (the fast executor of spd eval) predicts the
    runtime's ticks and branch counters."""
    from spd_engine.train.evaluate import FastRunner

    eos = smollm2[1].eos_token_ids
    ecfg = shipped_head_config(smollm2).replace(branches=2)
    fast = FastRunner(ecfg)
    full = fast.target
    points = 0
    with ReferenceExecutor(ecfg) as ex:
        for text in PROMPTS[:2]:
            prompt, want = refs(text, NEW)
            res = ex.generate(prompt, NEW, eos)
            # W-row chain steps: greedy's tokens up to a near-tie (docs/testing.md); counts where equal
            if assert_greedy_agrees(res.tokens, want, teacher_forced(full, prompt, want), 2e-4, text) is None:
                replay = fast.run(prompt, NEW, eos).acceptance
                assert (res.ticks, res.verified, res.accepted) == (replay.ticks, replay.verified, replay.accepted), text
            points += res.branch_points
    assert points > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_shipped_head_distributed_is_lossless(smollm2, refs, one_thread):
    eos = smollm2[1].eos_token_ids
    for colocate in (False, True):
        with launch(shipped_head_config(smollm2, colocate)) as runtime:
            for text in PROMPTS:
                prompt, want = refs(text, 64)
                assert runtime.generate(prompt, 64, eos).tokens == want, (text, colocate)


@pytest.mark.parametrize("B", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_several_requests_at_once_agree_with_greedy_on_smollm2(B, smollm2, refs, one_thread):
    """Four chat requests at B = 4 (B = 2 with the slow tests), n = 2 co-located: each request's
    output is its greedy one up to a near-tie (a step over several rows multiplies them as one
    matrix: other rounding than a one-row step; docs/design.md 3.12). Counted: the test fails if
    more than one request parts."""
    from spd_engine.engine.runtime.batch_driver import BatchRequest

    engine_dir, cfg, full, tok = smollm2
    texts = [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4]]
    reqs = [BatchRequest(refs(t, 24)[0], 24, cfg.eos_token_ids, arrival_tick=1 + 5 * i) for i, t in enumerate(texts)]
    with ReferenceExecutor(engine_config(smollm2, 2, colocate=True)) as ex:
        out = ex.generate_batch(reqs, B)
    assert max(out.rows) >= B  # every request's entry in one step (a suffix run's: a row per token)
    parted = 0
    for r, t, res in zip(reqs, texts, out.results):
        want = refs(t, 24)[1]
        k = assert_greedy_agrees(res.tokens, want, teacher_forced(full, r.prompt, want), 2e-4, t)
        parted += k is not None
    assert parted <= 1, f"B={B}: {parted} of {len(reqs)} requests parted from greedy at near-ties"
