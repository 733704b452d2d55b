"""Faults with tensor parallelism: a SIGKILLed TP rank ends the run on every rank within the
receive timeout; its TP peer names it (rank, peer, tick), the driver names the stage it lost;
bad --tp values exit 2 with one line."""
from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import random_prompts, run_ranks
from test_faults import TIMEOUT_S, cli, generate_once, reported, wait_group_gone
from tp_cases import tp_engine_config

from spd_engine.engine.runtime.launch import FAULT_ENV

KILLED = 4  # n=2, T=2, separate driver: ranks 1, 2 are stage 0, ranks 3, 4 stage 1; 4 is TP rank 1 of stage 1

pytestmark = pytest.mark.multiproc


def test_killed_tp_rank_ends_the_run_within_the_timeout():
    proc = cli("generate", "--model", "random:tiny-llama", "--stages", "2", "--tp", "2", "--max-new-tokens", "400",
               "--prompt", "a prompt", "--timeout", str(TIMEOUT_S), "--capacity", "512", "--threads", "1",
               "--quiet", env={FAULT_ENV: f"{KILLED}:25"})
    start, lines = time.monotonic(), []
    try:
        for line in proc.stderr:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    end = time.monotonic() - start
    leftover = wait_group_gone(proc.pid, 5.0)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    text = "\n".join(line for _, line in lines)
    assert proc.returncode != 0 and leftover == [], text
    errors = reported(lines)
    assert KILLED not in errors
    assert errors.get(3, (None,))[0] == KILLED, text  # its TP peer, in the attention's all-reduce, names it
    assert errors[0][0] == 3, text  # the driver lost the stage's reporting rank
    assert end - min(t for _, _, t in errors.values()) <= TIMEOUT_S


@pytest.mark.slow
def test_killed_tp_rank_under_torchrun_style_launch(tmp_path, capfd, monkeypatch):
    """Every rank its own process and nobody killed from outside: each survivor exits with its own error."""
    monkeypatch.setenv(FAULT_ENV, f"{KILLED}:25")
    ecfg = tp_engine_config("spd", 2, 2, timeout_s=TIMEOUT_S, threads=1)
    out = run_ranks(ecfg, generate_once, (random_prompts(ecfg.model.cfg, [9])[0],), tmp_path, timeout=45 + TIMEOUT_S,
                    allow=("all_gather",))  # the TP all-reduce; any other collective still raises
    err = capfd.readouterr().err
    assert out.exitcodes[KILLED] == -signal.SIGKILL, (out.exitcodes, err[-3000:])
    assert all(code == 1 for r, code in enumerate(out.exitcodes) if r != KILLED), out.exitcodes
    errors = reported([(0.0, line) for line in err.splitlines()])
    assert errors[3][0] == KILLED and out.result is None, err[-3000:]


@pytest.mark.parametrize("args,phrase", [(["--tp", "2"], "does not divide num_kv_heads=3, num_heads=9"),
                                         (["--tp", "0"], "--tp must be an integer >= 1"),
                                         (["--mode", "ar", "--tp", "3"], "use --mode tp")])
def test_bad_tp_exits_2_with_one_line(args, phrase):
    proc = cli("generate", "--model", "random:smollm2-135m", "--prompt", "x", "--max-new-tokens", "2", *args)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and phrase in err and len(err.strip().splitlines()) == 1, err
