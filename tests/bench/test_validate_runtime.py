"""Cost model vs the real runtime: predictions from a hand profile, the comparison table, and one
real profile run + netbench run + measurement run on a tiny random model checking the table's
structure and invariants (not the 15% accuracy, which depends on the host's load)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from spd_engine.bench.validate_runtime import (
    CONFIGS,
    ValidationSettings,
    bench_cases,
    compare,
    format_validation,
    measured_of,
    predict,
    repredict,
    tp_diagnostic,
    validate,
)
from spd_engine.costmodel.cost_inputs import HEADER_BYTES, TABLE_ROW_BYTES, LinkModel, Profile
from spd_engine.costmodel.cost_model_spd import eal_for_request, verifies_on_last
from spd_engine.engine.protocol.messages import HEADER_LEN
from spd_engine.engine.protocol.schedule import expected_eal
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime

HAND = {"schema": "spd-profile/1", "name": "hand", "num_layers": 4, "layer_ms": 1.0, "pdm_ms": {"2": 0.5},
        "verify_ms": 0.2, "driver_fixed_ms": 0.1, "hidden_size": 64, "dtype_bytes": 4,
        "stage_ms": {"2": [2.0, 2.0]}}


def test_predict_from_a_hand_profile():
    link = LinkModel.assume("hand", 100.0, 1.0, None)  # 0.1 ms + bytes / 1 GB/s per hop
    pred = predict(HAND, link, alpha=0.5, n=2)
    assert set(pred) == set(CONFIGS)
    assert pred["ar"]["tick_ms"] == pytest.approx(4.2)  # 4 layers + verify
    hops = link.hop_ms(HEADER_BYTES + 64 * 4) + link.hop_ms(HEADER_BYTES)  # activation to stage 1, token back to stage 0
    assert pred["pp"]["tick_ms"] == pytest.approx(4.2 + hops)
    for name in ("spd-colocate", "spd"):
        p = pred[name]
        assert p["eal"] == pytest.approx(expected_eal(2, 0.5))
        assert p["tok_s"] == pytest.approx(1e3 * p["eal"] / (2 * p["tick_ms"]))
    # co-located (--verify-at auto: the head on the last stage) rank 0: stage 0 (2) + PDM 0.5 + driver
    # host work 0.1 on every tick; the head (verify 0.2) is stage 1's (2.2 per tick)
    col = pred["spd-colocate"]
    assert col["tick_ms"] == pytest.approx(2.6) and col["critical"].startswith("rank 0")
    assert pred["spd"]["tick_ms"] < pred["spd-colocate"]["tick_ms"]  # a separate driver takes that work off
    # verifying on the driver, rank 0 adds verify 0.2 on the ticks that verify (refill ticks after a
    # rejection do not)
    driver = predict(HAND, link, alpha=0.5, n=2, verify_at="driver")
    assert 2.6 < driver["spd-colocate"]["tick_ms"] < 2.8 and driver["spd-colocate"]["critical"].startswith("rank 0")
    short = predict(HAND, link, alpha=0.5, n=2, tokens=32)  # the bench's request length: the fill counts
    for name in ("spd-colocate", "spd"):
        assert short[name]["eal"] == pytest.approx(eal_for_request(2, 0.5, 32))
        assert short[name]["eal"] < pred[name]["eal"]
        assert short[name]["tok_s"] == pytest.approx(1e3 * short[name]["eal"] / (2 * short[name]["tick_ms"]))


def _measured(tok_s: dict[str, float], tick: dict[str, float]) -> dict[str, dict]:
    ranks = {"ar": 1, "pp": 2, "spd-colocate": 2, "spd": 3}
    return {c: {"world_size": ranks[c], "tok_s": tok_s[c], "tick_ms": tick[c], "alpha": None, "eal": None}
            for c in CONFIGS}


def test_predict_the_tp_row_from_measured_shards():
    """tp: the measured 1/T shard per layer, (2 L + 1) all-reduces of [H], the head / T, the argmax
    gather and the token's hop to the other TP ranks."""
    link = LinkModel.assume("hand", 100.0, 1.0, 20.0)  # all-reduces 0.02 ms
    prof = {**HAND, "tp_layer_ms": {"2": 0.6}}
    pred = predict(prof, link, alpha=0.5, n=2, tp=2)
    want = 4 * 0.6 + (2 * 4 + 1) * 0.02 + 0.02 + 0.2 / 2 + link.hop_ms(HEADER_BYTES)
    assert pred["tp"]["tick_ms"] == pytest.approx(want, rel=1e-3)
    assert pred["tp"]["tok_s"] == pytest.approx(1e3 / pred["tp"]["tick_ms"])
    assert "tp" not in predict(prof, link, alpha=0.5, n=2)
    # an all-reduce measured in lockstep with the shards replaces the link's for the 2 L + 1 reductions
    lock = predict({**prof, "tp_allreduce_ms": {"2": 0.5}}, link, alpha=0.5, n=2, tp=2)
    assert lock["tp"]["tick_ms"] == pytest.approx(want + (2 * 4 + 1) * (0.5 - 0.02), rel=1e-3)
    assert lock["tp"]["comm_ms"] == pytest.approx(pred["tp"]["comm_ms"] + (2 * 4 + 1) * (0.5 - 0.02), rel=1e-3)


