"""The head screen's several-row timing script runs on a small head and reports both products."""
from __future__ import annotations

import pytest
import torch

from spd_engine.tools.experiments.screen_rows_time import main, time_rows

pytestmark = pytest.mark.skipif(not (hasattr(torch, "_int_mm") and hasattr(torch, "_weight_int8pack_mm")),
                                reason="torch lacks the screen's kernels")


def test_times_both_products(capsys):
    t = time_rows(512, 64, [1, 5], iters=3, warmup=1)
    assert set(t) == {1, 5} and all(a > 0 and b > 0 for a, b in t.values())
    assert main(["--shape", "512,64", "--rows", "2"]) == 0
    assert "2 row(s): bf16 kernel" in capsys.readouterr().out


def test_a_head_the_screen_cannot_take_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["--shape", "512,60"])  # H not a multiple of the kernel's 16
    assert "do not run here" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [(["--shape", "512"], "--shape takes 2 integers"),
                                          (["--shape", "512,0"], "--shape takes 2 integers"),
                                          (["--rows", "0"], "--rows takes integers >= 1"),
                                          (["--rows", "a"], "--rows takes integers >= 1"),
                                          (["--threads", "0"], "--threads must be >= 1")])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
