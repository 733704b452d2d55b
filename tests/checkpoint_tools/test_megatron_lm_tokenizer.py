"""The whole path of a Megatron-LM user, by the command line: a checkpoint megatron-core built and
saved as Megatron-LM does by default (linear biases, untied, GQA, args in common.pt, iter_0000100 +
tracker) imports with `--stages 2 --tokenizer DIR` and no config file, and `spd generate` on a text
prompt gives megatron-core's own greedy tokens. The tokenizer is a word-level one whose words are
the token ids ("w5" is 5), so the text prompt encodes to exactly the ids megatron-core ran."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_megatron_lm_import import MATRIX, ROOT, TOKENS, WORKER
from tokenizers import Tokenizer, models, pre_tokenizers

from spd_engine.engine.model.tokenizer import Tokenizer as EngineTokenizer
from spd_engine.tools.cli import main


def word_tokenizer(path, vocab: int) -> None:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{vocab - 1}"}))


@pytest.mark.slow
def test_megatron_lm_checkpoint_with_a_tokenizer_generates_megatron_cores_tokens(tmp_path, one_thread, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core is a test extra")
    (tmp_path / "tokens.json").write_text(json.dumps(TOKENS.tolist()))
    (tmp_path / "specs.json").write_text(json.dumps({"linear_bias": MATRIX["linear_bias"]}))
    run = subprocess.run([sys.executable, str(WORKER), "save", str(tmp_path / "specs.json"),
                          str(tmp_path / "tokens.json"), str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "linear_bias" / "latest_checkpointed_iteration.txt").is_file()
    word_tokenizer(tmp_path / "tok", MATRIX["linear_bias"]["padded_vocab_size"])
    assert main(["convert", "import-megatron", str(tmp_path / "linear_bias"), str(tmp_path / "e"), "--stages", "2",
                 "--tokenizer", str(tmp_path / "tok")]) == 0
    import torch

    want = torch.load(tmp_path / "linear_bias.pt")["greedy"]  # megatron-core's greedy tokens, [B, 8]
    for b in range(TOKENS.shape[0]):
        text = " ".join(f"w{i}" for i in TOKENS[b].tolist())
        assert EngineTokenizer.from_dir(tmp_path / "e").encode(text) == TOKENS[b].tolist()
        capsys.readouterr()
        assert main(["generate", "--model", str(tmp_path / "e"), "--stages", "2", "--threads", "1", "--capacity",
                     "64", "--prompt", text, "--max-new-tokens", str(want.shape[1]), "--ignore-eos", "--json",
                     "--quiet"]) == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rec["token_ids"] == want[b].tolist() and rec["mode"] == "spd" and rec["n"] == 2
        assert rec["text"] == " ".join(f"w{i}" for i in want[b].tolist())