def test_tp_diagnostic_splits_the_measured_token():
    """The tp row's collectives per token and the time inside them come from TP rank 0's
    breakdown; medians over rounds, beside the model's all-reduce term."""
    def rnd(inside: float, compute: float, comm: float) -> dict:
        row = {"name": "tp", "decode_tok_s": 10.0, "tick_ms": 100.0, "world_size": 2, "alpha": 0.0, "eal": 0.0,
               "breakdown_ms_per_tick": {"stage0_tp_collectives": 62.0, "stage0_tp_collective_ms": inside,
                                         "stage0_compute_ms": compute}}
        return {"measured": measured_of({"rows": [row]}), "predicted": {"tp": {"comm_ms": comm}}}
    got = tp_diagnostic([rnd(31.0, 90.0, 20.0), rnd(62.0, 95.0, 25.0), rnd(40.0, 80.0, 30.0)])
    assert got == {"collectives_per_token": 62.0, "measured_collective_ms": 40.0, "measured_ms_per_collective": 40.0 / 62,
                   "measured_compute_outside_ms": 40.0, "predicted_comm_ms": 25.0}
    no_tp = {"measured": measured_of({"rows": [{"name": "ar", "decode_tok_s": 1.0, "tick_ms": 1.0, "world_size": 1,
                                                 "alpha": 0.0, "eal": 0.0}]}), "predicted": {}}
    assert tp_diagnostic([no_tp]) is None


def test_compare_errors_and_verdicts():
    pred = {c: {"tok_s": 100.0, "tick_ms": 10.0, "critical": "-"} for c in CONFIGS}
    meas = _measured({"ar": 100.0, "pp": 90.0, "spd-colocate": 110.0, "spd": 50.0},
                     {"ar": 10.0, "pp": 11.0, "spd-colocate": 9.0, "spd": 10.0})
    rows = {r["config"]: r for r in compare([pred], [meas], 0.15, cores=2)}
    assert rows["ar"]["tok_s_err"] == pytest.approx(0.0) and rows["ar"]["ok"] == "yes"
    assert rows["pp"]["tok_s_err"] == pytest.approx(100 * (100 / 90 - 1)) and rows["pp"]["ok"] == "yes"
    assert rows["spd-colocate"]["tick_err"] == pytest.approx(100 * (10 / 9 - 1)) and rows["spd-colocate"]["ok"] == "yes"
    assert rows["spd"]["tok_s_err"] == pytest.approx(100.0) and rows["spd"]["ok"] == "NO"  # tok/s off, tick fine
    assert [r["oversubscribed"] for r in rows.values()] == [False, False, False, True]  # 3 ranks on 2 cores
    assert not any(r["oversubscribed"] for r in compare([pred], [meas], 0.15, cores=16))


def test_compare_takes_medians_over_rounds():
    slow = {c: {"tok_s": 10.0, "tick_ms": 100.0, "critical": "x"} for c in CONFIGS}
    fast = {c: {"tok_s": 20.0, "tick_ms": 50.0, "critical": "x"} for c in CONFIGS}
    same = {c: {"tok_s": 12.0, "tick_ms": 80.0, "critical": "x"} for c in CONFIGS}
    m = lambda tok, tick: _measured(dict.fromkeys(CONFIGS, tok), dict.fromkeys(CONFIGS, tick))  # noqa: E731
    rows = compare([slow, fast, same], [m(10.0, 100.0), m(30.0, 40.0), m(12.0, 90.0)], 0.15, None,
                   same_run=[fast, fast, slow])
    for r in rows:  # medians: predicted 12 tok/s, 80 ms; measured 12 tok/s, 90 ms; same-run 50 ms
        assert r["predicted_tok_s"] == 12.0 and r["measured_tok_s"] == 12.0 and r["measured_tick_ms"] == 90.0
        assert r["spread"] == "10.00-30.00" and r["ok"] == "yes"
        assert r["same_run_tick_ms"] == 50.0 and r["same_run_err"] == pytest.approx(100 * (50 / 90 - 1))


