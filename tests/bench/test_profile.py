"""Compute profiles from a bench report and from `spd profile` (CPU: graphs skipped), and the
profile's use by the cost model. The decode steps themselves are tested in tests/engine/test_graphs.py."""
from __future__ import annotations

import json

import pytest
import torch

from spd_engine.bench.profiling import (
    DeviceSettings,
    choose_spd_row,
    driver_tick_ms,
    fully_graphed,
    measure_shape,
    profile_from_bench,
    profile_json,
    residual_per_tick_ms,
)
from spd_engine.costmodel.cost_model import AlphaCurve, LinkModel, Links, Profile, plan
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime


@pytest.fixture(autouse=True)
def _threads(one_thread):
    # tiny shapes: extra intra-op threads only spin against other jobs on a shared host
    yield


# ---------------------------------------------------------------- profile from a bench report

def _bench_report(c0: list[float], c1: list[float], colocate_world: int = 2, verify_s: float = 0.004) -> dict:
    """A hand-made report: stage compute durations (s) per token step, driver events per tick."""
    stages = [[(0.0, float(i), float(i) + d) for i, d in enumerate(c)] for c in (c0, c1)]
    driver, t = [], 100.0
    for tick in range(1, 7):  # per tick: send 2 ms, wait 1 ms, pdm 3 ms, (verify 4 ms from tick 2), 0.5 ms untimed
        parts = (("send", 0.002), ("wait", 0.001), ("pdm", 0.003)) + ((("verify", verify_s),) if tick > 1 else ())
        for what, dur in parts:
            driver.append((tick, what, t, t + dur))
            t += dur
        t += 0.0005
    driver.insert(0, (0, "send", 99.0, 99.5))  # prefill: ignored
    trace = {"driver": driver, "stages": stages}
    base = {"alpha": 0.8, "threads_per_rank": 1, "tick_ms": 11.0}
    traces = {"spd": [trace, trace], "spd-colocate": [trace]}  # every request of the last repeat
    return {"synthetic_alpha": 0.8, "request_traces": traces, "rows": [
        {"name": "ar", "mode": "ar", "world_size": 1, "tick_ms": 30.0, "alpha": None, "threads_per_rank": 1},
        {"name": "spd", "mode": "spd", "world_size": 3, "colocate": False, **base},
        {"name": "spd-colocate", "mode": "spd", "world_size": colocate_world, "colocate": True, **base}]}


def _ecfg(n: int = 2) -> RunConfig:
    cfg = PRESETS["tiny-llama"]
    return RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n=n)), runtime=Runtime(capacity=128))


def test_driver_medians_from_trace():
    drv = driver_tick_ms(_bench_report([0.001], [0.001])["request_traces"]["spd"])
    assert drv["send"] == pytest.approx(2.0) and drv["pdm"] == pytest.approx(3.0) and drv["wait"] == pytest.approx(1.0)
    assert drv["verify"] == pytest.approx(4.0)  # only ticks that verify
    # spans of ticks 1..5 (tick 6 has no successor): 6.5 ms without verify, then 4 x 10.5 ms
    assert drv["other"] == pytest.approx(0.5) and drv["tick"] == pytest.approx((6.5 + 4 * 10.5) / 5)


def test_residual_per_tick_takes_out_stage0_compute_inside_each_tick_and_pdm_and_verify():
    # ticks start at 100, 110, 125, 131 s: stage 0 computes 2 s in tick 1, 1 + 3 s in tick 2, none
    # in tick 3; its step before the first tick (prefill time) and in the last tick are not counted
    driver = [(0, "send", 99.0, 99.5)]
    for tick, t, pdm, verify in ((1, 100.0, 1.0, 0.0), (2, 110.0, 2.0, 1.0), (3, 125.0, 1.0, 0.5), (4, 131.0, 1.0, 1.0)):
        driver.append((tick, "stage0", t, t + 0.1))
        driver.append((tick, "pdm", t + 0.2, t + 0.2 + pdm))
        if verify:
            driver.append((tick, "verify", t + 5.0, t + 5.0 + verify))
    stage0 = [(0.0, 99.1, 99.4), (0.0, 100.0, 102.0), (0.0, 110.0, 111.0), (0.0, 112.0, 115.0), (0.0, 131.0, 133.0)]
    got = residual_per_tick_ms({"driver": driver, "stages": [stage0, []]})
    assert got == pytest.approx([1e3 * (10 - 2 - 1), 1e3 * (15 - 4 - 2 - 1), 1e3 * (6 - 0 - 1 - 0.5)])


