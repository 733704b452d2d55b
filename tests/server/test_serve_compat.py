"""What a client written for OpenAI or vLLM meets at `spd serve`, driven by the official `openai`
client (and raw HTTP where the client has no call) against real server processes: /tokenize and
/detokenize in vLLM's shapes, /version, GET /v1/models/{id}, a request without `model`, vLLM's
extra fields at their neutral values accepted and otherwise refused naming the field, `n` choices
(equal at T = 0, seed + i each when sampled, streamed with their index), `priority` ordered as
vLLM orders it, no `_created` series in /metrics, log-probabilities (legacy completions and chat,
streamed and not) equal to a plain forward pass, and (on the real model) the `developer` role and
a tokenize / detokenize round trip of text."""
from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
import torch

from spd_engine.server.process import ServerProcess
from spd_engine.tools.cli import version

pytestmark = pytest.mark.multiproc
TINY = "random:tiny-llama"
# every stage step lasts at least 20 ms: a 480-token request keeps the pipeline busy for seconds; one
# request in the pipeline at a time (--max-batch 1): the priority check orders the queue behind it
TINY_ARGS = ["--model", TINY, "--stages", "2", "--threads", "1", "--capacity", "512", "--prefill-chunk", "16",
             "--suffix-run", "1", "--stage-ms", "20", "--max-batch", "1"]
SMOL = "smollm2-135m"


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)


