"""`spd bench` in the field's formats: TTFT / TPOT / ITL percentiles (numpy), --ignore-eos, and the tick
timeline as a Chrome trace (Trace Event Format) that Perfetto opens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spd_engine.bench.chrome_trace import trace_events
from spd_engine.bench.speed import TokenClock, latency_summary
from spd_engine.engine.model_config import tiny_config
from spd_engine.tools.cli import main


def test_latency_definitions():
    a, b = TokenClock(start=10.0, times=[10.5, 10.6, 10.9]), TokenClock(start=20.0, times=[20.2])
    out = latency_summary([a, b])
    assert out["ttft_p50_ms"] == pytest.approx(350.0) and out["ttft_mean_ms"] == pytest.approx(350.0)  # 500, 200
    assert out["tpot_p50_ms"] == pytest.approx(200.0)  # (10.9 - 10.5) / 2; b has one token: no TPOT
    assert out["itl_p90_ms"] == pytest.approx(float(np.percentile([100.0, 300.0], 90)))
    assert latency_summary([TokenClock(start=0.0)])["ttft_p99_ms"] is None


def synthetic_trace() -> dict:
    return {"driver": [(1, "pdm", 1.000, 1.002), (1, "verify", 1.002, 1.0025), (2, "send", 1.003, 1.0031)],
            "stages": [[(0.999, 1.0005, 1.004)], [(1.001, 1.004, 1.006)]]}


def test_chrome_trace_events_follow_the_trace_event_format():
    events = trace_events(synthetic_trace(), "spd n=2")
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 3 + 2 * 2  # driver events; a wait and a compute per stage message
    for e in complete:
        assert {"name", "ph", "pid", "tid", "ts", "dur"} <= set(e) and e["ts"] >= 0 and e["dur"] >= 0
    assert min(e["ts"] for e in complete) == 0  # microseconds from the first event
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "driver", 1: "stage 0", 2: "stage 1"}
    compute0 = next(e for e in complete if e["tid"] == 1 and e["name"] == "compute")
    assert compute0["ts"] == pytest.approx(1500.0) and compute0["dur"] == pytest.approx(3500.0)


@pytest.fixture
def eos_first_model(tmp_path):
    """An HF directory whose greedy first token is its EOS (all logits 0 -> id 0 = EOS)."""
    from tests.checkpoint_tools.ckpt_helpers import write_tiny_hf

    cfg = tiny_config("llama", eos_token_ids=(0,), num_layers=2)
    state = write_tiny_hf(tmp_path / "m", cfg)
    state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    return tmp_path / "m"


@pytest.mark.multiproc
def test_bench_ignore_eos_latency_columns_and_chrome_trace(tmp_path, eos_first_model, monkeypatch, capsys):
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    argv = ["bench", "--model", str(eos_first_model), "--stages", "2", "--threads", "1", "--prompt", "hello",
            "--prompt", "a second prompt", "--max-new-tokens", "6", "--repeats", "1", "--configs", "ar,spd"]
    assert main([*argv, "--json", str(tmp_path / "eos.json")]) == 0
    rows = json.loads((tmp_path / "eos.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [2, 2]  # each request ends at its first token, the EOS
    trace = tmp_path / "trace.json"
    assert main([*argv, "--ignore-eos", "--json", str(tmp_path / "all.json"), "--chrome-trace", str(trace)]) == 0
    report = json.loads((tmp_path / "all.json").read_text())
    assert report["ignore_eos"] and [r["tokens"] for r in report["rows"]] == [12, 12] and not report["mismatches"]
    for r in report["rows"]:
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["tpot_p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "ITL p99" in printed
    doc = json.loads(trace.read_text())
    lanes = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"driver", "stage 0", "stage 1"}
    assert {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"} >= {"pdm", "verify", "compute", "wait"}


def test_bench_tp_configs_need_tp(capsys):
    assert main(["bench", "--model", "random:tiny-llama", "--configs", "ar,tp", "--prompt", "x", "--max-new-tokens", "2"]) == 2
    assert "need --tp >= 2" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.slow
def test_bench_tp_rows_beside_the_others(tmp_path):
    """tp and spd-tp rows in the same run as ar and pp: --tp applies to them only, each is checked
    against greedy decoding with its own TP split, and the report counts outputs unlike ar's."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:tiny-llama", "--stages", "2", "--tp", "2", "--threads", "1",
                 "--prompt", "hello", "--max-new-tokens", "8", "--repeats", "1", "--configs", "pp,tp,spd-tp",
                 "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert {k: (r["world_size"], r["tp"]) for k, r in rows.items()} == {"ar": (1, 1), "pp": (2, 1), "tp": (2, 2),
                                                                        "spd-tp": (5, 2)}
    assert all(r["lossless"] for r in rows.values())
    assert rows["tp"]["outputs_unlike_ar"] == 0 and rows["spd-tp"]["outputs_unlike_ar"] == 0
