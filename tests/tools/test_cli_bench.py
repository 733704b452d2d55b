"""`spd bench` in the field's formats: TTFT / TPOT / ITL percentiles (numpy), --ignore-eos, and the tick
timeline as a Chrome trace (Trace Event Format) that Perfetto opens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spd_engine.bench.chrome_trace import trace_events
from spd_engine.bench.speed import TokenClock, latency_summary, split_advice
from spd_engine.engine.model.model_config import tiny_config
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


def test_split_advice_balances_the_ranks_measured_work():
    """The co-located driver's PDM and verification count on stage 0's rank, a verifying last
    stage's head on its own; with the driver on a rank of its own only the stages' work counts.
    (Medians of a real Qwen2.5-0.5B run at 12/12 on a 2-core host.)"""
    b = {"stage0_compute_ms": 46.75, "stage1_compute_ms": 67.01, "stage1_verify_ms": 21.01,
         "driver_pdm_ms": 5.03, "driver_verify_ms": 0.02, "driver_other_ms": 0.14, "tick_ms": 66.95}
    co = split_advice(b, (12, 12), colocate=True)
    assert co["stage_layers"] == [12, 12] and co["busiest_ms"] == pytest.approx(67.01)
    assert co["balanced_layers"] == [14, 10] and co["balanced_busiest_ms"] < 60.0
    apart = split_advice({**b, "driver_pdm_ms": 40.0}, (12, 12), colocate=False)  # the PDM's rank is not a stage:
    assert apart["balanced_layers"] == [15, 9]  # max(15 x 3.896, 9 x 3.833 + 21.01)
    heavy = split_advice({**b, "driver_pdm_ms": 40.0}, (12, 12), colocate=True)  # a heavy PDM beside stage 0:
    assert heavy["balanced_layers"] == [9, 15]  # max(9 x 3.896 + 40.16, 15 x 3.833 + 21.01)


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
    from ckpt_helpers import write_tiny_hf

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


@pytest.mark.multiproc
def test_bench_hf_rows_beside_the_engine(tmp_path, eos_first_model, monkeypatch, capsys):
    """transformers' generate, plain and with prompt lookup, in the same run: every logit of this model
    is 0, so greedy decoding repeats id 0 and a lookup round commits several tokens per target pass."""
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "hf.json"
    assert main(["bench", "--model", str(eos_first_model), "--stages", "2", "--threads", "1", "--prompt", "hello",
                 "--ignore-eos", "--max-new-tokens", "24", "--repeats", "1", "--configs", "ar,hf,hf-lookup",
                 "--lookup-tokens", "4",
                 "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    # every row against each hf row too; from one repeat every ratio but a row's own is noisy
    lookup_vs_hf = rows["hf-lookup"]["decode_tok_s_per_repeat"][0] / rows["hf"]["decode_tok_s_per_repeat"][0]
    assert rows["hf-lookup"]["speedup_vs_hf"] == pytest.approx(lookup_vs_hf)
    assert rows["ar"]["speedup_vs_hf_lookup_noisy"]
    assert rows["ar"]["speedup_vs_hf_lookup_noisy_reason"] == "a single repeat"
    assert not rows["hf"]["speedup_vs_hf_noisy"] and rows["hf"]["speedup_vs_hf"] == 1.0
    printed = capsys.readouterr().out
    assert "x hf-lookup" in printed and "every ratio rests on a single repeat" in printed
    assert f"{rows['hf']['speedup_vs_ar']:.2f} noisy" in printed
    assert set(rows) == {"ar", "hf", "hf-lookup"}
    for r in rows.values():
        assert r["tokens"] == 24 and r["equal_prompts"] == 1 and r["lossless"] and r["decode_tok_s"] > 0
    assert rows["hf"]["ticks"] == 23 and rows["hf"]["eal"] is None  # one target pass per decode token
    assert "acceptance_length" not in rows["hf"]
    lookup = rows["hf-lookup"]
    assert lookup["ticks"] < 23 / 2 and lookup["acceptance_length"] == pytest.approx(23 / lookup["ticks"])
    assert lookup["itl_p50_ms"] < 0.1 * rows["hf"]["itl_p50_ms"]  # tokens of one lookup pass arrive together


@pytest.mark.multiproc
def test_bench_hf_assisted_row_with_a_draft_model(tmp_path, eos_first_model, monkeypatch):
    """transformers' assisted generation with the model as its own assistant: every draft is the
    target's token, so a target pass commits several, and the tokens equal ar's."""
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "assisted.json"
    argv = ["bench", "--model", str(eos_first_model), "--stages", "2", "--threads", "1", "--prompt", "hello",
            "--ignore-eos", "--max-new-tokens", "24", "--repeats", "1", "--json", str(out)]
    assert main([*argv, "--configs", "ar,hf-assisted", "--assistant", str(eos_first_model)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assisted = rows["hf-assisted"]
    assert assisted["tokens"] == 24 and assisted["lossless"] and assisted["equal_prompts"] == 1
    assert assisted["ticks"] < 23 / 2 and assisted["acceptance_length"] == pytest.approx(23 / assisted["ticks"])
    assert main([*argv, "--configs", "ar,hf-assisted"]) == 2  # no draft model given
    assert main([*argv, "--configs", "ar,hf", "--assistant", str(eos_first_model)]) == 2  # given, unused


def test_a_peer_that_differs_is_reported_not_failed(tmp_path, monkeypatch):
    import contextlib

    from spd_engine.bench import speed
    from spd_engine.bench.hf_peer import HFPeer
    from spd_engine.engine.protocol.metrics import GenerationResult
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime

    class Fake:
        def __init__(self, shift: int) -> None:
            self.shift = shift

        def generate(self, prompt, max_new, eos, draft_policy=None, on_token=None):
            toks = [(t + self.shift) % 7 for t in range(max_new)]
            for t in toks if on_token else ():
                on_token(t)
            return GenerationResult(tokens=toks, n=1, ticks=max_new - 1, decode_s=1.0)

    from spd_engine.engine.protocol.topology import Topology

    cfg = tiny_config("llama", num_layers=2)
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(2, n=1)), mode="ar", runtime=Runtime(capacity=64))
    cases = [speed.BenchCase("ar", ecfg), speed.BenchCase("hf", ecfg, HFPeer(tmp_path, torch.float32, 1))]
    monkeypatch.setattr(speed, "launch", lambda e: contextlib.nullcontext(Fake(0)))
    monkeypatch.setattr(HFPeer, "open", lambda self: contextlib.nullcontext(Fake(1)))
    report = speed.bench(cases, [[1, 2]], 5, (), 1)
    assert report["mismatches"] == [] and report["peer_mismatches"] == ["hf"]
    assert [r["equal_prompts"] for r in report["rows"]] == [1, 0]


def test_hf_rows_need_a_model_in_hf_form():
    from spd_engine.tools.model_args import hf_model_dir

    with pytest.raises(ValueError, match="no Hugging Face form"):
        hf_model_dir("random:tiny-llama")


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


@pytest.mark.multiproc
def test_bench_reports_the_colocated_residual_per_tick(tmp_path, capsys):
    """spd-colocate is always traced: its residual (tick less stage 0's compute, the PDM and the
    verification) comes as a per-request mean and as p50 / p90 over every tick but the last
    (whose span has no end) of the last repeat."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--prompt", "hello",
                 "--max-new-tokens", "12", "--repeats", "2", "--configs", "ar,spd-colocate", "--synthetic-alpha", "1",
                 "--suffix-drafts", "off", "--json", str(out)]) == 0
    row = next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "spd-colocate")
    b = row["breakdown_ms_per_tick"]
    assert row["residual_ticks"] == row["ticks"] - 1
    assert 0 < row["residual_ms"] < b["tick_ms"] - b["stage0_compute_ms"]
    assert 0 < row["residual_tick_p50_ms"] <= row["residual_tick_p90_ms"]
    printed = capsys.readouterr().out
    assert "spd-colocate residual" in printed
    assert row["split"]["stage_layers"] == [3, 3] and sum(row["split"]["balanced_layers"]) == 6
    assert "spd-colocate split [3, 3]: busiest rank" in printed
    assert "split" not in next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "ar")
    # the ratio to ar is taken per repeat (repeat i over ar's repeat i), its median and range reported
    ar = next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "ar")
    per = [a / b for a, b in zip(row["decode_tok_s_per_repeat"], ar["decode_tok_s_per_repeat"])]
    assert len(per) == 2 and row["speedup_vs_ar_per_repeat"] == pytest.approx(per)
    assert (row["speedup_vs_ar_min"], row["speedup_vs_ar_max"]) == pytest.approx((min(per), max(per)))
    assert row["speedup_vs_ar"] == pytest.approx(sum(per) / 2)
    wide = max(per) - min(per) > abs(row["speedup_vs_ar"] - 1)
    assert row["speedup_vs_ar_noisy"] == wide and (row["speedup_vs_ar_noisy_reason"] is not None) == wide
    cell = f"{row['speedup_vs_ar']:.2f} ({min(per):.2f}-{max(per):.2f})" + (" noisy" if wide else "")
    assert cell in printed and "x <row>: median over repeats" in printed
    assert ("noisy: spd-colocate x ar: spread" in printed) == wide


