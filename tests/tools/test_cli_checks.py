"""The command line checks before it spends: an empty prompt, an output path that cannot be
written, --chat on a model without a chat template and a missing optional dependency each end
with one line and exit 2 before a rank starts or a model converts; vLLM's flag spellings and
`--dtype auto`; `spd plan`'s "best on n devices" column agrees with its recommendation lines."""
from __future__ import annotations

import argparse
import re
import subprocess
import time

import pytest

from spd_engine.engine.runtime.launch import spd_command
from spd_engine.tools import cli
from spd_engine.tools.cli_conventions import resolve_dtype
from spd_engine.tools.engine_args import add_engine_arguments

TINY = ["--model", "random:tiny-llama", "--stages", "2", "--threads", "1"]


def spd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*spd_command(), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "prompt 1 is empty"),
    (["--prompt", "hi", "--json", "/nonexistent/x.json"], "the directory /nonexistent does not exist"),
    (["--prompt", "hi", "--chat"], "--chat needs a model with a tokenizer"),
], ids=["empty-prompt", "json-path", "chat-without-template"])
def test_generate_refuses_before_any_rank_starts(args, message):
    """Before: the empty prompt spawned the ranks and printed two 'rank N failed' lines first; the
    bad --json path failed with a raw [Errno 2] after the whole run; --chat was ignored (exit 0)."""
    t0 = time.monotonic()
    proc = spd("generate", *TINY, "--max-new-tokens", "4", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("spd generate: error:"), proc.stderr
    assert "rank" not in proc.stderr and time.monotonic() - t0 < 60


def test_serve_without_its_extra_names_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert cli.main(["serve", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "spd serve: error: spd serve needs fastapi: pip install 'spd-engine[serve]'"


def test_vllm_spellings_and_dtype_auto():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    a = p.parse_args(["-tp", "2", "-pp", "3", "--max-model-len", "1024"])
    assert (a.tp, a.stages, a.capacity, a.dtype) == (2, 3, 1024, "auto")
    b = p.parse_args(["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2", "--dtype", "bf16"])
    assert (b.tp, b.stages, b.dtype) == (4, 2, "bfloat16")
    assert resolve_dtype("auto", "cuda:1") == "bfloat16" and resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cpu") == "float16"


def test_plan_best_on_n_devices_agrees_with_the_recommendation(capsys):
    """Before: the column compared only configurations of the row's stage count n, the
    recommendation every configuration on n devices (TP2 x SPD6 sep runs on 13): at n = 5, 7, 9,
    ... they named different winners."""
    assert cli.main(["plan", "--reference", "smollm2-135m-h200", "--assume-link", "5,100", "--alpha", "0.43"]) == 0
    out = capsys.readouterr().out
    column = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+\d+\.\d.*\s{2}(pp|tp|spd \w+|tp\d+ x spd\d+ \w+)\s*$", line)
        if m:
            column[int(m.group(1))] = {"pp": "PP", "tp": "TP"}.get(m.group(2), "SPD" if m.group(2).startswith("spd")
                                                                   else "TP x SPD (hybrid)")
    advice = {}
    for who, ns in re.findall(r"on the same n devices, (.+?) is fastest for n = ([\d, -]+)", out):
        for part in ns.split(","):
            lo, _, hi = part.strip().partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                advice[n] = who
    assert len(column) == 15 and column == advice, (column, advice)


def test_a_truncated_config_json_is_refused_before_converting(tmp_path):
    """Before: 'converting ... (once)' was printed, then the conversion failed."""
    from spd_engine.tools.model_args import resolve_model

    hf_dir = resolve_model("smollm2-135m")[1]  # the fetched HF directory (it holds the tokenizer)
    broken = tmp_path / "model"
    broken.mkdir()
    for f in hf_dir.iterdir():
        (broken / f.name).symlink_to(f)
    (broken / "config.json").unlink()
    (broken / "config.json").write_text((hf_dir / "config.json").read_text()[:120])
    proc = spd("generate", "--model", str(broken), "--prompt", "hi", "--max-new-tokens", "2")
    assert proc.returncode == 2 and "converting" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"spd generate: error: {broken}/config.json is not valid JSON")
