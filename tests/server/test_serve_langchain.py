"""A second client built on the OpenAI API, LangChain's ChatOpenAI (`langchain-openai`), against a real
`spd serve` process on SmolLM2: invoke and stream give the text the official `openai` client gets,
a system turn is accepted, penalties and vLLM's extras travel (model kwargs, extra_body) and change
the reply as they do through the official client, and log-probabilities come back, at T = 0 and at
T > 0 equal to a plain forward pass within 1e-4. Nothing leaves the host: every socket connect
during a test must go to the loopback address (no token counting, so tiktoken fetches nothing)."""
from __future__ import annotations

import socket

import httpx
import openai
import pytest
import torch

from spd_engine.server.process import ServerProcess

pytestmark = pytest.mark.multiproc
langchain_openai = pytest.importorskip("langchain_openai")  # the test extra installs it
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402

SMOL = "smollm2-135m"
MESSAGES = [("system", "Be brief."), ("user", "Name three fruits.")]


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Fail any connection that is not to this host (LangChain tracing, tiktoken downloads)."""
    connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        assert host in ("127.0.0.1", "::1", "localhost"), f"a connection to {address!r} left the host"
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("LANGCHAIN_TRACING_V2", "false")


@pytest.fixture
def smol(smol_server):
    """The session's SmolLM2 server (tests/conftest.py), shared with the other server files."""
    return smol_server


@pytest.fixture(scope="module")
def smol_model(smollm2_dir):
    from spd_engine.engine.model.checkpoint import load_stage_model, read_index
    from spd_engine.tools.model_args import resolve_model

    engine_dir, _ = resolve_model(SMOL)
    cfg = read_index(engine_dir).cfg
    return load_stage_model(engine_dir, range(0, cfg.num_layers)).eval()


def chat(server: ServerProcess, **kw):
    return langchain_openai.ChatOpenAI(model=SMOL, base_url=server.base_url, api_key="unused", max_retries=0,
                                       timeout=120.0, **kw)


def official(server: ServerProcess, **kw) -> str:
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)
    msgs = [{"role": r, "content": t} for r, t in MESSAGES]
    return c.chat.completions.create(model=SMOL, messages=msgs, **kw).choices[0].message.content


def test_invoke_and_stream_give_the_official_clients_text(smol):
    want = official(smol, max_tokens=16, temperature=0)
    model = chat(smol, max_tokens=16, temperature=0)
    msgs = [SystemMessage("Be brief."), HumanMessage("Name three fruits.")]
    got = model.invoke(msgs)
    assert got.content == want and got.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in model.stream(MESSAGES)) == want


def test_penalties_and_vllm_extras_travel_through_langchain(smol):
    extras = dict(repetition_penalty=1.4, min_tokens=10)
    want = official(smol, max_tokens=24, temperature=0, frequency_penalty=0.5, extra_body=extras)
    assert want != official(smol, max_tokens=24, temperature=0)  # the penalties change the reply
    model = chat(smol, max_tokens=24, temperature=0, frequency_penalty=0.5, extra_body=extras)
    assert model.invoke(MESSAGES).content == want
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        chat(smol, max_tokens=4, presence_penalty=3.0).invoke(MESSAGES)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_through_langchain_equal_a_forward_pass(smol, smol_model, temperature):
    model = chat(smol, max_tokens=10, temperature=temperature, seed=5, logprobs=True, top_logprobs=3)
    got = model.invoke(MESSAGES)
    content = got.response_metadata["logprobs"]["content"]
    prompt = httpx.post(f"{smol.url}/tokenize", json={"messages": [{"role": r, "content": t} for r, t in MESSAGES]}
                        ).json()["tokens"]
    tokens = httpx.post(f"{smol.url}/tokenize", json={"prompt": got.content, "add_special_tokens": False}
                        ).json()["tokens"]
    assert len(content) >= len(tokens) > 0 and "".join(e["token"] for e in content).startswith(got.content)
    x = torch.tensor([prompt + tokens])
    with torch.no_grad():
        h, _ = smol_model.forward_layers(smol_model.embed(x), smol_model.new_cache(1, x.shape[1]), 0)
        want = torch.log_softmax(smol_model.logits(h)[0].double(), dim=-1)[len(prompt) - 1:]
    for k, token in enumerate(tokens):  # the tokens the reply's text encodes back to
        assert abs(content[k]["logprob"] - float(want[k, token])) < 1e-4, k
        top = want[k].topk(3).values.tolist()
        assert max(abs(alt["logprob"] - w) for alt, w in zip(content[k]["top_logprobs"], top)) < 1e-4, k