def waiting(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(r"^spd:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)[1])


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny():
    server = ServerProcess(TINY_ARGS)
    yield server
    assert server.close() == 0, server.stderr()[-3000:]


@pytest.fixture
def smol(smol_server):
    """The session's SmolLM2 server (tests/conftest.py), shared with the other server files."""
    return smol_server


# ---- endpoints ----

def test_tokenize_counts_what_a_completion_prefills_and_detokenize_writes_the_ids(tiny):
    r = httpx.post(f"{tiny.url}/tokenize", json={"model": TINY, "prompt": "hello there"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert set(got) == {"count", "max_model_len", "tokens", "token_strs"}
    assert got["count"] == len(got["tokens"]) == len("hello there") and got["max_model_len"] == 512
    assert got["token_strs"] is None
    usage = client(tiny).completions.create(model=TINY, prompt="hello there", max_tokens=1).usage
    assert usage.prompt_tokens == got["count"]
    strs = httpx.post(f"{tiny.url}/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == 2
    back = httpx.post(f"{tiny.url}/detokenize", json={"model": TINY, "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "".join(f"{t} " for t in got["tokens"])}


@pytest.mark.parametrize("path,body,param", [
    ("tokenize", {"prompt": ""}, "prompt"), ("tokenize", {"prompt": "x", "colour": 1}, "colour"),
    ("tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"messages": [{"role": "user", "content": "x"}]}, "messages"),  # no chat template
    ("detokenize", {"tokens": "1 2"}, "tokens"), ("detokenize", {"tokens": [1, True]}, "tokens"),
    ("detokenize", {"tokens": [10 ** 9]}, "tokens"), ("detokenize", {"tokens": [1] * 513}, "tokens"),
    ("tokenize", {"prompt": "x" * 600}, "prompt"),  # more bytes than the KV capacity holds tokens
])
def test_bad_tokenize_or_detokenize_is_a_400_naming_the_field(tiny, path, body, param):
    r = httpx.post(f"{tiny.url}/{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_version_and_model_lookup(tiny):
    assert httpx.get(f"{tiny.url}/version").json() == {"version": version()}
    card = client(tiny).models.retrieve(TINY)
    assert (card.id, card.object, card.owned_by) == (TINY, "model", "spd-engine")
    assert card.model_dump() == client(tiny).models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client(tiny).models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    r = httpx.post(f"{tiny.url}/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_have_no_created_series(tiny):
    client(tiny).completions.create(model=TINY, prompt=[5, 6], max_tokens=2)
    text = httpx.get(f"{tiny.url}/metrics").text
    assert re.search(r"^spd:request_total\{", text, re.M) and "spd:e2e_request_latency_seconds_count" in text
    assert "_created" not in text


def test_the_new_endpoints_need_the_api_key_but_version_does_not():
    """In process (no engine needed): with --api-key, /tokenize, /detokenize and /v1/models/{id}
    answer 401 without the key and serve with it; /version, as /health, needs none."""
    from fastapi.testclient import TestClient

    from spd_engine.server.app import build_app
    from spd_engine.server.exporter import ServeMetrics
    from spd_engine.server.request import ModelInfo

    info = ModelInfo(name="m", tok=None, tok_dir=None, vocab_size=100, capacity=32, eos_ids=(2,))
    app = build_app(None, info, ServeMetrics(2, lambda: 0, lambda: 0, "m"), 30.0, api_key="k")
    anonymous, keyed = TestClient(app), TestClient(app, headers={"Authorization": "Bearer k"})
    calls = [("post", "/tokenize", {"prompt": "ab"}), ("post", "/detokenize", {"tokens": [3]}),
             ("get", "/v1/models/m", None)]
    for method, path, body in calls:
        assert getattr(anonymous, method)(path, **({"json": body} if body else {})).status_code == 401, path
        assert getattr(keyed, method)(path, **({"json": body} if body else {})).status_code == 200, path
    assert anonymous.get("/version").json() == {"version": version()}
    assert keyed.post("/tokenize", json={"prompt": "ab"}).json()["tokens"] == [3 + ord("a") % 97, 3 + ord("b") % 97]


def test_developer_stays_developer_for_a_template_that_names_it():
    from spd_engine.server.text import template_role

    class Tok:
        chat_template = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"

    assert template_role(Tok(), "developer") == "developer"
    Tok.chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"
    assert template_role(Tok(), "developer") == "system" and template_role(Tok(), "user") == "user"


# ---- request fields ----

def test_a_request_without_model_is_served_by_the_served_model(tiny):
    r = httpx.post(f"{tiny.base_url}/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == TINY and body["usage"]["completion_tokens"] == 3
    same = client(tiny).completions.create(model=TINY, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert body["choices"][0]["text"] == same.choices[0].text


NEUTRAL = {"repetition_penalty": 1.0, "min_tokens": 0, "min_p": 0.0, "skip_special_tokens": True,
           "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [],
           "length_penalty": 1, "use_beam_search": False, "add_special_tokens": True, "truncate_prompt_tokens": None,
           "top_k": -1}


def test_vllm_extras_at_their_neutral_values_change_nothing(tiny):
    c = client(tiny)
    plain = c.completions.create(model=TINY, prompt=[9, 8, 7], max_tokens=4, temperature=0)
    extra = c.completions.create(model=TINY, prompt=[9, 8, 7], max_tokens=4, temperature=0, n=1,
                                 presence_penalty=0, frequency_penalty=0.0, logit_bias={}, extra_body=NEUTRAL)
    assert extra.choices[0].text == plain.choices[0].text


ASKING = [(dict(n=17), "n"), (dict(n=0), "n"), (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
          (dict(extra_body={"min_tokens": 4}), "min_tokens"), (dict(presence_penalty=3), "presence_penalty"),
          (dict(logit_bias={"5": 3}), "logit_bias"), (dict(extra_body={"stop_token_ids": [4]}), "stop_token_ids"),
          (dict(extra_body={"skip_special_tokens": False}), "skip_special_tokens"),
          (dict(extra_body={"guided_regex": "a+"}), "guided_regex"), (dict(logprobs=6), "logprobs"),
          (dict(logprobs=1.5), "logprobs"), (dict(logprobs=-1), "logprobs"),
          (dict(extra_body={"add_special_tokens": False}), "add_special_tokens")]


@pytest.mark.parametrize("kwargs,param", ASKING, ids=[p for _, p in ASKING])
def test_what_the_engine_cannot_honour_is_a_400_naming_it(tiny, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client(tiny).completions.create(**{"model": TINY, "prompt": [5, 6], "max_tokens": 2, **kwargs})
    assert info.value.param == param, info.value.message


CHAT_ASKING = [(dict(n=17), "n"), (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
               (dict(top_logprobs=2), "top_logprobs"), (dict(logprobs="yes"), "logprobs"),
               (dict(logprobs=True, top_logprobs=1.5), "top_logprobs"),
               (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
               (dict(tool_choice="auto"), "tool_choice"), (dict(response_format={"type": "json_object"}),
                                                            "response_format"),
               (dict(extra_body={"add_generation_prompt": False}), "add_generation_prompt"),
               (dict(extra_body={"chat_template": "{{ messages }}"}), "chat_template")]


@pytest.mark.parametrize("kwargs,param", CHAT_ASKING, ids=[p for _, p in CHAT_ASKING])
def test_chat_fields_the_engine_cannot_honour_are_a_400_naming_them(tiny, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client(tiny).chat.completions.create(**{"model": TINY, "messages": [{"role": "developer", "content": "x"}],
                                                "max_tokens": 2, **kwargs})
    assert info.value.param == param, info.value.message


def test_lower_priority_is_served_first_as_vllm_orders_it(tiny):
    """A long request holds the pipeline; `priority` 5 queues, then `priority` -5: when the pipeline
    frees, -5 goes first although it arrived second. The order served is read from the server's
    request log lines (one per request, written as it ends), not from when the client threads
    return, which a loaded machine may reorder."""
    c, done, first_token, release = client(tiny), [], threading.Event(), threading.Event()

    def hold() -> None:
        with httpx.stream("POST", f"{tiny.base_url}/completions", timeout=120,
                          json={"prompt": [4, 5], "max_tokens": 480, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_token.set()
                    release.wait(60)
                    return  # the client goes away: the request ends at its next token

    def ask(name: str, priority: int) -> None:
        c.completions.create(model=TINY, prompt=[7, 8], max_tokens=1, extra_body={"priority": priority},
                             extra_headers={"X-Request-Id": name})
        done.append(name)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert first_token.wait(60)
    names = {5: f"late-{time.monotonic_ns()}", -5: f"early-{time.monotonic_ns()}"}
    late, early = (threading.Thread(target=ask, args=(names[p], p)) for p in (5, -5))
    base = waiting(tiny)
    late.start()
    wait_until(lambda: waiting(tiny) >= base + 1)
    early.start()
    wait_until(lambda: waiting(tiny) >= base + 2)
    release.set()
    for t in (holder, late, early):
        t.join(60)
    assert sorted(done) == sorted(names.values())
    wait_until(lambda: all(f"request {n} " in tiny.stderr() for n in names.values()))
    served = [line.split("request ", 1)[1].split(" ", 1)[0] for line in tiny.stderr().splitlines()
              if any(f"request {n} " in line for n in names.values())]
    assert served == [names[-5], names[5]]


# ---- the real model (a tokenizer and a chat template) ----

def test_developer_message_is_a_system_turn_for_a_template_without_that_role(smol):
    c = client(smol)
    question = {"role": "user", "content": "Name a colour."}
    as_developer = c.chat.completions.create(model=SMOL, max_tokens=8, temperature=0,
                                             messages=[{"role": "developer", "content": "Answer in one word."},
                                                       question])
    as_system = c.chat.completions.create(model=SMOL, max_tokens=8, temperature=0,
                                          messages=[{"role": "system", "content": "Answer in one word."}, question])
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    plain = c.chat.completions.create(model=SMOL, max_tokens=8, temperature=0, messages=[question])
    assert plain.usage.prompt_tokens != as_system.usage.prompt_tokens  # the turn did reach the template


def test_tokenize_then_detokenize_gives_the_text_back_and_counts_the_chat_prompt(smol):
    text = "Café ☕, naïve 日本語 text."
    got = httpx.post(f"{smol.url}/tokenize", json={"model": SMOL, "prompt": text, "return_token_strs": True}).json()
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) and got["max_model_len"] == 512
    assert httpx.post(f"{smol.url}/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": text}
    assert client(smol).completions.create(model=SMOL, prompt=text, max_tokens=1).usage.prompt_tokens == got["count"]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = httpx.post(f"{smol.url}/tokenize", json={"messages": messages}).json()
    usage = client(smol).chat.completions.create(model=SMOL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    bare = httpx.post(f"{smol.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    rendered = httpx.post(f"{smol.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "<|im_start|>system\nBe brief.<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


# ---- log-probabilities (legacy completions, T = 0) ----

def tiny_log_probs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p [len(tokens), V] of a plain forward pass of the server's model over prompt + tokens."""
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.build import build_stage_model
    from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime

    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source=TINY, cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 2)),
                     runtime=Runtime(capacity=512, prefill_chunk=16))
    model = build_stage_model(ecfg, range(cfg.num_layers), embedding=True, head=True)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        h, _ = model.forward_layers(model.embed(ids), model.new_cache(1, ids.shape[1]), 0)
        logits = model.logits(h)[0]  # [T, V]
    return torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def check_legacy_logprobs(lp, text: str, prompt: list[int], completion_tokens: int) -> None:
    """A completion choice's legacy logprobs against a plain forward pass of the tiny model (within 1e-4)."""
    tokens = [int(t) for t in lp.tokens]
    assert len(tokens) == completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(tokens))]
    want = tiny_log_probs(prompt, tokens)
    for k, token in enumerate(tokens):
        assert abs(lp.token_logprobs[k] - float(want[k, token])) < 1e-4, k
        top = want[k].topk(3)
        assert list(lp.top_logprobs[k]) == [f"{i} " for i in top.indices.tolist()]
        assert max(abs(a - float(b)) for a, b in zip(lp.top_logprobs[k].values(), top.values)) < 1e-4
        assert lp.token_logprobs[k] == max(lp.top_logprobs[k].values())  # T = 0: the chosen one is the likeliest


def check_logprobs(server: ServerProcess, prompt: list[int], max_tokens: int) -> dict:
    """A completion's logprobs against a plain forward pass (within 1e-4); its `spd` counters."""
    got = client(server).completions.create(model=TINY, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            logprobs=3)
    check_legacy_logprobs(got.choices[0].logprobs, got.choices[0].text, prompt, got.usage.completion_tokens)
    return got.model_extra["spd"]


def streamed(server: ServerProcess, chat: bool, **kwargs) -> tuple[dict, dict, list]:
    """A stream with the official client: {index: text}, {index: [logprobs of its chunks]}, usage."""
    c = client(server)
    make = c.chat.completions.create if chat else c.completions.create
    texts, logprobs, usage = {}, {}, None
    for chunk in make(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.logprobs is not None:
                logprobs.setdefault(choice.index, []).append((piece, choice.logprobs))
    return texts, logprobs, usage


def test_streamed_completion_logprobs_equal_a_plain_forward_pass(tiny):
    """Each chunk carries the log-probabilities of the tokens behind its text (text_offset counted
    from the reply's start); together they are the non-streamed ones."""
    prompt = [11, 42, 7, 90, 3, 50, 18, 64, 77, 20, 5, 31]
    texts, chunks, usage = streamed(tiny, False, model=TINY, prompt=prompt, max_tokens=10, temperature=0,
                                    logprobs=3)
    assert list(chunks) == [0] and len(chunks[0]) > 1
    for piece, lp in chunks[0]:
        assert "".join(lp.tokens) == piece
    merged = openai.types.completion_choice.Logprobs(
        **{k: sum((getattr(lp, k) for _, lp in chunks[0]), []) for k in
           ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
    check_legacy_logprobs(merged, texts[0], prompt, usage.completion_tokens)
    whole = client(tiny).completions.create(model=TINY, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    assert whole.choices[0].logprobs.model_dump() == merged.model_dump() and whole.choices[0].text == texts[0]
    # a stop string of two tokens: the first one's text is held back, then the stop cuts both
    stop = "".join(merged.tokens[4:6])
    cut = client(tiny).completions.create(model=TINY, prompt=prompt, max_tokens=10, temperature=0, logprobs=3,
                                          stop=[stop])
    texts, chunks, usage = streamed(tiny, False, model=TINY, prompt=prompt, max_tokens=10, temperature=0,
                                    logprobs=3, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and texts[0] == cut.choices[0].text
    tokens = [t for _, lp in chunks[0] for t in lp.tokens]
    offsets = [o for _, lp in chunks[0] for o in lp.text_offset]
    assert tokens == cut.choices[0].logprobs.tokens == merged.tokens[:len(tokens)]
    assert offsets == cut.choices[0].logprobs.text_offset and len(tokens) == usage.completion_tokens


def test_n_choices_are_equal_at_temperature_0_and_usage_counts_them_all(tiny):
    c = client(tiny)
    one = c.completions.create(model=TINY, prompt=[5, 6, 7], max_tokens=6, temperature=0, logprobs=1)
    two = c.completions.create(model=TINY, prompt=[5, 6, 7], max_tokens=6, temperature=0, logprobs=1, n=2)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert [ch.text for ch in two.choices] == [one.choices[0].text] * 2
    assert [ch.logprobs for ch in two.choices] == [one.choices[0].logprobs] * 2
    assert two.usage.prompt_tokens == 3 and two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert isinstance(two.model_extra["spd"], list) and len(two.model_extra["spd"]) == 2


def test_sampled_n_choices_are_the_seeds_seed_plus_i(tiny):
    """Choice i of a seeded request is what a request with seed + i draws: reproducible, and
    different draws (at T = 1.5 on the random model, 12 tokens of 3 choices cannot all agree)."""
    c = client(tiny)
    ask = dict(model=TINY, prompt=[9, 10], max_tokens=12, temperature=1.5)
    three = c.completions.create(n=3, seed=40, **ask)
    alone = [c.completions.create(seed=40 + i, **ask).choices[0].text for i in range(3)]
    assert [ch.text for ch in three.choices] == alone
    assert len(set(alone)) > 1
    texts, _, usage = streamed(tiny, False, n=3, seed=40, **ask)
    assert [texts[i] for i in range(3)] == alone and usage.completion_tokens == three.usage.completion_tokens


def test_completion_logprobs_equal_a_plain_forward_pass(tiny):
    check_logprobs(tiny, [11, 42, 7, 90, 3, 50, 18, 64, 77, 20, 5, 31, 80, 9, 14, 61, 33, 2], 12)


def test_logprobs_at_n_4_with_suffix_runs_and_the_last_stage_verifying():
    """4 stages, suffix runs on (their tokens verified together) and the last stage computing the
    argmax: the log-probabilities still come from the exit hidden states, row by row."""
    server = ServerProcess(["--model", TINY, "--stages", "4", "--threads", "1", "--capacity", "512",
                            "--prefill-chunk", "16", "--verify-at", "last"])
    try:
        spd = check_logprobs(server, [21, 22, 23, 24, 25, 26] * 8, 40)
        assert spd["ticks"] > 0
    finally:
        assert server.close() == 0, server.stderr()[-3000:]


class OneTokenRuntime:
    """A runtime without log-probabilities (as the pp / ar baselines): one token per request."""

    def generate(self, prompt_ids, max_tokens, eos, on_token=None, sampling=None):
        from spd_engine.engine.protocol.metrics import GenerationResult

        on_token(7)
        return GenerationResult(tokens=[7], n=2)

    def check_request(self, prompt, max_new_tokens) -> None:
        pass

    def generate_batch(self, requests, max_batch, intake=None, on_done=None, max_rows=None) -> None:
        from spd_engine.engine.protocol.metrics import GenerationResult

        index = 0
        while (r := intake()) is not None:
            r.on_token(7)
            on_done(index, GenerationResult(tokens=[7], n=2))
            index += 1


@pytest.mark.parametrize("max_batch", [1, 2])
def test_logprobs_where_the_runtime_cannot_give_them_are_a_400_and_the_engine_goes_on(max_batch):
    """In process: a runtime without them refuses the request, alone (B = 1) or batched (B = 2),
    with a 400 naming logprobs, and serves the next one."""
    import contextlib

    from fastapi.testclient import TestClient

    from spd_engine.server.app import build_app
    from spd_engine.server.engine_loop import EngineLoop
    from spd_engine.server.exporter import ServeMetrics
    from spd_engine.server.request import ModelInfo

    info = ModelInfo(name="m", tok=None, tok_dir=None, vocab_size=100, capacity=32, eos_ids=())
    engine = EngineLoop(lambda: contextlib.nullcontext(OneTokenRuntime()), 8, eos_ids=(), max_batch=max_batch)
    engine.start(timeout=10)
    try:
        metrics = ServeMetrics(2, engine.waiting, engine.running, "m")
        http = TestClient(build_app(engine, info, metrics, 30.0), base_url="http://127.0.0.1")
        r = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        r = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "7 "
    finally:
        assert engine.stop(timeout=30)


# ---- chat log-probabilities and choices (the real model) ----

@pytest.fixture(scope="module")
def smol_reference(smollm2_dir):
    """(the whole SmolLM2 target in this process, its tokenizer) for plain forward passes."""
    from spd_engine.engine.model.checkpoint import load_stage_model, read_index
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.tools.model_args import resolve_model

    engine_dir, tok_dir = resolve_model(SMOL)
    cfg = read_index(engine_dir).cfg
    return load_stage_model(engine_dir, range(0, cfg.num_layers)).eval(), Tokenizer.from_dir(tok_dir)


def greedy_log_probs(full, prompt: list[int], steps: int) -> list[tuple[int, torch.Tensor]]:
    """(token, log p [V]) per step of a plain greedy decode: one forward of the whole target over
    prompt + tokens so far per step."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.tensor([ids])
            h, _ = full.forward_layers(full.embed(x), full.new_cache(1, x.shape[1]), 0)
            logp = torch.log_softmax(full.logits(h)[0, -1].double(), dim=-1)
            out.append((int(logp.argmax()), logp))
            ids.append(out[-1][0])
    return out


CHAT = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name three fruits."}]


def test_chat_logprobs_equal_a_plain_forward_pass_streamed_or_not(smol, smol_reference):
    full, tok = smol_reference
    c = client(smol)
    got = c.chat.completions.create(model=SMOL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens > 0
    prompt = httpx.post(f"{smol.url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    for entry, (token, logp) in zip(content, greedy_log_probs(full, prompt, len(content))):
        assert entry.token == tok.decode([token]) and entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - float(logp[token])) < 1e-4
        top = logp.topk(3)
        assert [alt.token for alt in entry.top_logprobs] == [tok.decode([i]) for i in top.indices.tolist()]
        assert max(abs(alt.logprob - float(w)) for alt, w in zip(entry.top_logprobs, top.values)) < 1e-4
        assert entry.logprob == max(alt.logprob for alt in entry.top_logprobs)
    texts, chunks, usage = streamed(smol, True, model=SMOL, messages=CHAT, max_tokens=12, temperature=0,
                                    logprobs=True, top_logprobs=3)
    assert texts[0] == got.choices[0].message.content and usage.completion_tokens == got.usage.completion_tokens
    merged = [entry for _, lp in chunks[0] for entry in lp.content]
    assert [e.model_dump() for e in merged] == [e.model_dump() for e in content]


def test_chat_n_2_with_a_developer_message_gives_two_equal_choices_at_temperature_0(smol):
    c = client(smol)
    two = c.chat.completions.create(model=SMOL, messages=CHAT, max_tokens=8, temperature=0, n=2)
    one = c.chat.completions.create(model=SMOL, messages=CHAT, max_tokens=8, temperature=0)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert [ch.message.content for ch in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    texts, _, _ = streamed(smol, True, model=SMOL, messages=CHAT, max_tokens=8, temperature=0, n=2)
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}


@pytest.mark.parametrize("max_batch", [1, 2])
def test_n_beyond_what_the_server_holds_is_a_400_naming_n_and_n_within_is_served(max_batch):
    """In process: a server holding --max-queue 1 + --max-batch requests serves n up to that many
    choices (indexed, their tokens summed in usage) and refuses more with a 400 naming n."""
    import contextlib

    from fastapi.testclient import TestClient

    from spd_engine.server.app import build_app
    from spd_engine.server.engine_loop import EngineLoop
    from spd_engine.server.exporter import ServeMetrics
    from spd_engine.server.request import ModelInfo

    info = ModelInfo(name="m", tok=None, tok_dir=None, vocab_size=100, capacity=32, eos_ids=())
    engine = EngineLoop(lambda: contextlib.nullcontext(OneTokenRuntime()), 1, eos_ids=(), max_batch=max_batch)
    engine.start(timeout=10)
    try:
        http = TestClient(build_app(engine, info, ServeMetrics(2, engine.waiting, engine.running, "m"), 30.0),
                          base_url="http://127.0.0.1")
        held = 1 + max_batch
        r = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "n": held + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "n": held})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [(c["index"], c["text"]) for c in body["choices"]] == [(i, "7 ") for i in range(held)]
        assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": held, "total_tokens": 1 + held}
        assert engine.open_jobs() == 0
    finally:
        assert engine.stop(timeout=30)