def _tiny_validation(configs: tuple[str, ...], link: str = "p2p") -> dict:
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n=2), threads=1),
                     runtime=Runtime(capacity=128, timeout_s=60.0))
    settings = ValidationSettings(max_new_tokens=12, rounds=1, synthetic_alpha=0.75, net_iters=20, configs=configs,
                                  link=link)
    return validate(ecfg, [[5, 9, 14, 3, 22]], settings)


# CI: ar + co-located SPD (4 launches), priced by raw P2P on gloo and by the rings on shm; the slow
# run covers all four configs.
@pytest.fixture(scope="module", params=[pytest.param((("ar", "spd-colocate"), "p2p"), marks=pytest.mark.multiproc),
                                        pytest.param((("ar", "spd-colocate"), "shm"), marks=pytest.mark.multiproc),
                                        pytest.param((CONFIGS, "p2p"), marks=[pytest.mark.multiproc, pytest.mark.slow])],
                ids=["ar+coloc", "ar+coloc-shm", "all"])
def tiny_validation(request):
    return _tiny_validation(*request.param)


def test_validation_configs_are_checked():
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n=2)), runtime=Runtime(capacity=128))
    with pytest.raises(ValueError, match="include an SPD run"):
        validate(ecfg, [[5]], ValidationSettings(configs=("ar", "pp")))
    with pytest.raises(ValueError, match="p2p, gloo or shm"):
        ValidationSettings(link="nccl")
    # the runs use the transport whose hops price them
    for link, transport in (("p2p", "gloo"), ("gloo", "gloo"), ("shm", "shm")):
        s = ValidationSettings(link=link)
        assert s.transport == transport
        assert {c.ecfg.parallel.transport for c in bench_cases(ecfg, CONFIGS, 1, s.transport)} == {transport}


def test_spd_runs_verify_where_the_model_prices_them(monkeypatch, capsys):
    """ValidationSettings.verify_at is the SPD runs' RunConfig.parallel.verify_at and the model's verify_on_last;
    `spd plan --validate-runtime --verify-at` sets it."""
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n=2)), runtime=Runtime(capacity=128))
    for verify_at, sep, coloc in (("last", True, True), ("driver", False, False), ("auto", False, True)):
        s = ValidationSettings(verify_at=verify_at)
        cases = {c.name: c.ecfg for c in bench_cases(ecfg, CONFIGS, 1, s.transport, s.verify_at)}
        assert (cases["spd"].verifies_on_last, cases["spd-colocate"].verifies_on_last) == (sep, coloc)
        assert not cases["pp"].verifies_on_last and not cases["ar"].verifies_on_last  # their head is on the last stage
        # the model prices each layout as the runtime runs it
        assert (verifies_on_last(verify_at, False), verifies_on_last(verify_at, True)) == (sep, coloc)
    assert ValidationSettings().verify_at == ParallelLayout.verify_at == "auto"  # the runtime's default
    with pytest.raises(ValueError, match="verify_at"):
        ValidationSettings(verify_at="stage0")
    import spd_engine.bench.validate_runtime as vr
    from spd_engine.tools.cli import main

    seen = []
    monkeypatch.setattr(vr, "validate", lambda ecfg, prompts, settings, progress: seen.append(settings) or {"rows": []})
    monkeypatch.setattr(vr, "format_validation", lambda result: "table")
    for argv, want in (([], "auto"), (["--verify-at", "driver"], "driver"), (["--verify-at", "last"], "last")):
        assert main(["plan", "--validate-runtime", "--model", "random:tiny-llama", "--prompt", "hi", *argv]) == 0
        assert seen[-1].verify_at == want


