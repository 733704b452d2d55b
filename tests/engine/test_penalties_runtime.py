"""Penalties and min_tokens through the runtime, token for token: SPD with a processing request
equals plain decoding that applies the same processing (engine/protocol/logits_processing.py) to
the full target's logits at every position, at T = 0 with the driver or the last stage verifying,
with suffix runs, branch chains, forced rejections, several requests in one pipeline
(BatchDriver), and at T > 0 with top-k 1 (greedy in disguise) and on the first token's keyed draw.
Every case also checks that the processing changed the output, so it could not pass unprocessed."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch
from helpers import Policy, full_model, random_prompts, reference, tiny_engine_config

from spd_engine.engine.model.greedy import prefill
from spd_engine.engine.protocol.drafting import SUFFIX_RUN
from spd_engine.engine.protocol.logits_processing import TokenHistory
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 32
PENALTIES = SamplingParams(repetition_penalty=1.6, frequency_penalty=0.4, presence_penalty=0.3)


@torch.no_grad()
def processed_generate(ecfg, prompt: Sequence[int], max_new: int, sp: SamplingParams, eos: Sequence[int] = (),
                       model=None) -> list[int]:
    """Plain decoding on the full target (`model`, default helpers.full_model): each position's logits
    processed with the request's history, then the argmax (T = 0) or the keyed "target" draw from
    target_probs (T > 0)."""
    model = model if model is not None else full_model(ecfg)
    before = torch.get_num_threads()
    torch.set_num_threads(ecfg.parallel.threads or before)  # as helpers.reference: the ranks' BLAS bits
    try:
        cache = model.new_cache(1, len(prompt) + max_new)
        h = prefill(model, cache, prompt, ecfg.runtime.prefill_chunk)  # [H]
        hist = TokenHistory(sp, prompt, eos)
        out: list[int] = []
        for pos in range(len(prompt), len(prompt) + max_new):
            logits = hist.process(model.logits(h), pos)  # [V]
            tok = int(logits.argmax()) if sp.greedy else \
                sample(target_probs(logits, sp), keyed_generator(sp.seed, pos, "target"))
            out.append(tok)
            hist.extend([tok])
            if tok in eos or len(out) == max_new:
                break
            h = model.forward_layers(model.embed(torch.tensor([[tok]])), cache, pos)[0][0, -1]
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n,verify_at", [(2, "driver"), (2, "last"), (3, "driver")])
def test_penalties_equal_plain_processed_decoding(n, verify_at, one_thread):
    ecfg = tiny_engine_config("llama", n, n == 2, verify_at=verify_at)
    prompt = random_prompts(ecfg.model.cfg, [14], seed=5)[0]
    want = processed_generate(ecfg, prompt, NEW, PENALTIES)
    assert want != reference(ecfg, prompt, NEW)  # the penalties change the output
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, sampling=PENALTIES, top_logprobs=2)
        plain = ex.generate(prompt, NEW)  # the next request is unprocessed again
    assert res.tokens == want
    assert plain.tokens == reference(ecfg, prompt, NEW)
    assert len(res.logprobs) == NEW and res.verified == NEW - 1


def test_min_tokens_hold_eos_back(one_thread):
    ecfg = tiny_engine_config("llama", 2)
    prompt = random_prompts(ecfg.model.cfg, [9], seed=2)[0]
    plain = reference(ecfg, prompt, NEW)
    eos = [plain[3]]  # ends the unprocessed request at its fourth token
    sp = SamplingParams(min_tokens=12)
    want = processed_generate(ecfg, prompt, NEW, sp, eos)
    assert len(want) >= 12 and eos[0] not in want[:11]
    with ReferenceExecutor(ecfg) as ex:
        assert ex.generate(prompt, NEW, eos).tokens == reference(ecfg, prompt, NEW, eos) == plain[:4]
        assert ex.generate(prompt, NEW, eos, sampling=sp).tokens == want


@pytest.mark.parametrize("n", [2, 4])
def test_penalties_with_suffix_runs(n, one_thread):
    """A run's rows verified one by one, each with the run's tokens before it as output."""
    ecfg = tiny_engine_config("llama", n, n == 2, verify_at="last", suffix_run=4, suffix_min_match=1)
    prompt = random_prompts(ecfg.model.cfg, [12], seed=1)[0] * 3  # repeated: long suffix matches
    sp = SamplingParams(repetition_penalty=1.15, frequency_penalty=0.05)  # mild: runs still match
    want = processed_generate(ecfg, prompt, NEW, sp)
    assert want != reference(ecfg, prompt, NEW)
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, sampling=sp)
    assert res.tokens == want
    assert res.by_source.get(SUFFIX_RUN, [0, 0, 0])[1] > 0  # run tokens were verified


@pytest.mark.parametrize("branches", [1, 2])
def test_penalties_with_rejections_and_branch_chains(branches, one_thread):
    ecfg = tiny_engine_config("llama", 3, branches=branches)
    prompt = random_prompts(ecfg.model.cfg, [19], seed=3)[0]
    want = processed_generate(ecfg, prompt, NEW, PENALTIES)
    policy = Policy(want, len(prompt), ecfg.model.cfg.vocab_size, wrong=frozenset({1, 9, 10, NEW - 1}))
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, NEW, draft_policy=policy if branches == 1 else None, sampling=PENALTIES)
    assert res.tokens == want and res.rejections > 0
    assert (res.branch_points > 0) == (branches == 2)


@pytest.mark.parametrize("kw", [{}, dict(verify_at="last", suffix_run=4, suffix_min_match=1)], ids=["driver", "last-runs"])
def test_penalties_in_a_batch(kw, one_thread):
    """Several requests in one pipeline (BatchDriver), processed and plain side by side; with the
    last stage replying argmaxes (unused for processed requests) and suffix runs."""
    ecfg = tiny_engine_config("llama", 2, bool(kw), **kw)
    prompts = random_prompts(ecfg.model.cfg, [14, 7, 11], seed=5)
    prompts[1] = prompts[1] * 3  # repeated: suffix matches
    params = [PENALTIES, SamplingParams(), SamplingParams(min_tokens=5, presence_penalty=-0.5)]
    eos = [reference(ecfg, prompts[2], 3)[-1]]
    reqs = [BatchRequest(p, NEW, eos, sp, top_logprobs=1) for p, sp in zip(prompts, params)]
    wants = [processed_generate(ecfg, p, NEW, sp, eos) for p, sp in zip(prompts, params)]
    assert wants[0] != reference(ecfg, prompts[0], NEW, eos) and wants[2] != reference(ecfg, prompts[2], NEW, eos)
    with ReferenceExecutor(ecfg) as ex:
        out = ex.generate_batch(reqs, max_batch=3)
    assert [r.tokens for r in out.results] == wants
    assert [len(r.logprobs) for r in out.results] == [len(w) for w in wants]
    runs = sum(r.by_source.get(SUFFIX_RUN, [0, 0, 0])[1] for r in out.results)
    assert (runs > 0) == bool(kw)  # run tokens verified in the batch


def test_sampled_penalties_top_k_1_and_the_first_draw(one_thread):
    """T > 0: top-k 1 leaves the processed argmax, so the output is the greedy processed one; an
    unfiltered request's first token is the plain sampler's keyed draw from the processed p."""
    ecfg = tiny_engine_config("llama", 2)
    prompt = random_prompts(ecfg.model.cfg, [10], seed=4)[0]
    top1 = dataclasses.replace(PENALTIES, temperature=0.9, top_k=1, seed=11)
    want = processed_generate(ecfg, prompt, NEW, dataclasses.replace(PENALTIES))
    sampled = [dataclasses.replace(PENALTIES, temperature=1.0, seed=s, min_tokens=4) for s in range(4)]
    with ReferenceExecutor(ecfg) as ex:
        assert ex.generate(prompt, NEW, sampling=top1).tokens == want
        firsts = [ex.generate(prompt, 1, sampling=sp).tokens for sp in sampled]
    assert firsts == [processed_generate(ecfg, prompt, 1, sp) for sp in sampled]


def test_other_modes_refuse_penalties():
    ecfg = tiny_engine_config("llama", 2, mode="pp")
    with ReferenceExecutor(ecfg) as ex:
        with pytest.raises(ValueError, match="--mode spd"):
            ex.generate([5, 6, 7], 4, sampling=SamplingParams(repetition_penalty=1.2))
        assert ex.generate([5, 6, 7], 4).tokens == reference(ecfg, [5, 6, 7], 4)


# ---- the real model ----

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(engine checkpoint dir, model config, full model, tokenizer) of SmolLM2-135M-Instruct."""
    from helpers import load_smollm2

    return load_smollm2()


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])  # n = 4: drafts accepted
def test_penalties_on_smollm2(n, smollm2, one_thread):
    """With the head the repository ships for n (drafts accepted at n = 4), min_tokens past an early
    end of the unprocessed reply."""
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import Drafting, ModelSpec, ParallelLayout, RunConfig, Runtime
    from spd_engine.tools.model_args import default_head

    engine_dir, cfg, full, tok = smollm2
    ecfg = RunConfig(model=ModelSpec(source=str(engine_dir), cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n), threads=1),
                     drafting=Drafting(pdm=default_head("smollm2-135m", n)),
                     runtime=Runtime(capacity=160, prefill_chunk=16, timeout_s=120.0))
    prompt = tok.chat_ids("What is 2+2? Reply with the number only.")  # 8 tokens, EOS last
    eos = cfg.eos_token_ids
    sp = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=12)
    want = processed_generate(ecfg, prompt, 24, sp, eos, model=full)
    plain = processed_generate(ecfg, prompt, 24, SamplingParams(), eos, model=full)
    assert len(plain) < 12 <= len(want) and want[:len(plain) - 1] != plain[:-1]  # processing changed it
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, 24, eos, sampling=sp)
    assert res.tokens == want
    assert n == 2 or res.accepted > 0  # the trained head's drafts were verified against the penalised logits


# ---- spd generate ----

def test_generate_flags_reach_the_sampling(capsys):
    from spd_engine.tools.cli import main

    args = ["generate", "--model", "random:tiny-llama", "--capacity", "64", "--prompt", "hi", "--max-new-tokens", "4"]
    assert main([*args, "--presence-penalty", "3"]) != 0
    assert "presence_penalty must be in [-2, 2]" in capsys.readouterr().err  # refused before any model loads
    assert main([*args, "--mode", "ar", "--stages", "1", "--repetition-penalty", "1.2", "--min-tokens", "2"]) != 0
    assert "--mode spd" in capsys.readouterr().err  # the baselines do not apply them