def test_profile_from_bench_report():
    report = _bench_report([0.002, 0.004, 0.003], [0.005, 0.005, 0.006])
    ecfg = _ecfg()
    assert choose_spd_row(report, 16)["name"] == "spd"  # 3 ranks fit 16 cores
    assert choose_spd_row(report, 2)["name"] == "spd-colocate"  # 3 ranks on 2 cores would time-share
    sep = profile_from_bench(report, ecfg, 16)
    assert sep["stage_ms"] == {"2": [pytest.approx(3.0), pytest.approx(16 / 3)]}  # means over steps
    assert sep["pdm_ms"] == {"2": pytest.approx(3.0)} and sep["verify_ms"] == pytest.approx(4.0)
    assert sep["driver_fixed_ms"] == pytest.approx(0.5)
    assert sep["layer_ms"] == pytest.approx((30.0 - 4.0) / ecfg.model.cfg.num_layers)
    assert sep["dtype_bytes"] == 4 and sep["hidden_size"] == ecfg.model.cfg.hidden_size
    assert sep["source"]["spd_row"] == "spd" and sep["source"]["alpha_measured"] == 0.8
    col = profile_from_bench(report, ecfg, 2)
    # co-located: the driver's send ran stage 0 inline; the part beyond stage 0's compute is driver work
    assert col["driver_fixed_ms"] == pytest.approx(0.5 + max(0.0, 2.0 - 3.0))
    prof = Profile.from_dict(json.loads(json.dumps(sep)))  # the cost model reads it back
    assert prof.stage_ms[2] == pytest.approx((3.0, 16 / 3)) and prof.driver_fixed_ms == pytest.approx(0.5)
    assert sum(prof.layer_ms) + prof.verify_ms == pytest.approx(30.0)  # the model's AR = measured AR
    assert "pp_stage_ms" not in sep and not prof.pp_stage_ms  # no traced pp row in this report
    pp_trace = {"driver": [], "stages": [[(0.0, 0.0, 0.004)], [(0.0, 1.0, 1.007), (0.0, 2.0, 2.009)]]}
    with_pp = profile_from_bench({**report, "request_traces": {**report["request_traces"], "pp": [pp_trace]}},
                                 ecfg, 16)
    assert with_pp["pp_stage_ms"] == {"2": [pytest.approx(4.0), pytest.approx(8.0)]}
    assert Profile.from_dict(with_pp).pp_stage_ms[2] == pytest.approx((4.0, 8.0))
    with pytest.raises(ValueError, match="no ar row"):
        profile_from_bench({**report, "rows": report["rows"][1:]}, ecfg, 16)
    with pytest.raises(ValueError, match="no traced spd run"):
        profile_from_bench({**report, "request_traces": {}}, ecfg, 16)


def test_profile_from_bench_with_verification_on_the_last_stage():
    """--verify-at last: the driver's "verify" is a 0.01 ms compare; the head's time is the last
    stage's (stage1_verify_ms of the row's breakdown, inside its compute). The profile keeps
    verify_ms = the head and takes it out of stage 1's compute, so the model, which adds it back
    on the last stage, predicts the measured stage."""
    report = _bench_report([0.002, 0.004, 0.003], [0.005, 0.005, 0.006], verify_s=0.00001)
    for row in report["rows"][1:]:
        row["breakdown_ms_per_tick"] = {"stage1_compute_ms": 16 / 3, "stage1_verify_ms": 1.5}
    ecfg = _ecfg()
    prof = profile_from_bench(report, ecfg, 16)
    assert prof["source"]["verify_at"] == "last" and prof["measured"]["last_stage_verify_ms"] == 1.5
    assert prof["verify_ms"] == pytest.approx(1.5)
    assert prof["stage_ms"] == {"2": [pytest.approx(3.0), pytest.approx(16 / 3 - 1.5)]}
    assert prof["driver_fixed_ms"] == pytest.approx(0.5 + 0.01)  # the compare is host work
    assert prof["layer_ms"] == pytest.approx((30.0 - 1.5) / ecfg.model.cfg.num_layers)
    model = Profile.from_dict(json.loads(json.dumps(prof)))
    assert sum(model.layer_ms) + model.verify_ms == pytest.approx(30.0)  # the model's AR = measured AR
    link = LinkModel.assume("fast", 1.0, 100.0, None)
    rows = plan(model, Links(link), AlphaCurve({0: 1.0}), [2], sim_tokens=200, verify_at="last")["rows"]
    sep = next(r for r in rows if r["method"] == "spd" and r["layout"] == "sep")
    assert sep["slowest_stage_ms"] == pytest.approx(16 / 3)  # the measured last stage, head included
    # verifying on the driver (no stage1_verify_ms, or a last stage that replied -1 at T > 0 and
    # reports microseconds): the driver's verification is the head, stage 1 keeps its compute
    for breakdown in ({}, {"stage1_verify_ms": 0.002}):
        plain = _bench_report([0.002, 0.004, 0.003], [0.005, 0.005, 0.006])
        for row in plain["rows"][1:]:
            row["breakdown_ms_per_tick"] = breakdown
        drv = profile_from_bench(plain, ecfg, 16)
        assert drv["source"]["verify_at"] == "driver" and drv["verify_ms"] == pytest.approx(4.0)
        assert drv["stage_ms"]["2"][1] == pytest.approx(16 / 3) and drv["driver_fixed_ms"] == pytest.approx(0.5)


