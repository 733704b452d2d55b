"""`spd convert ...` end to end through the dispatcher: every action, exit codes, clean user errors."""
from __future__ import annotations

import pytest
from ckpt_helpers import assert_same_tensors, write_tiny_hf

from spd_engine.checkpoint_tools import hf
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.tools.cli import main


def test_all_actions_chain(tmp_path, capsys):
    cfg = tiny_config("llama")
    source = write_tiny_hf(tmp_path / "hf", cfg)
    assert main(["convert", "hf2engine", str(tmp_path / "hf"), str(tmp_path / "e"), "--stage-layers", "2,2,1,1",
                 "--tp", "2"]) == 0
    assert "stages [2, 2, 1, 1], tp 2" in capsys.readouterr().out
    assert main(["convert", "export-megatron", str(tmp_path / "e"), str(tmp_path / "m"), "--release-layout"]) == 0
    assert main(["convert", "import-megatron", str(tmp_path / "m"), str(tmp_path / "e2"), "--stages", "3"]) == 0
    assert ckpt.read_index(tmp_path / "e2").stage_layers == (2, 2, 2)
    assert (tmp_path / "e2" / "tokenizer_config.json").is_file()  # carried through the Megatron export
    assert main(["convert", "engine2hf", str(tmp_path / "e2"), str(tmp_path / "hf2")]) == 0
    assert_same_tensors(hf.read_hf_state(tmp_path / "hf2"), source)
    capsys.readouterr()
    assert main(["convert", "verify", str(tmp_path / "hf"), str(tmp_path / "m"), "--atol", "0",
                 "--reference", "engine"]) == 0
    assert capsys.readouterr().out.startswith("PASS")


def test_verify_exit_code_beyond_tolerance(tmp_path, capsys):
    write_tiny_hf(tmp_path / "a", tiny_config("qwen3"), seed=0)
    write_tiny_hf(tmp_path / "b", tiny_config("qwen3"), seed=1)
    assert main(["convert", "verify", str(tmp_path / "a"), str(tmp_path / "b"), "--prompts", "1"]) == 1
    assert capsys.readouterr().out.startswith("FAIL")


@pytest.mark.parametrize("argv,message", [
    (["hf2engine", "{hf}", "{out}", "--tp", "4"], "--tp 4 does not divide num_kv_heads=2"),
    (["hf2engine", "{hf}", "{out}", "--stages", "9"], "9 stages is more than the model's 6 layers"),
    (["hf2engine", "{hf}", "{out}", "--stage-layers", "3,4"], "sum to 7"),
    (["hf2engine", "{hf}", "{out}", "--stage-layers", "3,x"], "comma-separated integers"),
    (["engine2hf", "{hf}", "{out}"], "index.json is missing"),
    (["import-megatron", "{hf}", "{out}"], "metadata.json is missing"),
    (["verify", "{hf}", "{out}"], "does not exist"),
])
def test_user_errors_exit_2_with_one_line(tmp_path, capsys, argv, message):
    write_tiny_hf(tmp_path / "hf", tiny_config("llama"))
    argv = [a.format(hf=tmp_path / "hf", out=tmp_path / "out") for a in argv]
    assert main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_pp_and_stage_layers_are_exclusive(tmp_path):
    with pytest.raises(SystemExit):
        main(["convert", "hf2engine", "a", "b", "--stages", "2", "--stage-layers", "3,3"])


@pytest.mark.parametrize("old,new", [("hf2mcore", "hf2engine"), ("mcore2hf", "engine2hf")])
def test_former_names_still_convert_with_a_note(tmp_path, capsys, old, new):
    source = write_tiny_hf(tmp_path / "hf", tiny_config("llama"))
    assert main(["convert", "hf2engine", str(tmp_path / "hf"), str(tmp_path / "e")]) == 0
    src, dst = (tmp_path / "hf", tmp_path / "e2") if old == "hf2mcore" else (tmp_path / "e", tmp_path / "hf2")
    capsys.readouterr()
    assert main(["convert", old, str(src), str(dst)]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"spd convert: {old} is now named {new} (it ") and "\n" not in err
    assert ("import-megatron reads" if old == "mcore2hf" else "export-megatron writes") in err
    if old == "mcore2hf":
        assert_same_tensors(hf.read_hf_state(dst), source)
    else:
        assert ckpt.read_index(dst).stage_layers == (6,)


def test_megatron_spellings_of_the_split_flags(tmp_path, capsys):
    write_tiny_hf(tmp_path / "hf", tiny_config("llama"))
    assert main(["convert", "hf2engine", str(tmp_path / "hf"), str(tmp_path / "e"),
                 "--pipeline-model-parallel-size", "3", "--tensor-model-parallel-size", "2"]) == 0
    index = ckpt.read_index(tmp_path / "e")
    assert index.stage_layers == (2, 2, 2) and index.tp == 2
