"""vLLM's penalties and min_tokens, and log-probabilities at T > 0 and with --max-batch 2, through
real `spd serve` processes and the official `openai` client: a penalised greedy reply equals plain
decoding that applies the same processing (streamed or not, alone or as n = 2 choices in one
pipeline); log-probabilities of sampled replies equal a plain forward pass within 1e-4; bad values
are a 400 naming the field."""
from __future__ import annotations

import openai
import pytest
import torch
from test_penalties_runtime import processed_generate

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime
from spd_engine.server.process import ServerProcess

pytestmark = pytest.mark.multiproc
TINY = "random:tiny-llama"
TINY_ARGS = ["--model", TINY, "--stages", "2", "--threads", "1", "--capacity", "512", "--prefill-chunk", "16"]
CFG = PRESETS["tiny-llama"]
ECFG = RunConfig(model=ModelSpec(source=TINY, cfg=CFG),
                 parallel=ParallelLayout(topology=Topology.build(CFG.num_layers, 2), threads=1),
                 runtime=Runtime(capacity=512, prefill_chunk=16))
PROMPT = [8, 9, 10, 11, 9, 8]
PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3)
VLLM_EXTRAS = dict(repetition_penalty=1.5, min_tokens=6)
SP = SamplingParams(**PENALTIES, **VLLM_EXTRAS)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split()]


@pytest.fixture(scope="module")
def tiny():
    server = ServerProcess(TINY_ARGS)
    yield server
    assert server.close() == 0, server.stderr()[-3000:]


@pytest.fixture(scope="module")
def tiny_batch():
    server = ServerProcess([*TINY_ARGS, "--max-batch", "2"])
    yield server
    assert server.close() == 0, server.stderr()[-3000:]


def log_probs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p [len(tokens), V] of one forward pass of the server's model over prompt + tokens."""
    from helpers import full_model

    model = full_model(ECFG)
    x = torch.tensor([prompt + tokens])
    with torch.no_grad():
        h, _ = model.forward_layers(model.embed(x), model.new_cache(1, x.shape[1]), 0)
        logits = model.logits(h)[0]  # [T, V]
    return torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def check_logprobs(choice, prompt: list[int]) -> None:
    lp, tokens = choice.logprobs, ids(choice.text)
    assert [int(t) for t in lp.tokens] == tokens and len(tokens) > 0
    want = log_probs(prompt, tokens)
    for k, token in enumerate(tokens):
        assert abs(lp.token_logprobs[k] - float(want[k, token])) < 1e-4, k
        top = want[k].topk(len(lp.top_logprobs[k]))
        assert list(lp.top_logprobs[k]) == [f"{i} " for i in top.indices.tolist()], k
        assert max(abs(a - float(b)) for a, b in zip(lp.top_logprobs[k].values(), top.values)) < 1e-4, k


@pytest.mark.parametrize("server", ["tiny", "tiny_batch"])
def test_penalised_greedy_reply_equals_plain_processed_decoding(server, request):
    srv = request.getfixturevalue(server)
    want = processed_generate(ECFG, PROMPT, 20, SP, CFG.eos_token_ids)
    plain = processed_generate(ECFG, PROMPT, 20, SamplingParams(), CFG.eos_token_ids)
    assert want != plain  # the processing changes the reply
    c = client(srv)
    got = c.completions.create(model=TINY, prompt=PROMPT, max_tokens=20, temperature=0, n=2, **PENALTIES,
                               extra_body=VLLM_EXTRAS)
    assert [ids(ch.text) for ch in got.choices] == [want, want]  # with B = 2 the choices share the pipeline
    streamed = c.completions.create(model=TINY, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                    **PENALTIES, extra_body=VLLM_EXTRAS)
    assert ids("".join(chunk.choices[0].text for chunk in streamed)) == want
    again = c.completions.create(model=TINY, prompt=PROMPT, max_tokens=20, temperature=0)
    assert ids(again.choices[0].text) == plain  # the next request is unprocessed


@pytest.mark.parametrize("server", ["tiny", "tiny_batch"])
def test_sampled_logprobs_equal_a_forward_pass(server, request):
    """T > 0, penalties on, n = 2 (with B = 2 both choices in the pipeline at once): the raw target's."""
    got = client(request.getfixturevalue(server)).completions.create(
        model=TINY, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=4, n=2, logprobs=3, **PENALTIES)
    assert ids(got.choices[0].text) != ids(got.choices[1].text)  # two draws
    for choice in got.choices:
        check_logprobs(choice, PROMPT)


BAD = [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
       (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
       (dict(extra_body={"repetition_penalty": "1.2"}), "repetition_penalty"),
       (dict(extra_body={"min_tokens": -1}), "min_tokens"), (dict(extra_body={"min_tokens": 9}), "min_tokens")]


@pytest.mark.parametrize("kwargs,param", BAD, ids=[p for _, p in BAD])
def test_bad_penalty_or_min_tokens_is_a_400_naming_it(tiny, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client(tiny).completions.create(**{"model": TINY, "prompt": PROMPT, "max_tokens": 8, **kwargs})
    assert info.value.param == param, info.value.message
    ok = client(tiny).completions.create(model=TINY, prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(ids(ok.choices[0].text)) == 2  # the engine goes on