def test_repredict_prices_older_files_as_verifying_on_the_driver():
    """A saved validation without settings.verify_at was measured before the last stage could
    verify: it is predicted again with the driver verifying; a newer one as it says."""
    report = {"schema": "spd-netbench/1", "p2p": [{"src": 0, "dst": 1, "bytes": b, "mean_us": 100.0, "post_us": 0.0}
                                                   for b in (64, 4096)],
              "allreduce": [{"ranks": 2, "bytes": 8, "mean_us": 40.0}]}
    prof = {**HAND, "source": {"alpha_measured": 0.5}}
    meas = _measured(dict.fromkeys(CONFIGS, 100.0), dict.fromkeys(CONFIGS, 2.5))
    rnd = {"profile": prof, "measurement_profile": prof, "netbench": report, "alpha": 0.5, "measured": meas}
    settings = {k: v for k, v in dataclasses.asdict(ValidationSettings(max_new_tokens=32)).items() if k != "verify_at"}
    link = LinkModel.from_netbench(report, "netbench (this host)")
    for extra, verify_at, where in (({}, "driver", "driver"), ({"verify_at": "auto"}, "auto", "last stage co-located")):
        saved = {"rounds": [rnd], "settings": {**settings, **extra}, "n": 2, "cores": 16}
        again = repredict(saved)
        want = predict(prof, link, 0.5, 2, 32, verify_at=verify_at)["spd-colocate"]["tick_ms"]
        assert again["rounds"][0]["predicted"]["spd-colocate"]["tick_ms"] == pytest.approx(want)
        assert again["settings"]["verify_at"] == verify_at
        assert "SPD verifies on the " + where in format_validation(
            {**again, "model": "m", "head": "h", "threads_per_rank": 1, "host": {}})
    # verifying on the driver, co-located rank 0 pays the head: a longer tick than with auto's last stage
    assert predict(prof, link, 0.5, 2, 32, verify_at="driver")["spd-colocate"]["tick_ms"] > \
        predict(prof, link, 0.5, 2, 32, verify_at="auto")["spd-colocate"]["tick_ms"]


def test_real_runs_give_a_consistent_table(tiny_validation):
    res = tiny_validation
    rows = res["rows"]
    ranks = {"ar": 1, "pp": 2, "spd-colocate": 2, "spd": 3}
    assert [r["config"] for r in rows] == [c for c in CONFIGS if c in res["settings"]["configs"]]
    assert [r["ranks"] for r in rows] == [ranks[r["config"]] for r in rows]
    for r in rows:
        assert r["measured_tok_s"] > 0 and r["predicted_tok_s"] > 0 and r["measured_tick_ms"] > 0
        assert r["tok_s_err"] == pytest.approx(100 * (r["predicted_tok_s"] / r["measured_tok_s"] - 1))
        assert r["tick_err"] == pytest.approx(100 * (r["predicted_tick_ms"] / r["measured_tick_ms"] - 1))
        assert r["ok"] == ("yes" if max(abs(r["tok_s_err"]), abs(r["tick_err"])) <= 15 else "NO")
    # every run decodes exactly max_new_tokens per prompt, and SPD stays lossless
    rnd = res["rounds"][0]
    for run in (rnd["profile_run"], rnd["measurement_run"]):
        assert run["mismatches"] == [] and all(r["tokens"] == 12 for r in run["rows"])
    # the acceptance sequence is seeded: both runs see the same alpha, and the model uses it
    spd_rows = [r for r in rows if r["config"].startswith("spd")]
    assert {r["alpha"] for r in spd_rows} == set(res["alpha_used"]) == {rnd["profile"]["source"]["alpha_measured"]}
    assert all(r["critical"] != "-" for r in spd_rows)
    # ar is predicted from the profile run's own AR time; fed the measured run's own profile, the
    # model reproduces that run's AR time exactly
    assert rows[0]["predicted_tick_ms"] == pytest.approx(rnd["profile_run"]["rows"][0]["tick_ms"])
    assert rows[0]["same_run_err"] == pytest.approx(0.0, abs=1e-9)


