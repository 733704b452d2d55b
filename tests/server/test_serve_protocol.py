"""`spd serve` pure logic: request validation (every unsupported field and bad value refused with
its name), request preparation (KV capacity, sampling defaults), stop strings over detokenized
pieces, the bounded queue and its order (critical, priority, arrival). No processes."""
from __future__ import annotations

import threading

import pytest

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.server.job import DirectCall, Job
from spd_engine.server.job_queue import JobQueue, QueueFull
from spd_engine.server.openai_api import CHAT_UNSUPPORTED, UNSUPPORTED, ApiError, ParsedRequest, parse_request
from spd_engine.server.request import ModelInfo, ServeRequest, prepare
from spd_engine.server.text import StopMatcher, TextStream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
INFO = ModelInfo(name="m", tok=None, tok_dir=None, vocab_size=100, capacity=32, eos_ids=(2,))

# A value that asks for something the engine does not do, per unsupported field.
ASKING = {"best_of": 3, "echo": True, "suffix": "x", "logprobs": True, "top_logprobs": 2,
          "logit_bias": {"5": 10},
          "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
          "parallel_tool_calls": True, "functions": [{"name": "f"}], "function_call": "auto",
          "response_format": {"type": "json_object"}, "store": True, "metadata": {"a": "b"},
          "modalities": ["text", "audio"], "audio": {"voice": "x"}, "prediction": {"type": "content"},
          "reasoning_effort": "low", "service_tier": "flex", "web_search_options": {},
          "min_p": 0.05, "length_penalty": 0.5,
          "use_beam_search": True, "stop_token_ids": [5], "bad_words": ["x"], "allowed_token_ids": [5, 6],
          "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
          "prompt_logprobs": 1, "truncate_prompt_tokens": 8, "return_tokens_as_token_ids": True,
          "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
          "guided_grammar": "root ::= \"a\"", "structured_outputs": {"regex": "a+"}}

BAD_VALUES = [  # (field, value) that must be refused, naming the field
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("seed", -1), ("seed", 1 << 64),
    ("seed", "7"), ("max_tokens", 0), ("max_tokens", 2.0), ("stream", "yes"), ("stop", ["a", ""]),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", 5), ("stream_options", {"include_usage": True}),
    ("user", 5), ("model", ""), ("priority", 1.5), ("priority", True), ("priority", "3"), ("latency", "fast"),
    ("latency", 1), ("latency", ["critical"]), ("latency", "Critical"),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", "1"), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", 40),
]


def error_of(body: dict, chat: bool) -> ApiError:
    with pytest.raises(ApiError) as info:
        prepare(parse_request(body, chat), INFO)
    return info.value


def test_every_unsupported_field_has_an_asking_value():
    assert set(ASKING) == set(UNSUPPORTED)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
@pytest.mark.parametrize("chat", [False, True])
def test_unsupported_field_asking_for_something_is_a_400_naming_it(field, chat):
    if chat and field not in CHAT_UNSUPPORTED:
        pytest.skip(f"chat takes {field}")
    err = error_of({**(CHAT if chat else COMPLETION), field: ASKING[field]}, chat)
    assert (err.status, err.param) == (400, field)
    assert err.body()["error"]["param"] == field and err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("n", 1), ("logprobs", None), ("presence_penalty", 0), ("echo", False),
                                         ("tools", []), ("response_format", {"type": "text"})])
def test_unsupported_field_at_its_neutral_value_is_accepted(field, value):
    parse_request({**COMPLETION, field: value}, chat=False)


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_bad_value_is_a_400_naming_the_field(field, value):
    err = error_of({**COMPLETION, field: value}, chat=False)
    assert (err.status, err.param) == (400, field), err.message


@pytest.mark.parametrize("body,chat,param", [
    ({"model": "m", "prompt": "hi", "colour": "red"}, False, "colour"),
    ({"model": "m", "prompt": "hi", "messages": []}, False, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}, True, "prompt"),
    ({"model": "m"}, False, "prompt"),
    ({"model": "m", "prompt": ""}, False, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, False, "prompt"),
    ({"model": "m", "prompt": [1, "x"]}, False, "prompt"),
    ({"model": "m", "prompt": [5, 100]}, False, "prompt"),  # id outside the vocabulary
    ({"model": "m", "messages": []}, True, "messages"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, True, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "name": "a"}]}, True, "messages[0].name"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True,
     "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, True, "messages"),  # no chat template
    ({"model": "m", "prompt": "hi", "max_tokens": 31}, False, "max_tokens"),  # 2 + 31 > capacity 32
    ({"model": "m", "prompt": "x" * 32}, False, "prompt"),  # the prompt alone fills the KV cache
    ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, True, "max_completion_tokens"),
])
def test_bad_request_names_the_field(body, chat, param):
    err = error_of(body, chat)
    assert (err.status, err.param) == (400, param), err.message


def test_unknown_model_is_a_404_and_a_non_object_body_a_400():
    err = error_of({**COMPLETION, "model": "gpt-4"}, chat=False)
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    with pytest.raises(ApiError) as info:
        parse_request(["not", "an", "object"], chat=False)
    assert info.value.status == 400


