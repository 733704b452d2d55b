"""top_k is bounded below 2**31 wherever it enters: the engine's SamplingParams, the server's request
parser (without torch) and `spd generate --top-k` (one line, exit 2, before any model is loaded)."""
from __future__ import annotations

import pytest

from spd_engine.engine.protocol.sampling import TOP_K_LIMIT, SamplingParams
from spd_engine.server.openai_api import MAX_TOP_K, ApiError, parse_request
from spd_engine.tools.cli import main


@pytest.mark.pure
def test_sampling_params_refuse_a_top_k_past_the_limit() -> None:
    assert MAX_TOP_K == TOP_K_LIMIT == 2**31
    assert SamplingParams(temperature=1.0, top_k=TOP_K_LIMIT - 1).top_k == TOP_K_LIMIT - 1
    for top_k in (TOP_K_LIMIT, 10**12, 10**21, -1):
        with pytest.raises(ValueError, match="top_k must be an integer >= 0 and below 2"):
            SamplingParams(temperature=1.0, top_k=top_k)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams.from_generation_config({"do_sample": True, "top_k": 10**21})


@pytest.mark.pure
def test_the_request_parser_names_top_k() -> None:
    body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 1.0}
    assert parse_request({**body, "top_k": TOP_K_LIMIT - 1}, chat=False).top_k == TOP_K_LIMIT - 1
    assert parse_request({**body, "top_k": -1}, chat=False).top_k == 0  # vLLM's "off"
    for top_k in (TOP_K_LIMIT, 10**21):
        with pytest.raises(ApiError) as err:
            parse_request({**body, "top_k": top_k}, chat=False)
        assert err.value.status == 400 and err.value.param == "top_k", vars(err.value)


@pytest.mark.parametrize("top_k", ["1000000000000", "1000000000000000000000"])
def test_generate_top_k_past_the_limit_is_one_line_exit_2(top_k: str, capsys) -> None:
    code = main(["generate", "--model", "random:tiny-llama", "--mode", "ar", "--prompt", "5 6",
                 "--max-new-tokens", "2", "--temperature", "1", "--top-k", top_k])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"spd generate: error: sampling: top_k must be an integer >= 0 and below 2**31 (0 = off), " \
                                f"got {top_k}", err
