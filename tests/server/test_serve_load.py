"""The `spd serve` load test (tools/experiments/serve_load.py) end to end on the tiny model: 16 concurrent
clients with a small queue, then with random disconnects; it finds no problem and reports its
latency percentiles. Its checks are the ones that would catch lost, cut or mixed replies."""
from __future__ import annotations

import json

import pytest

from spd_engine.tools.experiments.serve_load import Outcome, check, main


@pytest.mark.multiproc
@pytest.mark.slow
def test_load_test_passes_on_the_tiny_model(tmp_path):
    out = tmp_path / "load.json"
    code = main(["--clients", "16", "--requests", "2", "--max-tokens", "12", "--max-queue", "4", "--endpoint",
                 "completions", "--disconnect", "0.4", "--json-out", str(out), "--", "--model", "random:tiny-llama",
                 "--stages", "2", "--threads", "1", "--capacity", "256"])
    report = json.loads(out.read_text())
    assert code == 0 and report["problems"] == [], report["problems"]
    steady, drops = report["phases"]["steady"], report["phases"]["disconnect"]
    assert steady["completed"] == 32 and steady["429s"] > 0  # 16 clients, room for 1 + 4
    assert drops["dropped"] > 0 and drops["completed"] + drops["dropped"] == 32
    assert steady["ttft_ms_p50"] <= steady["ttft_ms_p99"] and steady["e2e_ms_p50"] <= steady["e2e_ms_p99"]
    assert report["server_exit_code"] == 0


def test_the_checks_catch_mixed_cut_and_unfinished_replies():
    refs = {0: "1 2 3 ", 1: "4 5 6 "}
    good = [Outcome(0, "1 2 3 ", "length", True), Outcome(1, "4 5 ", None, False, dropped=True)]
    assert check(good, refs, limit=4) == []
    mixed = Outcome(0, "4 5 6 ", "length", True)
    cut = Outcome(1, "4 5 ", "length", True)
    unfinished = Outcome(0, "1 2 3 ", "length", False)
    bad_drop = Outcome(1, "1 2 ", None, False, dropped=True)
    early_429 = Outcome(0, "1 2 3 ", "length", True, rejections=[3])
    for o in (mixed, cut, unfinished, bad_drop, early_429):
        assert len(check([o], refs, limit=4)) == 1, o
