"""`spd serve` on a model with real weights: without a tokenizer, text prompts get a 400 naming
--tokenizer (token-id prompts still run); with `--tokenizer PATH` text is encoded and decoded."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from ckpt_helpers import tiny_state
from tiny_tokenizer import write_tiny_tokenizer

from spd_engine.checkpoint_tools import shard
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.server.openai_api import ApiError, ParsedRequest
from spd_engine.server.process import ServerProcess
from spd_engine.server.tokenizing import PromptEncoder

ARGS = ["--mode", "ar", "--stages", "1", "--threads", "1", "--capacity", "128", "--port", "0"]


def test_the_encoder_refuses_text_and_chats_and_passes_token_ids():
    encoder = PromptEncoder(None, None, 64, text_refusal="m has no tokenizer; give --tokenizer PATH")
    for parsed in (ParsedRequest(chat=False, model=None, prompt="hi", messages=()),
                   ParsedRequest(chat=True, model=None, prompt=None, messages=(("user", "hi"),))):
        with pytest.raises(ApiError) as err:
            encoder.check_size(parsed)
        assert err.value.status == 400 and "--tokenizer PATH" in str(err.value.message)
    encoder.check_size(ParsedRequest(chat=False, model=None, prompt=[5, 6], messages=()))
    PromptEncoder(None, None, 64).check_size(ParsedRequest(chat=False, model=None, prompt="hi", messages=()))


def test_the_tokenizer_process_encodes_without_importing_torch():
    """What the server's tokenizer worker imports (its entry and the encoding it runs) stays torch-free:
    the worker is a spawned interpreter, started with every server, where torch would cost seconds."""
    code = ("import sys; import spd_engine.server.tokenizing, spd_engine.server.text; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.fixture(scope="module")
def engine_ckpt(tmp_path_factory):
    """A tiny engine checkpoint without a tokenizer, and a tokenizer directory that fits it."""
    root = tmp_path_factory.mktemp("serve_tok")
    cfg = tiny_config("llama")
    shard.write_engine(root / "e", cfg, tiny_state(cfg))
    write_tiny_tokenizer(root / "tok")
    return root


def _complete(server: ServerProcess, prompt) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=120)


@pytest.mark.slow  # a server start (~8 s)
def test_serve_without_a_tokenizer_refuses_text_only(engine_ckpt):
    server = ServerProcess(["--model", str(engine_ckpt / "e"), *ARGS])
    try:
        r = _complete(server, "hello")
        assert r.status_code == 400 and "--tokenizer PATH" in r.json()["error"]["message"], r.text
        r = _complete(server, [5, 6, 7])
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        assert server.close() == 0, server.stderr()[-3000:]


@pytest.mark.slow  # a server start (~8 s)
def test_serve_with_a_tokenizer_speaks_text(engine_ckpt):
    from spd_engine.engine.model.tokenizer import Tokenizer

    server = ServerProcess(["--model", str(engine_ckpt / "e"), "--tokenizer", str(engine_ckpt / "tok"), *ARGS])
    try:
        r = _complete(server, "hello world")
        assert r.status_code == 200, r.text
        tok = Tokenizer.from_dir(engine_ckpt / "tok")
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("hello world"))
    finally:
        assert server.close() == 0, server.stderr()[-3000:]