def test_prepare_fills_defaults_and_keeps_explicit_values():
    req = prepare(parse_request({**COMPLETION, "prompt": [7, 8, 9]}, False), INFO)
    assert req.prompt_ids == [7, 8, 9] and req.max_tokens == 16 and req.sampling.greedy
    req = prepare(parse_request({**COMPLETION, "prompt": "hi", "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                 "seed": 5, "max_tokens": 30, "stop": "x"}, False), INFO)
    assert req.max_tokens == 30 and req.stops == ("x",)
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.sampling.seed) == (0.7, 0.9, 0, 5)
    # unseeded sampling draws a fresh seed per request
    seeds = {prepare(parse_request({**COMPLETION, "temperature": 1.0}, False), INFO).sampling.seed for _ in range(8)}
    assert len(seeds) > 1


@pytest.mark.parametrize("chat", [False, True])
def test_latency_class_and_priority_are_parsed_and_default_to_batch_and_0(chat):
    body = CHAT if chat else {**COMPLETION, "prompt": [7, 8]}
    parsed = parse_request(body, chat)
    assert (parsed.latency, parsed.priority) == ("batch", 0)
    # the field orders as vLLM's (lower first); the parsed value is the engine's order (higher first)
    parsed = parse_request({**body, "latency": "critical", "priority": -3}, chat)
    assert (parsed.latency, parsed.priority) == ("critical", 3)
    parsed = parse_request({**body, "latency": None, "priority": None}, chat)
    assert (parsed.latency, parsed.priority) == ("batch", 0)
    if not chat:  # INFO has no chat template
        req = prepare(parse_request({**body, "latency": "batch", "priority": 7}, chat), INFO)
        assert (req.latency, req.priority) == ("batch", -7)


def test_bad_latency_or_priority_says_what_is_allowed():
    assert "'batch' (the default) or 'critical'" in error_of({**COMPLETION, "latency": "fast"}, False).message
    err = error_of({**CHAT, "priority": False}, True)
    assert err.param == "priority" and "must be an integer" in err.message


def test_chat_uses_the_template_and_defaults_to_what_fits(smollm2_dir):
    from spd_engine.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    info = ModelInfo(name="m", tok=tok, tok_dir=smollm2_dir, vocab_size=tok.vocab_size, capacity=256,
                     eos_ids=tok.eos_ids)
    req = prepare(parse_request({**CHAT, "messages": [{"role": "user", "content": "Why?"}]}, True), info)
    assert req.prompt_ids == tok.chat_ids("Why?")  # what `spd generate --chat` sends
    assert req.max_tokens == 256 - len(req.prompt_ids)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}, {"role": "user", "content": "Why?"}]
    req = prepare(parse_request({**CHAT, "messages": turns}, True), info)
    text = tok.decode(req.prompt_ids)
    assert text.index("Be brief.") < text.index("Hi") < text.index("Hello") < text.rindex("Why?")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("pieces,stops,emitted,stopped", [
    (["Hel", "lo wo", "rld"], ["wor"], "Hello ", True),  # a stop string across pieces
    (["ab", "c", "d"], ["cx"], "abcd", False),  # a held-back prefix released at the end
    (["a", "b", "c"], ["b", "c"], "a", True),  # the first occurrence of any stop string
    (["xyz"], [], "xyz", False),
])
def test_stop_matcher(pieces, stops, emitted, stopped):
    m = StopMatcher(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    assert ("".join(out), hit) == (emitted, stopped)


def test_stop_matcher_holds_back_only_a_possible_prefix():
    m = StopMatcher(["STOP"])
    assert m.push("abcST") == ("abc", False)  # "ST" could still start "STOP"
    assert m.push("x") == ("STx", False)
    assert m.push("S") == ("", False) and m.push("TOP") == ("", True)


def test_text_stream_never_cuts_a_utf8_character_and_stops_on_text(smollm2_dir):
    from spd_engine.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    text = "Café ☕ 日本語 done. More text"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    stream = TextStream(tok, ["done"])
    pieces = []
    for t in ids:
        pieces.append(stream.push(t))
        assert "\ufffd" not in pieces[-1]
        if stream.stopped:
            break
    assert "".join(pieces) == "Café ☕ 日本語 " and stream.finish() == ""
    stream = TextStream(tok, ["zzz"])
    assert "".join([stream.push(t) for t in ids] + [stream.finish()]) == text


def test_text_stream_without_a_tokenizer_writes_ids():
    stream = TextStream(None, ["4 5"])
    assert [stream.push(t) for t in (3, 4)] == ["3 ", ""] and stream.push(5) == "" and stream.stopped


def queued(latency: str = "batch", priority: int = 0) -> Job:
    parsed = ParsedRequest(chat=False, model="m", prompt=[1], latency=latency, priority=priority)
    return Job(ServeRequest([1], 1, SamplingParams(), (), parsed), None, None)


def test_job_queue_takes_critical_then_higher_priority_then_arrival():
    q = JobQueue(16)
    a, b, c, d, e, f = (queued(), queued(priority=2), queued("critical"), queued(priority=2), queued("critical", 1),
                        queued(priority=-1))
    for job in (a, b, c, d, e, f):
        q.put(job)
    assert q.remove(d) and not q.remove(d)  # cancelled while queued: gone, the order of the rest kept
    assert [q.get() for _ in range(5)] == [e, c, b, a, f]
    # a call is taken after the jobs queued before it, and the jobs after it wait for it
    g, call, h = queued(), DirectCall(lambda rt: None), queued("critical")
    for item in (g, call, h):
        q.put(item)
    assert q.get_nowait(DirectCall) is None  # g first, whatever the kind asked
    assert q.get_nowait(Job) is g and q.get_nowait(Job) is None and q.get() is call and q.get_nowait(Job) is h
    assert len(q) == 0 and q.get_nowait(Job) is None


def test_job_queue_is_a_bounded_fifo():
    q = JobQueue(2)
    q.put("a")
    q.put("b")
    with pytest.raises(QueueFull, match="2 requests waiting"):
        q.put("c")
    assert q.remove("a") and not q.remove("a") and len(q) == 1
    q.put("c")
    assert [q.get(), q.get()] == ["b", "c"]
    got = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    q.close()
    t.join(5)
    assert got == [None]
    with pytest.raises(QueueFull):
        q.put("d")
