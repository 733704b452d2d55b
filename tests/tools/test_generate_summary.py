"""`spd generate` ends each answer with one summary line on stderr (what SPD did); --quiet drops it."""
from __future__ import annotations

import re

from spd_engine.tools.cli import main

ARGS = ["generate", "--model", "random:tiny-llama", "--capacity", "64", "--prefill-chunk", "16", "--threads", "1",
        "--prompt", "hello there", "--max-new-tokens", "12", "--ignore-eos"]  # 12 tokens on any CPU
SUMMARY = re.compile(r"^spd: 12 tokens, 11 ticks at n=1, alpha (\d\.\d\d), EAL 1\.00; [\d.]+ tok/s decode, "
                     r"prefill [\d.]+ s$", re.M)


def test_generate_ends_with_a_summary_line_and_quiet_drops_it(capsys, one_thread):
    assert main([*ARGS, "--stages", "1", "--colocate"]) == 0
    err = capsys.readouterr().err
    assert SUMMARY.search(err), err
    assert main([*ARGS, "--stages", "1", "--colocate", "--quiet"]) == 0
    assert "tok/s" not in capsys.readouterr().err
    assert main([*ARGS, "--mode", "ar", "--stages", "1"]) == 0
    assert re.search(r"^spd: 12 tokens, ar; [\d.]+ tok/s decode", capsys.readouterr().err, re.M)