def test_real_run_inputs_are_usable(tiny_validation):
    res = tiny_validation
    prof = Profile.from_dict(json.loads(json.dumps(res["profile"])))
    assert prof.stage_ms[2] and len(prof.stage_ms[2]) == 2 and prof.verify_ms > 0
    assert res["profile"]["source"]["spd_row"] in ("spd", "spd-colocate")
    # --verify-at auto (the default): the co-located run verified on the last stage, the separate
    # driver's run on the driver, and the profile took the head from where it ran
    assert res["settings"]["verify_at"] == "auto"
    on_last = res["profile"]["source"]["spd_row"] == "spd-colocate"
    assert res["profile"]["source"]["verify_at"] == ("last" if on_last else "driver")
    if on_last:
        assert res["profile"]["verify_ms"] == res["profile"]["measured"]["last_stage_verify_ms"] > 0
    if "pp" in res["settings"]["configs"]:  # pp is traced: its own stage times predict it
        assert len(prof.pp_stage_ms[2]) == 2 and min(prof.pp_stage_ms[2]) > 0
    net = res["rounds"][0]["netbench"]
    assert net["schema"] == "spd-netbench/1" and {(r["src"], r["dst"]) for r in net["p2p"]} >= {(0, 1), (0, 2), (1, 2)}
    # a header alone, and SPD's activation message: a header, its table row and one activation row (float32)
    assert {r["bytes"] for r in net["p2p"]} >= {HEADER_LEN * 8,
                                                 PRESETS["tiny-llama"].hidden_size * 4 + HEADER_BYTES + TABLE_ROW_BYTES}
    text = format_validation(res)
    assert "SYNTHETIC acceptance alpha=0.75" in text and "host load: before:" in text
    assert all(r["config"] in text for r in res["rows"]) and "configs within 15%" in text
    if res["settings"]["link"] == "shm":  # the rings' own rows, at the runtime's sizes, price the runs
        sizes = {r["bytes"] for r in net["transport"] if r["transport"] == "shm" and r["busy_mb"] == 0}
        assert sizes == {r["bytes"] for r in net["p2p"]}
        assert "hops: the shared-memory rings, runs on shm" in text


def test_revalidate_repredicts_a_saved_run(tiny_validation, tmp_path, capsys):
    from spd_engine.tools.cli import main

    saved = json.loads(json.dumps(tiny_validation))
    rnd = saved["rounds"][0]
    want = {c: dict(p) for c, p in rnd["predicted"].items()}
    for c in rnd["predicted"]:  # what an older model predicted: repredict must replace it
        rnd["predicted"][c] = {**rnd["predicted"][c], "tick_ms": 1.0, "tok_s": 1.0}
    path, out = tmp_path / "saved.json", tmp_path / "again.json"
    path.write_text(json.dumps(saved))
    rc = main(["plan", "--revalidate", str(path), "--json", str(out)])
    again = json.loads(out.read_text())
    assert rc == (1 if any(r["ok"] != "yes" for r in again["rows"]) else 0)
    assert again["repredicted"] and again["rounds"][0]["measured"] == rnd["measured"]
    for c, p in want.items():
        assert again["rounds"][0]["predicted"][c]["tick_ms"] == pytest.approx(p["tick_ms"])
    assert [r["predicted_tick_ms"] for r in again["rows"]] == pytest.approx(
        [r["predicted_tick_ms"] for r in tiny_validation["rows"]])
    assert "configs within 15%" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["plan", "--revalidate", str(tmp_path / "bad.json")]) == 2
    assert "not a --validate-runtime JSON" in capsys.readouterr().err
    del saved["settings"]["configs"]  # a truncated or hand-edited file
    path.write_text(json.dumps(saved))
    assert main(["plan", "--revalidate", str(path)]) == 2
    assert "incomplete --validate-runtime JSON" in capsys.readouterr().err


def test_cli_argument_errors(capsys):
    from spd_engine.tools.cli import main

    assert main(["plan", "--validate", "--validate-runtime"]) == 2
    assert "one of --validate" in capsys.readouterr().err
    assert main(["plan", "--validate-runtime", "--synthetic-alpha", "1.5"]) == 2
    assert "--synthetic-alpha" in capsys.readouterr().err
    assert main(["plan", "--validate-runtime", "--stages", "1"]) == 2


def test_runtime_config_of_the_cli():
    import argparse

    from spd_engine.tools.plan import _runtime_config

    args = argparse.Namespace(model="random:tiny-llama", stages=3, spec=None, threads=1, seed=5, timeout=30.0)
    ecfg, tok_dir = _runtime_config(args)
    cfg = PRESETS["tiny-llama"]
    assert tok_dir is None and ecfg.model.source == "random:tiny-llama" and ecfg.model.cfg == cfg
    assert ecfg.parallel.topology == Topology.build(cfg.num_layers, n=3) and ecfg.mode == "spd"
    assert ecfg.drafting.pdm == "random"  # no shipped head for a random model: an untrained one
    assert (ecfg.parallel.threads, ecfg.runtime.seed, ecfg.runtime.timeout_s) == (1, 5, 60.0)  # receives wait at least a minute
    assert ecfg.runtime.capacity == min(2048, cfg.max_position) == 512  # the preset's positions bound the KV cache
