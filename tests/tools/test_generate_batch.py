"""`spd generate --max-batch B [--max-rows R]`: several prompts in the pipeline at once give the answers
they get one at a time, in order, then one line for the run; bad values are refused."""
from __future__ import annotations

import json

from spd_engine.tools.cli import main

ARGS = ["generate", "--model", "random:tiny-llama", "--capacity", "64", "--prefill-chunk", "16", "--threads", "1",
        "--stages", "2", "--colocate", "--prompt", "hello there", "--prompt", "a longer prompt than that one",
        "--prompt", "x", "--max-new-tokens", "10", "--ignore-eos", "--json", "-"]


def answers(out: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in out.splitlines() if line.startswith("{")]


def test_max_batch_answers_equal_one_at_a_time(capsys, one_thread):
    assert main(ARGS) == 0
    alone = answers(capsys.readouterr().out)
    assert main([*ARGS, "--max-batch", "2"]) == 0
    cap = capsys.readouterr()
    assert answers(cap.out) == alone and len(alone) == 3
    assert "spd: 3 requests at B=2: 30 tokens in" in cap.err and "stage utilization S0" in cap.err
    assert main([*ARGS, "--max-batch", "3", "--max-rows", "1"]) == 0  # one decode row per stage step
    assert answers(capsys.readouterr().out) == alone


def test_suffix_runs_travel_in_a_batch_and_keep_the_answers(capsys, one_thread):
    """--suffix-run 4 at --max-batch 2: each answer and tick count as alone, and runs were verified."""
    argv = [*ARGS, "--suffix-run", "4", "--max-new-tokens", "24"]
    got = {}
    for batch in ("1", "2"):
        assert main([*argv, "--max-batch", batch]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        got[batch] = [(d["token_ids"], d["ticks"], d["by_source"].get("suffix-run", {}).get("verified", 0))
                      for d in lines]
    assert got["2"] == got["1"] and len(got["1"]) == 3
    assert sum(v for _, _, v in got["2"]) > 0, "no suffix run travelled in the batch"


def test_bad_max_batch_is_refused(capsys):
    assert main([*ARGS, "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1" in capsys.readouterr().err
    assert main([a for a in ARGS if a != "--colocate"] + ["--mode", "pp", "--max-batch", "2"]) == 2
    assert "--max-batch > 1 needs --mode spd, got --mode pp" in capsys.readouterr().err
    assert main([*ARGS, "--max-batch", "2", "--max-rows", "2", "--suffix-run", "4"]) == 2  # one token per entry
    assert "--suffix-run 4: not used with --max-rows 2" in capsys.readouterr().err
    for bad in (["--max-rows", "2"], ["--max-batch", "2", "--max-rows", "0"]):
        assert main([*ARGS, *bad]) == 2
        assert "--max-rows" in capsys.readouterr().err
