"""CLI conventions shared by every `spd` subcommand: --version, every default in the help, one spelling
per concept, run-config defaults from RunConfig itself, refused flags that a command would ignore."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json

import pytest

from spd_engine.engine.runtime.run_config import run_fields
from spd_engine.tools import cli
from spd_engine.tools.cli import SUBCOMMANDS, main
from spd_engine.tools.cli_conventions import resolve_dtype

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser (convert's actions included), built as cli.main builds them."""
    out = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = cli.sub_parser(f"spd {name}", help_text)
        importlib.import_module(module).add_arguments(p)
        out[name] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                out.update({f"{name} {k}": v for k, v in a.choices.items()})
    return out


PARSERS = parsers()
MINE = [n for n in PARSERS if n.split()[0] not in ("netbench", "plan", "serve")]  # those keep their own


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and not isinstance(a, (argparse._HelpAction,
                                                                               argparse._VersionAction))]


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("spd-engine ") and out.split()[1][0].isdigit()


@pytest.mark.parametrize("name", MINE)
def test_help_shows_every_default(name):
    p = PARSERS[name]
    text = p.format_help()
    for a in options(p):
        assert a.help, f"spd {name} {a.option_strings[0]} has no help"
        if a.default not in (None, False):  # a value the user gets without asking: the help must say it
            assert "default" in p._get_formatter()._get_help_string(a), (name, a.option_strings)
    assert "(default: None)" not in text


def test_run_defaults_come_from_run_config():
    p = PARSERS["generate"]
    defaults = {name: f.default for name, f in run_fields().items() if f.default is not dataclasses.MISSING}
    flag_of = {"runtime.timeout_s": "timeout"}
    for field in ("drafting.pdm_layers", "runtime.prefill_chunk", "runtime.timeout_s", "parallel.threads",
                  "parallel.device", "runtime.seed", "runtime.step_mode", "mode"):
        want = defaults[field]
        want = getattr(want, "value", want)
        assert p.get_default(flag_of.get(field, field.split(".")[-1])) == want, field
    # --dtype auto picks by device; on RunConfig's default device it is RunConfig's default dtype
    assert p.get_default("dtype") == "auto"
    assert resolve_dtype("auto", defaults["parallel.device"]) == defaults["model.dtype"]
    folder = cli.__file__.rsplit("/", 1)[0]
    source = "".join(open(f"{folder}/{m}.py").read() for m in ("cli_conventions", "engine_args", "model_args"))
    assert "default=60.0" not in source and "default=128" not in source  # no second copy of a RunConfig default


@pytest.mark.parametrize("name", MINE)
def test_one_spelling_per_concept(name):
    flags = {s for a in options(PARSERS[name]) for s in a.option_strings}
    assert not flags & {"--pp", "--json-out", "--nproc-stages", "--num-stages", "--n-stages"}, flags
    for a in options(PARSERS[name]):
        if a.dest in ("dtype", "autocast", "target_dtype"):  # canonical names and the short aliases
            assert a.type("bf16") == "bfloat16" and a.type("fp16") == "float16" and a.type("float32") == "float32"
        if "--json" in a.option_strings:
            assert a.nargs == "?" and a.const == "-"  # --json: stdout; --json FILE: a file


def test_abbreviations_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "random:tiny-llama", "--max-new", "3", "--prompt", "x"])


@pytest.mark.parametrize("argv, message", [
    (["--mode", "ar", "--stages", "4"], "--stages: not used with --mode ar"),
    (["--mode", "pp", "--spec", "random"], "--spec: not used with --mode pp"),
    (["--mode", "ar", "--stages", "1", "--colocate"], "--colocate: not used with --mode ar"),
])
def test_a_flag_the_command_would_ignore_is_refused(argv, message, capsys):
    rc = main(["generate", "--model", "random:tiny-llama", "--prompt", "x", "--max-new-tokens", "2", *argv])
    assert rc == 2 and message in capsys.readouterr().err


def test_pdm_layers_with_a_trained_head_is_refused(tmp_path, capsys):
    head = tmp_path / "head"
    head.mkdir()
    (head / "pdm.json").write_text("{}")
    rc = main(["generate", "--model", "random:tiny-llama", "--prompt", "x", "--spec", str(head),
               "--pdm-layers", "2"])
    assert rc == 2 and "--pdm-layers: not used with a trained head" in capsys.readouterr().err


def test_seed_with_real_weights_and_a_trained_head_is_refused(tmp_path, capsys, monkeypatch):
    from ckpt_helpers import write_tiny_hf

    from spd_engine.engine.model.model_config import tiny_config

    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    write_tiny_hf(tmp_path / "m", tiny_config("llama"))
    rc = main(["generate", "--model", str(tmp_path / "m"), "--mode", "ar", "--stages", "1", "--prompt", "x",
               "--seed", "3"])
    assert rc == 2 and "--seed: not used with real weights" in capsys.readouterr().err


def test_bench_takes_no_mode_flag_and_eval_only_spd_or_eagle(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--model", "random:tiny-llama", "--mode", "pp"])
    assert "unrecognized arguments: --mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--model", "random:tiny-llama", "--mode", "pp"])
    assert "invalid choice: 'pp'" in capsys.readouterr().err


def test_generate_json_has_text_token_ids_and_head(capsys, tmp_path):
    argv = ["generate", "--model", "random:tiny-llama", "--mode", "ar", "--prompt", "hi", "--max-new-tokens", "5",
            "--threads", "1", "--quiet", "--capacity", "64"]
    assert main([*argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(rec["token_ids"]) == rec["tokens"] and rec["text"] is None and rec["head"] is None  # ar: no head
    assert main([*argv, "--json", str(tmp_path / "out.jsonl")]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["token_ids"] == rec["token_ids"]
