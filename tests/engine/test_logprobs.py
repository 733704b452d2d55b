"""Log-probabilities of the committed tokens (Driver.generate(top_logprobs=k)): taken from the raw
logits each token's verification used, they equal a plain forward pass of the target over the prompt
and the output within 1e-4, at n = 2 and n = 4, with suffix runs (their rows verified together),
with the last stage computing the argmax, with branch chains and forced rejections, at T > 0 and
with several requests in one pipeline."""
from __future__ import annotations

import pytest
import torch
from helpers import Policy, full_model, random_prompts, reference, tiny_engine_config

from spd_engine.engine.protocol.drafting import SUFFIX_RUN
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 40
TOP = 3


def plain_log_probs(ecfg, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p [len(tokens), V]: one forward of the whole target over prompt + tokens."""
    model = full_model(ecfg)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        h, _ = model.forward_layers(model.embed(ids), model.new_cache(1, ids.shape[1]), 0)
        logits = model.logits(h)[0]
    return torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def check(ecfg, res, prompt: list[int], greedy: bool = True, top: int = TOP) -> None:
    assert len(res.logprobs) == len(res.tokens)
    want = plain_log_probs(ecfg, prompt, res.tokens)
    for k, (token, logprob, alts) in enumerate(res.logprobs):
        assert token == res.tokens[k]
        assert abs(logprob - float(want[k, token])) < 1e-4, k
        best = want[k].topk(top)
        assert [i for i, _ in alts] == best.indices.tolist(), k
        assert max((abs(lp - float(w)) for (_, lp), w in zip(alts, best.values)), default=0) < 1e-4, k
        if greedy and top:
            assert alts[0] == (token, logprob)  # T = 0: the committed token is the likeliest


@pytest.mark.parametrize("n,verify_at", [(2, "driver"), (2, "last"), (4, "driver"), (4, "last")])
def test_logprobs_equal_a_plain_forward_pass_with_suffix_runs(n, verify_at, one_thread):
    ecfg = tiny_engine_config("llama", n, n == 2, verify_at=verify_at, suffix_run=4, suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, [12], seed=1)[0] * 3  # a repeated prompt: long suffix matches
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, top_logprobs=TOP)
        plain = ex.generate(prompt, NEW)
    assert res.tokens == plain.tokens == reference(ecfg, prompt, NEW) and plain.logprobs == []
    assert res.by_source.get(SUFFIX_RUN, [0, 0, 0])[1] > 5  # run tokens travelled and were verified
    check(ecfg, res, prompt)


@pytest.mark.parametrize("n", [2, 4])
def test_logprobs_with_forced_rejections_and_branch_chains(n, one_thread):
    for branches in (1, 2):
        ecfg = tiny_engine_config("llama", n, branches=branches)
        prompt = random_prompts(ecfg.model.cfg, [19], seed=3)[0]
        want = reference(ecfg, prompt, NEW)
        policy = Policy(want, len(prompt), ecfg.model.cfg.vocab_size, wrong=frozenset({1, 9, 10, NEW - 1}))
        with ReferenceExecutor(ecfg) as ex:
            res = ex.generate(prompt, NEW, (), draft_policy=policy if branches == 1 else None, top_logprobs=TOP)
        assert res.tokens == want and res.rejections > 0
        assert (res.branch_points > 0) == (branches == 2)  # branch points verified their candidates
        check(ecfg, res, prompt)


@pytest.mark.parametrize("n", [2, 4])
def test_logprobs_at_temperature_above_0_and_in_a_batch(n, one_thread):
    """T > 0 (suffix runs on) and several requests in one pipeline: the raw target's, as at T = 0."""
    ecfg = tiny_engine_config("llama", n, suffix_run=4, suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, [12], seed=1)[0] * 3
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3)
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, sampling=sp, top_logprobs=TOP)
        assert res.tokens == ex.generate(prompt, NEW, sampling=sp).tokens  # asking changes nothing
    assert res.tokens != reference(ecfg, prompt, NEW)  # sampled, not the argmax
    check(ecfg, res, prompt, greedy=False)
    ecfg = tiny_engine_config("llama", n)
    prompts = random_prompts(ecfg.model.cfg, [12, 5], seed=2)
    reqs = [BatchRequest(prompts[0], NEW, (), sp, top_logprobs=TOP), BatchRequest(prompts[1], NEW, (), top_logprobs=0)]
    with ReferenceExecutor(ecfg) as ex:
        out = ex.generate_batch(reqs, max_batch=2)
        alone = [ex.generate(r.prompt, NEW, sampling=r.sampling).tokens for r in reqs]
    assert [r.tokens for r in out.results] == alone and alone[1] == reference(ecfg, prompts[1], NEW)
    check(ecfg, out.results[0], prompts[0], greedy=False)
    check(ecfg, out.results[1], prompts[1], top=0)


# ---- the real model ----

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(engine checkpoint dir, model config, full model, tokenizer) of SmolLM2-135M-Instruct."""
    from helpers import load_smollm2

    return load_smollm2()


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_logprobs_equal_a_plain_forward_pass_on_smollm2(n, smollm2, one_thread):
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime

    engine_dir, cfg, full, tok = smollm2
    ecfg = RunConfig(model=ModelSpec(source=str(engine_dir), cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n), threads=1),
                     runtime=Runtime(capacity=160, prefill_chunk=16, timeout_s=120.0))
    prompt = tok.chat_ids("List the days of the week, then list them again.")
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, 24, cfg.eos_token_ids, top_logprobs=TOP)
    ids = torch.tensor([prompt + res.tokens])
    with torch.no_grad():
        h, _ = full.forward_layers(full.embed(ids), full.new_cache(1, ids.shape[1]), 0)
        want = torch.log_softmax(full.logits(h)[0].double(), dim=-1)[len(prompt) - 1:]
    assert len(res.logprobs) == len(res.tokens) > 0
    for k, (token, logprob, top) in enumerate(res.logprobs):
        assert abs(logprob - float(want[k, token])) < 1e-4, (k, logprob, float(want[k, token]))
        assert [i for i, _ in top] == want[k].topk(TOP).indices.tolist() and top[0][0] == token