def test_bench_max_batch_table_beside_the_rows(tmp_path, capsys):
    """--max-batch: the prompts run together up to B at once in the co-located pipeline; every
    request's tokens equal its own run one at a time, B=2 fills stage steps with more than one row,
    and the table prints per B; bad values are refused before any work."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--max-new-tokens", "10",
            "--repeats", "1", "--configs", "ar,spd-colocate", "--ignore-eos"]
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\nthe cat sat on\na b c d e f\n")
    assert main([*argv, "--prompts-file", str(prompts), "--max-batch", "1,2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["batches"]
    assert [r["config"] for r in rows] == ["one at a time", "B=1", "B=2"]
    assert all(r["equal"] == r["requests"] == 3 and r["pipeline"] == "spd-colocate" for r in rows)
    # one request's entries are one row, or a suffix run's several; two requests fill steps with more
    assert rows[2]["rows_per_step"] > rows[1]["rows_per_step"] >= 1
    assert 0 < rows[2]["utilization"]["overall"] <= 1 and len(rows[2]["utilization"]["per_stage"]) == 2
    printed = capsys.readouterr().out
    assert "several requests in the spd-colocate pipeline" in printed and "| B=2 |" in printed
    for bad in (["--max-batch", "0"], ["--max-batch", "x"], ["--max-batch", "2", "--configs", "ar,pp"]):
        assert main([*argv, "--prompt", "hi", *bad]) == 2
