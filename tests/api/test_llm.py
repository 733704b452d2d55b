"""The Python API (`from spd_engine import LLM, SamplingParams`): token for token the greedy
reference on processes, alone and several requests at once; stop strings, per-prompt parameters,
vLLM's prompt forms; every bad option or prompt a ValueError naming it, before any rank starts."""
from __future__ import annotations

import pytest
from helpers import random_prompts, reference

from spd_engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from spd_engine.api.llm import engine_argv, engine_parser

pytestmark = pytest.mark.multiproc
TINY = "random:tiny-llama"
OPTIONS = dict(stages=2, threads=1, suffix_run=1, prefill_chunk=16)
NEW = 14


@pytest.fixture(scope="module")
def llm():
    with LLM(TINY, **OPTIONS) as model:
        yield model


def test_generate_equals_greedy_decoding(llm):
    prompts = random_prompts(llm.config.model.cfg, [3, 9], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    for prompt, out in zip(prompts, outs):
        reply = out.outputs[0]
        assert isinstance(reply, CompletionOutput) and out.prompt_token_ids == prompt
        assert reply.token_ids == reference(llm.config, prompt, NEW)
        assert reply.text == "".join(f"{t} " for t in reply.token_ids)  # no tokenizer: ids as text
        assert reply.finish_reason == "length" and out.metrics["ticks"] >= NEW


def test_prompt_forms_and_per_prompt_parameters(llm):
    ids = random_prompts(llm.config.model.cfg, [4], seed=6)[0]
    one = llm.generate(ids, SamplingParams(max_tokens=5))
    assert len(one) == 1 and one[0].outputs[0].token_ids == reference(llm.config, ids, 5)
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "hi"}, "hi"],
                        [SamplingParams(max_tokens=3), SamplingParams(max_tokens=6), SamplingParams(max_tokens=6)])
    assert outs[0].outputs[0].token_ids == reference(llm.config, ids, 3)
    assert outs[1].prompt == "hi" and outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert len(outs[1].outputs[0].token_ids) == 6


def test_a_stop_string_ends_the_reply_before_it(llm):
    ids = random_prompts(llm.config.model.cfg, [6], seed=7)[0]
    ref = reference(llm.config, ids, NEW)
    text_of = lambda toks: "".join(f"{t} " for t in toks)  # noqa: E731 - ids as text, without a tokenizer
    # a token at k >= 3 whose text first occurs in the reply right there
    k = next(i for i in range(3, NEW) if text_of(ref[:i + 1]).find(f"{ref[i]} ") == len(text_of(ref[:i])))
    out = llm.generate(ids, SamplingParams(max_tokens=NEW, stop=[f"{ref[k]} ", "no such text"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text_of(ref[:k])
    assert out.token_ids == ref[:k + 1]  # the request ended at the token that completed the stop string


def test_one_llm_at_a_time(llm):
    with pytest.raises(ValueError, match="one LLM at a time"):
        LLM(TINY, **OPTIONS)
    assert llm.generate([4, 5], SamplingParams(max_tokens=2))  # the open one is untouched


@pytest.mark.parametrize("options, message", [
    (dict(stagez=2), "has no option 'stagez'"),
    (dict(stages="two"), "invalid int value"),
    (dict(mode="fast"), "invalid choice"),
    (dict(colocate="yes"), "colocate takes True or False"),
    (dict(max_batch=0), "--max-batch must be >= 1"),
    (dict(mode="ar", max_batch=2, stages=1), "needs mode spd"),
])
def test_bad_options_are_value_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(TINY, **options)


def test_bad_prompts_and_parameters_are_value_errors(llm):
    for bad in ([], [[]], [1.5], {"prompt": "x", "prompt_token_ids": [1]}):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="exceeds|capacity"):
        llm.generate([4, 5], SamplingParams(max_tokens=10 ** 6))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_options_map_to_the_command_line_flags():
    p = engine_parser()
    assert engine_argv(p, dict(stages=4, colocate=True, suffix_drafts=False, stage_layers=[8, 8, 7, 7])) == [
        "--stages", "4", "--colocate", "--suffix-drafts", "off", "--stage-layers", "8,8,7,7"]
    assert engine_argv(p, dict(colocate=False)) == []


def test_stream_yields_the_reply_as_it_commits_and_an_early_exit_ends_it(llm):
    ids = random_prompts(llm.config.model.cfg, [5], seed=9)[0]
    ref = reference(llm.config, ids, NEW)
    pieces = list(llm.stream(ids, SamplingParams(max_tokens=NEW)))
    assert pieces == [f"{t} " for t in ref]  # one piece per committed token, in order
    it = llm.stream(ids, SamplingParams(max_tokens=400))
    assert next(it) == f"{ref[0]} "
    it.close()  # ends the request at its next token; the LLM serves the next call
    assert llm.generate(ids, SamplingParams(max_tokens=NEW))[0].outputs[0].token_ids == ref
    with pytest.raises(ValueError, match="one prompt"):
        next(llm.stream(["a", "b"]))


def test_version():
    import spd_engine

    assert spd_engine.__version__ and spd_engine.__version__[0].isdigit()
