"""`LLM(model, tokenizer=PATH)`: the --tokenizer flag reaches the Python API; without a tokenizer a
model with real weights refuses text (token ids still run)."""
from __future__ import annotations

import pytest
from ckpt_helpers import tiny_state
from tiny_tokenizer import write_tiny_tokenizer

from spd_engine import LLM, SamplingParams
from spd_engine.checkpoint_tools import shard
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.engine.model.tokenizer import Tokenizer

OPTIONS = dict(stages=2, threads=1, capacity=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_tok")
    cfg = tiny_config("llama")
    shard.write_engine(root / "e", cfg, tiny_state(cfg))
    write_tiny_tokenizer(root / "tok")
    return root


@pytest.mark.slow  # two LLM starts (~20 s)
def test_llm_takes_a_tokenizer_and_refuses_text_without_one(ckpt):
    tok = Tokenizer.from_dir(ckpt / "tok")
    params = SamplingParams(max_tokens=3)
    with LLM(str(ckpt / "e"), tokenizer=str(ckpt / "tok"), **OPTIONS) as llm:
        out = llm.generate("hello world", params)[0]
        assert out.prompt_token_ids == tok.encode("hello world")
        assert out.outputs[0].text == tok.text(out.outputs[0].token_ids)
    with LLM(str(ckpt / "e"), **OPTIONS) as llm:
        with pytest.raises(ValueError, match=r"has no tokenizer.*LLM\(\.\.\., tokenizer=PATH\)"):
            llm.generate("hello world", params)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3
