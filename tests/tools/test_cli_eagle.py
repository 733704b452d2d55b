"""The eagle baseline through the CLIs: `spd generate --mode eagle` (JSON stats, flags refused where
they would be ignored) and the eagle row of `spd bench` (acceptance length, lossless against ar)."""
from __future__ import annotations

import json

import pytest

from spd_engine.tools.cli import main

TINY = ["--model", "random:tiny-llama", "--threads", "1", "--capacity", "64"]


def test_generate_eagle_json(capsys):
    argv = ["generate", *TINY, "--mode", "eagle", "--eagle-k", "3", "--prompt", "hi", "--max-new-tokens", "12",
            "--quiet", "--json"]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["mode"] == "eagle" and rec["head"] == "random" and rec["n"] == 1 and rec["tokens"] == 12
    assert rec["target_passes"] == rec["ticks"] and rec["acceptance_length"] == pytest.approx(11 / rec["ticks"])
    ar = ["generate", *TINY, "--mode", "ar", "--stages", "1", "--prompt", "hi", "--max-new-tokens", "12", "--quiet",
          "--json"]
    assert main(ar) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == rec["token_ids"]


@pytest.mark.parametrize("argv, message", [
    (["--mode", "spd", "--eagle-k", "3"], "--eagle-k: not used without the eagle baseline"),
    (["--mode", "pp", "--eagle-head", "random"], "--eagle-head: not used without the eagle baseline"),
    (["--mode", "eagle", "--stages", "2"], "--stages: not used with --mode eagle"),
    (["--mode", "eagle", "--spec", "random"], "--spec: not used with --mode eagle"),
    (["--mode", "eagle", "--step-mode", "static"], "--step-mode: not used with --mode eagle"),
    (["--mode", "eagle", "--eagle-k", "0"], "--eagle-k must be >= 1"),
    (["--mode", "eagle", "--eagle-head", "/nonexistent"], "EAGLE head not found"),
])
def test_flags_refused(argv, message, capsys):
    assert main(["generate", *TINY, "--prompt", "x", "--max-new-tokens", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_eagle_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", *TINY, "--stages", "2", "--prompt", "x", "--max-new-tokens", "16", "--repeats", "1",
            "--configs", "ar,spd,eagle", "--eagle-k", "2", "--synthetic-alpha", "0.9", "--json", str(out)]
    assert main(argv) == 0
    assert "acc len" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    eagle = rows["eagle"]
    assert eagle["lossless"] is True and eagle["world_size"] == 1 and eagle["eal"] is None
    assert eagle["acceptance_length"] == pytest.approx(15 / eagle["ticks"]) and eagle["acceptance_length"] > 1.5
    assert rows["spd"]["eal"] is not None and rows["ar"].get("acceptance_length") is None
    assert report["eagle_k"] == 2 and report["eagle_head"] == "random"
    assert "note" not in eagle  # synthetic drafts: the head's training does not show in the row


def test_bench_eagle_row_notes_its_head(tmp_path, capsys):
    """The eagle row says how its head was trained, next to the row (here: not at all)."""
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--stages", "2", "--prompt", "x", "--max-new-tokens", "6", "--repeats", "1",
                 "--configs", "ar,eagle", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eagle"]["head_budget"]["under_trained"] and rows["eagle"]["note"] == "untrained (random) head"
    assert "note" not in rows["ar"]
    eagle_line = next(line for line in printed.splitlines() if line.lstrip().startswith("eagle "))
    assert eagle_line.rstrip().endswith("untrained (random) head")  # in the table, on the row itself