def test_driver_fixed_time_lengthens_the_driver_cycle():
    base = {"schema": "spd-profile/1", "num_layers": 4, "layer_ms": 1.0, "pdm_ms": 0.5, "verify_ms": 0.2,
            "hidden_size": 64, "stage_ms": {"2": [0.5, 0.5]}}
    link = LinkModel.assume("fast", 1.0, 100.0, None)

    def sep(fixed: float) -> dict:
        result = plan(Profile.from_dict({**base, "driver_fixed_ms": fixed}), Links(link), AlphaCurve({0: 1.0}), [2],
                      sim_tokens=500)
        return next(r for r in result["rows"] if r["method"] == "spd" and r["layout"] == "sep")

    assert sep(0.0)["driver_ms"] == pytest.approx(0.7) and sep(0.3)["driver_ms"] == pytest.approx(1.0)
    assert sep(0.3)["critical"].startswith("driver") and sep(0.3)["tick_ms"] > sep(0.0)["tick_ms"]
    with pytest.raises(ValueError, match="driver_fixed_ms"):
        Profile.from_dict({**base, "driver_fixed_ms": -1})


def test_host_syncs_are_charged_per_frame_header():
    """A full tick reads n frame headers on the driver, each a host sync beyond the measured steps."""
    base = {"schema": "spd-profile/1", "num_layers": 4, "layer_ms": 1.0, "pdm_ms": 0.5, "verify_ms": 0.2,
            "hidden_size": 64}
    notes: list[str] = []
    plain, synced = Profile.from_dict(base), Profile.from_dict({**base, "sync_ms": 0.05})
    for n in (2, 4):
        assert synced.driver_work_for(n, notes) == pytest.approx(plain.driver_work_for(n, notes) + n * 0.05)
    with pytest.raises(ValueError, match="sync_ms"):
        Profile.from_dict({**base, "sync_ms": -1})


def test_host_sync_is_measured():
    from spd_engine.bench.sync_time import host_sync_ms, main

    assert 0 < host_sync_ms(torch.device("cpu"), iters=20, warmup=2) < 50
    assert main(["--device", "cpu"]) == 0


def test_eval_json_alpha_by_n_feeds_the_plan():
    from spd_engine.train.evaluate import EvalReport, PromptRecord
    from spd_engine.train.fast_eval import Acceptance

    report = EvalReport(n=4)
    for acc, ver in ((3, 4), (5, 6)):
        a = Acceptance(n=4, tokens=ver + 1, ticks=ver + 6, verified=ver, accepted=acc)
        report.records.append(PromptRecord(dataset="gsm8k", index=0, question_id=0, prompt_tokens=5, acceptance=a,
                                           seconds=0.1, lossless=None, near_ties=None))
    d = json.loads(json.dumps(report.to_json({"n": 4})))
    assert d["alpha_by_n"] == {"4": pytest.approx(8 / 10)}
    assert AlphaCurve.from_eval_json(d)(4, []) == pytest.approx(0.8)


def test_bench_profile_out_needs_an_spd_run():
    import argparse

    from spd_engine.tools.bench import cases

    ecfg = _ecfg()
    args = argparse.Namespace(configs="ar,pp", timeline=None, chrome_trace=None, profile_out="x.json", assistant=None)
    with pytest.raises(ValueError, match="--profile-out needs an spd"):
        cases(args, ecfg)
    traced = cases(argparse.Namespace(configs="ar,pp,spd,spd-colocate", timeline=None, chrome_trace=None,
                                      profile_out="x.json", assistant=None), ecfg)
    assert [c.ecfg.runtime.trace for c in traced] == [False, True, True, True]  # pp too: its stage times
    plain = cases(argparse.Namespace(configs="ar,pp,spd,spd-colocate", timeline=None, chrome_trace=None,
                                     profile_out=None, assistant=None), ecfg)
    assert [c.ecfg.runtime.trace for c in plain] == [False, False, False, True]  # spd-colocate: its residual per tick


# ---------------------------------------------------------------- spd profile on CPU

def test_measure_shape_on_cpu():
    s = DeviceSettings(device="cpu", dtype="float32", ns=(2, 4, 8), context=32, iters=2, warmup=0)
    cfg = PRESETS["tiny-llama"]
    raw = measure_shape(cfg, s)
    assert set(raw["stage_ms"]) == {2, 4}  # 8 stages > 6 layers: skipped
    assert [len(raw["stage_ms"][n]["eager"]) for n in (2, 4)] == [2, 4]
    assert raw["ar_ms"]["eager"] > 0 and raw["ar_ms"]["graphed"] is None
    assert all("skipped on cpu" in m for m in raw["modes"])
    assert not fully_graphed(raw)
    prof = profile_json("tiny-llama", cfg, raw, s, False, "cpu")
    p = Profile.from_dict(prof)
    assert p.num_layers == cfg.num_layers and p.stage_ms[4] == tuple(raw["stage_ms"][4]["eager"])
    assert p.layer_ms[0] == pytest.approx((raw["ar_ms"]["eager"] - raw["verify_ms"]["eager"]) / cfg.num_layers)
    assert set(raw["tp_layer_ms"]) == {2}  # 2 KV heads: TP shards of 1/2 only
    assert p.tp_layer_ms == {2: raw["tp_layer_ms"][2]["eager"]} and p.tp_layer_ms[2] > 0
    with pytest.raises(ValueError, match="not every step"):
        profile_json("tiny-llama", cfg, raw, s, True, "cpu")


def test_spd_profile_cli_on_cpu(tmp_path, capsys):
    from spd_engine.tools.cli import main

    net = tmp_path / "net.json"
    p2p = [{"src": 0, "dst": 1, "bytes": b, "mean_us": 50.0, "p50_us": 50.0, "post_us": 5.0} for b in (32, 4096)]
    net.write_text(json.dumps({"schema": "spd-netbench/1", "p2p": p2p,
                               "allreduce": [{"ranks": r, "bytes": 8, "mean_us": 60.0} for r in (2, 4)]}))
    out = tmp_path / "prof"
    assert main(["profile", "--device", "cpu", "--quick", "--shapes", "tiny-llama", "--n", "2,4", "--iters", "2",
                 "--out-dir", str(out), "--net", str(net)]) == 0
    printed = capsys.readouterr().out
    assert "CUDA graphs: skipped (not on cpu)" in printed
    assert "ASSUMED link" in printed and "ASSUMED alpha 0.8" in printed and f"measured links {net}" in printed
    prof = json.loads((out / "tiny-llama-eager.json").read_text())
    assert prof["schema"] == "spd-profile/1" and set(prof["stage_ms"]) == {"2", "4"}
    assert not (out / "tiny-llama-graphs.json").exists()
    run = json.loads((out / "profile-run.json").read_text())
    assert set(run["shapes"]["tiny-llama"]["plans"]) == {f"measured links {net}",
                                                        "ASSUMED link (3 us, 400 GB/s, all-reduce 8 us)"}
    assert min(prof["stage_ms"]["4"]) > 0 and prof["verify_ms"] > 0 and prof["sync_ms"] > 0
    assert main(["profile", "--device", "cpu", "--shapes", "nope"]) == 2
    assert main(["profile", "--device", "cpu", "--quick", "--assume-link", ""]) == 2  # no links for the plans


@pytest.mark.multiproc
def test_spd_bench_profile_out(tmp_path, capsys):
    """`spd bench --profile-out` on real runs (tiny random model): a profile the plan accepts."""
    from spd_engine.tools.cli import main

    out = tmp_path / "profile.json"
    assert main(["bench", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--prompt", "hello",
                 "--max-new-tokens", "10", "--repeats", "1", "--configs", "ar,spd-colocate",
                 "--synthetic-alpha", "0.5", "--profile-out", str(out)]) == 0
    assert "profile (spd-colocate run)" in capsys.readouterr().out
    prof = json.loads(out.read_text())
    p = Profile.from_dict(prof)
    assert len(p.stage_ms[2]) == 2 and min(p.stage_ms[2]) > 0 and p.verify_ms > 0 and p.pdm_for(2, []) > 0
    assert prof["source"]["synthetic_alpha"] == 0.5 and prof["source"]["ranks"] == 2
    assert sum(p.layer_ms) + p.verify_ms == pytest.approx(prof["measured"]["ar_token_ms"])
