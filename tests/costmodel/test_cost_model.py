"""Cost model: hand-computed critical paths, the refill rule, partitions, input parsing, and
`spd plan` on a case whose every number is worked out below."""
from __future__ import annotations

import json

import pytest

from spd_engine.costmodel.cost_inputs import HEADER_BYTES, MESSAGE_PARTS, TABLE_ROW_BYTES, AlphaCurve, LinkModel, Profile
from spd_engine.costmodel.cost_model_spd import SpdCase, eal_for_request, predict_spd, simulate_spd, spd_cycles
from spd_engine.costmodel.cost_partitions import balanced_partition, rebalanced_split
from spd_engine.engine.protocol.schedule import decode_ticks, expected_eal

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def sep_case(**kw) -> SpdCase:
    """A separate-driver case that verifies on the driver (--verify-at driver), unless kw says otherwise."""
    base = dict(stage_ms=(3.0, 2.0), pdm_ms=0.5, verify_ms=0.2, alpha=1.0, colocate=False, hop_token_ms=0.1,
                hop_act_ms=(0.2,), hop_anchor_ms=(0.3,), hop_exit_ms=0.4, verify_on_last=False)
    base.update(kw)
    return SpdCase(**base)


def test_stage_bound_tick():
    case = sep_case()
    cycles = spd_cycles(case)
    assert cycles["stage 0 compute"] == pytest.approx(3.0)
    assert cycles["stage 1 compute"] == pytest.approx(2.0)
    assert cycles["driver: PDM + verify"] == pytest.approx(0.5 + 0.2)
    # token 0.1 + stages 3 + 2 + activation 0.2 + exit 0.4 + verify 0.2, over n = 2 ticks
    assert cycles["verify loop (token through all stages, verify, next token)"] == pytest.approx(5.9 / 2)
    # token 0.1 + stage 0 3.0 + anchors 0.3 + PDM 0.5 + verify 0.2, over p + 2 = 2 ticks
    assert cycles["anchor loop via stage 0"] == pytest.approx(4.1 / 2)
    sim = simulate_spd(case, decode_tokens=2000)
    assert sim["ticks"] == 2000 + 1  # (N-1) + (n-1) with no rejection
    assert sim["tick_ms"] == pytest.approx(3.0, rel=2e-3)  # the slowest stage, plus a one-off fill
    # posting costs 0.05 ms per message: stage 0 posts its output and its anchors every tick
    posted = sep_case(post_ms=0.05)
    assert spd_cycles(posted)["stage 0 compute"] == pytest.approx(3.1)
    assert simulate_spd(posted, 2000)["tick_ms"] == pytest.approx(3.1, rel=2e-3)


def test_verify_loop_bound_tick():
    # balanced 2 ms stages, slow links and a 1 ms verify: verification in series with stage 0's input
    case = sep_case(stage_ms=(2.0, 2.0), verify_ms=1.0, hop_token_ms=0.5, hop_act_ms=(0.5,), hop_anchor_ms=(0.5,),
                    hop_exit_ms=0.5)
    cycles = spd_cycles(case)
    critical = max(cycles, key=cycles.get)
    assert critical.startswith("verify loop")
    assert cycles[critical] == pytest.approx((0.5 + 4.0 + 0.5 + 0.5 + 1.0) / 2)  # 3.25 > 2 ms stages
    assert simulate_spd(case, 2000)["tick_ms"] == pytest.approx(3.25, rel=2e-3)


def test_colocated_driver_adds_its_work_to_stage_0():
    case = SpdCase(stage_ms=(1.0, 3.0), pdm_ms=1.0, verify_ms=0.5, alpha=1.0, colocate=True, hop_token_ms=0.0,
                   hop_act_ms=(0.2,), hop_anchor_ms=(0.3,), hop_exit_ms=0.3, post_ms=0.05, recv_ms=0.05,
                   verify_on_last=False)
    cycles = spd_cycles(case)
    assert cycles["rank 0: stage 0 + driver (PDM + verify)"] == pytest.approx(1.0 + 0.05 + 0.05 + 1.0 + 0.5)
    # stage 1 reads its input, computes, posts one message (the last stage sends only to the driver)
    assert cycles["stage 1 compute"] == pytest.approx(0.05 + 3.0 + 0.05)
    assert simulate_spd(case, 2000)["tick_ms"] == pytest.approx(3.1, rel=2e-3)


def test_rejections_refill_the_pipeline_by_hand():
    # alpha = 0: every verification rejects. n = 2, 1 ms stages, zero hops, PDM 0.25, verify 0.25.
    # tick 1: x_P at stage 0 [0,1], stage 1 [1,2]; driver: PDM -> 0.25, nothing to verify, sends d.
    # tick 2: stage 0 [1,2], stage 1 [2,3]; driver waits stage 0's anchors (1), PDM -> 1.25,
    #         verifies x_P's exit (arrived 2) -> 2.25: reject, the correction enters next.
    # tick 3: stage 0 [2.25,3.25]; refill: no anchors needed, no verify: PDM -> 2.5, sends d'.
    # tick 4: stage 0 [3.25,4.25], stage 1 [4.25,5.25]; driver waits the correction's anchors (3.25),
    #         PDM -> 3.5, verifies the correction's exit (4.25) -> 4.5: reject, ends the run (N-1 = 2).
    case = sep_case(stage_ms=(1.0, 1.0), pdm_ms=0.25, verify_ms=0.25, alpha=0.0, hop_token_ms=0.0,
                    hop_act_ms=(0.0,), hop_anchor_ms=(0.0,), hop_exit_ms=0.0)
    sim = simulate_spd(case, decode_tokens=2)
    assert sim["ticks"] == 2 + (2 - 1) * (1 + 1)  # (N-1) + (n-1)(1+R); the final rejection costs no refill
    assert sim["time_ms"] == pytest.approx(4.5)
    n4 = simulate_spd(sep_case(stage_ms=(1.0,) * 4, hop_act_ms=(0.2,) * 3, hop_anchor_ms=(0.3,) * 3, alpha=0.0), 10)
    assert n4["ticks"] == 10 + 3 * (1 + 9)


def test_eal_for_request_counts_the_fill_and_tends_to_steady_state():
    # n=2, alpha=0.8, 32 tokens: 31 + 1 * (1 + 30 * 0.2) = 38 ticks -> 62 / 38
    assert eal_for_request(2, 0.8, 32) == pytest.approx(62 / 38)
    # with a whole number of rejections it is exactly the schedule's tick count
    assert eal_for_request(4, 0.5, 42) == pytest.approx(4 * 41 / decode_ticks(42, 4, 20))
    assert eal_for_request(4, 1.0, 10) == pytest.approx(4 * 9 / (9 + 3))  # only the fill is lost
    assert eal_for_request(4, 0.7, 10**7) == pytest.approx(expected_eal(4, 0.7), rel=1e-5)
    with pytest.raises(ValueError):
        eal_for_request(4, 0.7, 1)


def test_balanced_partition_moves_layers_off_the_driver_stage():
    # 8 layers of 1 ms, 2 ms of driver work on stage 0: [3, 5] gives max(3 + 2, 5) = 5
    assert balanced_partition((1.0,) * 8, 2, [2.0, 0.0]) == [3, 5]
    # no extra work: the most even split of uneven layers
    assert balanced_partition((4.0, 1.0, 1.0, 1.0, 1.0), 2, [0.0, 0.0]) == [1, 4]


def test_rebalanced_split_from_a_runs_measured_costs():
    """Each layer is charged its stage's mean; a split no better than the run's stays the run's."""
    # Qwen2.5-0.5B's co-located n=2 run at 12/12: stage 0's layers 46.75 ms + the PDM 5.2, stage 1's
    # 46.0 + the head 21.0: moving two of stage 1's layers (3.833 ms each) to stage 0 gives 59.6 ms
    best, best_ms, now_ms = rebalanced_split([12, 12], [46.75, 46.0], [5.2, 21.0])
    assert best == [14, 10] and now_ms == pytest.approx(67.0)
    assert best_ms == pytest.approx(max(46.75 + 2 * 46.0 / 12 + 5.2, 10 * 46.0 / 12 + 21.0))
    # SmolLM2's 15/15: 19.93 + 3.9 against 19.53 + 4.71; 16/14 would load rank 0 with 25.2
    assert rebalanced_split([15, 15], [19.93, 19.53], [3.9, 4.71]) == ([15, 15], pytest.approx(24.24),
                                                                       pytest.approx(24.24))
    # a layer is charged where it was measured: stage 1's slow layers do not move to stage 0 cheaply
    assert rebalanced_split([2, 2], [2.0, 8.0], [0.0, 0.0])[0] == [3, 1]
    with pytest.raises(ValueError, match="one layer time and one extra per stage"):
        rebalanced_split([15, 15], [19.9], [0.0, 0.0])


def test_link_model_from_netbench_interpolates():
    report = {"schema": "spd-netbench/1", "p2p": [
        {"src": 0, "dst": 1, "bytes": 100, "mean_us": 10.0, "p50_us": 9.0, "post_us": 2.0, "post_mean_us": 5.0},
        {"src": 0, "dst": 1, "bytes": 1100, "mean_us": 30.0, "p50_us": 20.0, "post_us": 4.0, "post_mean_us": 7.0},
        {"src": 1, "dst": 2, "bytes": 100, "mean_us": 20.0, "p50_us": 9.0, "post_us": 2.0, "post_mean_us": 5.0},
        {"src": 1, "dst": 2, "bytes": 1100, "mean_us": 40.0, "p50_us": 20.0, "post_us": 4.0, "post_mean_us": 7.0}],
        "allreduce": [{"ranks": 2, "bytes": 8, "mean_us": 50.0}, {"ranks": 8, "bytes": 8, "mean_us": 110.0}]}
    link = LinkModel.from_netbench(report, "test")
    assert link.hop_ms(100) == pytest.approx(0.015)  # mean of 10 and 20 us
    assert link.hop_ms(600) == pytest.approx(0.025)  # half way from 15 to 35 us
    assert link.hop_ms(2100) == pytest.approx(0.055)  # beyond the largest size: last segment's slope
    assert link.post_ms == pytest.approx(0.006) and link.read_ms == pytest.approx(0.003)  # mean / p50 posts
    notes: list[str] = []
    assert link.allreduce_ms(4, 8, notes) == pytest.approx(0.080)  # log2 4 is half way from 2 to 8 ranks
    assert notes == []
    assert link.allreduce_ms(16, 8, notes) == pytest.approx(0.110 * 4 / 3)  # log2 scaling, flagged
    assert "extrapolated" in notes[0]
    with pytest.raises(ValueError, match="spd-netbench/1"):
        LinkModel.from_netbench({"schema": "other"}, "bad")
    # with idle (cold) measurements, hops and send posts come from them; larger sizes use hot ones
    report["p2p"][0].update(idle_mean_us=50.0, idle_post_mean_us=9.0)
    report["p2p"][2].update(idle_mean_us=70.0, idle_post_mean_us=9.0)
    cold = LinkModel.from_netbench(report, "cold")
    assert cold.hop_ms(100) == pytest.approx(0.060) and cold.hop_ms(1100) == pytest.approx(0.035)
    assert cold.post_ms == pytest.approx((9 + 7 + 9 + 7) / 4 / 1e3)
    assert LinkModel.from_netbench(report, "hot", "mean_us").hop_ms(100) == pytest.approx(0.015)
    assert cold.late_ms == 0.0  # not measured
    report["p2p"][0].update(late_mean_us=80.0, late_p50_us=60.0)
    report["p2p"][2].update(late_mean_us=120.0, late_p50_us=90.0)
    assert LinkModel.from_netbench(report, "late").late_ms == pytest.approx(0.100)  # mean of the means
    assert LinkModel.from_netbench({**report, "allreduce": []}, "late", "idle_p50_us").late_ms == pytest.approx(0.075)


def test_link_model_from_the_runtime_transport_rows():
    """--net-transport gloo/shm: the hops of `spd netbench --tests transport` rows (one transport,
    one busy_mb); gloo keeps raw P2P's send and read costs, shm adds none (its copies are inside
    the one-way time)."""
    row = lambda kind, size, mean, busy_mb=0.0, busy_us=0.0: {  # noqa: E731
        "transport": kind, "a": 0, "b": 1, "bytes": size, "busy_us": busy_us, "busy_mb": busy_mb,
        "mean_us": mean, "p50_us": mean / 2}
    report = {"schema": "spd-netbench/1",
              "p2p": [{"src": 0, "dst": 1, "bytes": 64, "mean_us": 100.0, "post_us": 5.0, "post_mean_us": 9.0}],
              "transport": [row("gloo", 64, 200.0), row("shm", 64, 10.0), row("shm", 4096, 30.0),
                            row("shm", 64, 40.0, busy_us=500.0), row("shm", 64, 400.0, busy_mb=256.0)]}
    shm = LinkModel.from_netbench(report, "nb", "idle_mean_us", "shm")  # no idle rows there: the mean
    assert shm.hop_ms(64) == pytest.approx(0.010) and shm.hop_ms(2080) == pytest.approx(0.020)
    assert shm.post_ms == 0.0 and shm.read_ms == 0.0 and "shm" in shm.name
    assert LinkModel.from_netbench(report, "nb", "p50_us", "shm").hop_ms(64) == pytest.approx(0.005)
    gloo = LinkModel.from_netbench(report, "nb", "mean_us", "gloo")
    assert gloo.hop_ms(64) == pytest.approx(0.200) and gloo.post_ms == pytest.approx(0.009)
    assert gloo.read_ms == pytest.approx(0.005)
    cold = LinkModel.from_netbench(report, "nb", "mean_us", "shm", busy_mb=256.0)
    assert cold.hop_ms(64) == pytest.approx(0.400) and "256 MiB" in cold.name
    assert LinkModel.from_netbench(report, "nb").hop_ms(64) == pytest.approx(0.100)  # raw P2P, as before
    with pytest.raises(ValueError, match="no gloo transport rows at busy_mb=256"):
        LinkModel.from_netbench(report, "nb", "mean_us", "gloo", busy_mb=256.0)
    with pytest.raises(ValueError, match="p2p, gloo or shm"):
        LinkModel.from_netbench(report, "nb", "mean_us", "nccl")
    with pytest.raises(ValueError, match="not raw P2P"):
        LinkModel.from_netbench(report, "nb", "mean_us", "p2p", busy_mb=256.0)


def test_spd_plan_prices_the_runtime_transport(tmp_path, capsys):
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    report = json.loads(open(net).read())
    report["transport"] = [{"transport": "shm", "a": 0, "b": 1, "bytes": b, "busy_us": 0.0, "busy_mb": 0.0,
                            "mean_us": 20.0, "p50_us": 20.0} for b in (48, 176, 304)]
    (tmp_path / "net.json").write_text(json.dumps(report))
    out = str(tmp_path / "plan.json")
    assert main(["plan", "--profile", profile, "--net", net, "--net-transport", "shm", "--alpha", "1.0", "--n", "2",
                 "--sim-tokens", "2000", "--json", out]) == 0
    result = json.loads(open(out).read())
    rows = {(r["method"], r["layout"]): r for r in result["rows"]}
    # PP: 4 ms of layers + verify 0.2 + the activation's and the token's 0.02 ms hops on the rings
    assert rows[("pp", "-")]["token_ms"] == pytest.approx(4.24)
    # SPD co-located: stage 0 (2) + PDM 0.5 on rank 0 (stage 1 + the head: 2.2); the rings' sends and
    # reads are inside their hops
    assert rows[("spd", "coloc")]["steady_tick_ms"] == pytest.approx(2.50)
    assert main(["plan", "--profile", profile, "--assume-link", "5,100", "--alpha", "1.0",
                 "--net-transport", "shm"]) == 2
    assert "--net-transport" in capsys.readouterr().err
    assert main(["plan", "--profile", profile, "--net", net, "--alpha", "1.0", "--net-transport", "shm",
                 "--net-busy-mb", "256"]) == 2
    assert "no shm transport rows at busy_mb=256" in capsys.readouterr().err
    assert main(["plan", "--validate", "--net-transport", "shm"]) == 2


def test_alpha_curve_and_profile_validation():
    curve = AlphaCurve({2: 0.9, 8: 0.6})
    notes: list[str] = []
    assert curve(4, notes) == pytest.approx(0.8)
    assert curve(16, notes) == pytest.approx(0.6) and "held" in notes[0]
    assert AlphaCurve.from_eval_json({"results": [{"n": 4, "alpha": 0.7}, {"n": 4, "alpha": 0.9}]})(4, []) \
        == pytest.approx(0.8)
    with pytest.raises(ValueError, match="unknown keys"):
        Profile.from_dict({"layer_ms": 1.0, "num_layers": 2, "pdm_ms": 1, "verify_ms": 1, "hidden_size": 8, "x": 1})
    with pytest.raises(ValueError, match="stage_ms\\[2\\]"):
        Profile.from_dict({"layer_ms": [1, 1], "pdm_ms": 1, "verify_ms": 1, "hidden_size": 8, "stage_ms": {"2": [1]}})


def _write_plan_inputs(tmp_path) -> tuple[str, str]:
    # 4 layers of 1 ms, PDM 0.5 ms, verify 0.2 ms, H = 64 in 2-byte dtype, one anchor row:
    # messages are token 48 B, activation / anchors 48 + 128 = 176 B, exit 48 + 256 = 304 B.
    profile = {"schema": "spd-profile/1", "name": "hand", "num_layers": 4, "layer_ms": 1.0, "pdm_ms": 0.5,
               "verify_ms": 0.2, "hidden_size": 64, "dtype_bytes": 2, "anchors_per_stage": 1}
    p2p = [{"src": 0, "dst": 1, "bytes": b, "mean_us": 100.0, "p50_us": 100.0, "post_us": 10.0, "post_mean_us": 10.0}
           for b in (48, 176, 304)]
    allreduce = [{"ranks": 2, "bytes": 8, "mean_us": 40.0}, {"ranks": 2, "bytes": 128, "mean_us": 50.0}]
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    (tmp_path / "net.json").write_text(json.dumps({"schema": "spd-netbench/1", "p2p": p2p, "allreduce": allreduce}))
    return str(tmp_path / "profile.json"), str(tmp_path / "net.json")


def test_spd_plan_hand_computed(tmp_path, capsys):
    """The driver verifies (--verify-at driver): its head is in its per-tick work."""
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    out = str(tmp_path / "plan.json")
    assert main(["plan", "--profile", profile, "--net", net, "--alpha", "1.0", "--n", "2", "--sim-tokens", "2000",
                 "--verify-at", "driver", "--json", out]) == 0
    result = json.loads(open(out).read())
    rows = {(r["method"], r["layout"]): r for r in result["rows"]}
    # AR: 4 layers x 1 ms + verify 0.2
    assert result["ar_token_ms"] == pytest.approx(4.2)
    # PP on 2 devices: 4 ms of layers + verify 0.2 + activation hop 0.1 + token hop back 0.1
    assert rows[("pp", "-")]["token_ms"] == pytest.approx(4.4)
    # TP on 2 devices: 4 x 0.5 ms shards + (2 x 4 + embedding 1) all-reduces of 128 B (0.05) + head 0.2 / 2
    # + argmax 8 B (0.04) + the token's hop to the other TP rank (0.1)
    assert rows[("tp", "one node")]["token_ms"] == pytest.approx(2.0 + 0.45 + 0.1 + 0.04 + 0.1)
    # SPD, separate driver, [2, 2] layers; post = read = 0.01 ms per message. Cycles per tick:
    #   stage 0: read + 2 + 2 posts = 2.03; stage 1: read + 2 + 1 post = 2.02;
    #   driver: post + 2 reads + 0.5 + 0.2 = 0.73
    #   verify loop: (token 0.1 + 2 stage reads 0.02 + 4 + activation 0.1 + exit 0.1 + driver read 0.01
    #                 + verify 0.2) / 2 = 2.265
    sep = rows[("spd", "sep")]
    assert sep["critical"].startswith("verify loop") and sep["steady_tick_ms"] == pytest.approx(2.265)
    assert sep["eal"] == 2.0 and sep["tick_ms"] == pytest.approx(2.265, rel=2e-3)
    assert sep["tok_s"] == pytest.approx(1e3 / 2.265, rel=2e-3) and sep["devices"] == 3
    # SPD co-located: rank 0 does stage 0 (2) + post + 1 read + PDM + verify = 2.72 per tick
    col = rows[("spd", "coloc")]
    assert col["steady_tick_ms"] == pytest.approx(2.72) and col["devices"] == 2
    assert col["speedup_vs_ar"] == pytest.approx(4.2 / 2.72, rel=2e-3)
    # on 2 devices TP (2.69 ms) beats co-located SPD (2.72 ms) and PP (4.4 ms); SPD needs a 3rd device
    assert result["best_by_devices"]["2"]["method"] == "tp"
    assert result["best_by_devices"]["3"]["method"] == "spd"
    printed = capsys.readouterr().out
    assert "recommendation:" in printed and "on the same n devices, TP is fastest for n = 2" in printed


def test_spd_plan_errors(tmp_path, capsys):
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    assert main(["plan", "--profile", profile, "--alpha", "0.8"]) == 2
    assert "--net" in capsys.readouterr().err
    assert main(["plan", "--profile", profile, "--net", net, "--alpha", "1.5"]) == 2
    assert "alpha" in capsys.readouterr().err
    assert main(["plan", "--reference", "llama-3.1-8b-h200", "--assume-link", "5,400,10", "--alpha", "0.8",
                 "--n", "8", "--sim-tokens", "200"]) == 0
    assert "ASSUMPTION" in capsys.readouterr().out  # assumed links and ideal TP shards are flagged


def test_hybrid_tp_inside_spd_across(tmp_path):
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    out = str(tmp_path / "plan.json")
    assert main(["plan", "--profile", profile, "--net", net, "--alpha", "2:0.9,4:0.5", "--n", "4",
                 "--sim-tokens", "200", "--json", out]) == 0
    rows = [r for r in json.loads(open(out).read())["rows"] if r["method"] == "tp2xspd"]
    assert {r["layout"] for r in rows} == {"sep", "coloc"}
    for r in rows:
        # 2-way TP groups as 2 SPD stages: each stage holds 2 layers as 0.5 ms shards plus two
        # 128 B all-reduces (0.05 ms) per layer: 2 x 0.5 + 2 x 2 x 0.05 = 1.2 ms
        assert r["spd_stages"] == 2 and r["stage_ms"] == pytest.approx([1.2, 1.2])
        assert r["alpha"] == 0.9  # the acceptance of a 2-stage pipeline, not of n = 4
        assert r["devices"] == (4 if r["layout"] == "coloc" else 5)


def test_pp_uses_measured_stage_times_where_the_profile_has_them():
    # and rejects a stage table of the wrong length
    with pytest.raises(ValueError, match=r"pp_stage_ms\[2\] must have 2 entries"):
        Profile.from_dict({"name": "x", "layer_ms": [1.0], "pdm_ms": 0.5, "verify_ms": 0.2, "hidden_size": 8,
                           "pp_stage_ms": {"2": [1.0]}})
    from spd_engine.costmodel.cost_model import Links, plan

    link = LinkModel.assume("hand", 100.0, 1.0, None)  # 0.1 ms + bytes / 1 GB/s per hop
    base = {"schema": "spd-profile/1", "name": "hand", "num_layers": 4, "layer_ms": 1.0, "pdm_ms": 0.5,
            "verify_ms": 0.2, "hidden_size": 64, "dtype_bytes": 4}
    hops = link.hop_ms(HEADER_BYTES + 64 * 4) + link.hop_ms(HEADER_BYTES)  # activation to stage 1, token back to stage 0
    spd_stages, pp_stages = {"stage_ms": {"2": [3.0, 2.5]}}, {"pp_stage_ms": {"2": [3.5, 3.4]}}
    # no measured stages: the layers' share + the head (verify); SPD-run stages + the head;
    # pp-run stages, whose last already includes the head
    for extra, want, partition in (({}, 4.0 + 0.2, "even"), (spd_stages, 5.5 + 0.2, "measured"),
                                   ({**spd_stages, **pp_stages}, 6.9, "measured (pp)")):
        prof = Profile.from_dict({**base, **extra})
        rows = plan(prof, Links(link), AlphaCurve({0: 0.5}), [2, 4])["rows"]
        pp = {r["n"]: r for r in rows if r["method"] == "pp"}
        assert pp[2]["partition"] == partition
        assert pp[2]["token_ms"] == pytest.approx(want + hops)
        assert pp[4]["partition"] == "even"  # no measured stages at n = 4: the layers' share of AR
        assert pp[4]["token_ms"] == pytest.approx(4.0 + 0.2 + 3 * link.hop_ms(HEADER_BYTES + 64 * 4) + link.hop_ms(HEADER_BYTES))


def test_message_sizes_are_the_engines_wire_format():
    from spd_engine.costmodel.cost_inputs import message_bytes
    from spd_engine.engine.comm.transport import FRAME_HEAD
    from spd_engine.engine.protocol.messages import META_LEN, Header, Kind, WireFormat, link_frames, payload_bytes
    from spd_engine.engine.protocol.topology import Topology

    assert HEADER_BYTES == FRAME_HEAD  # the head of every frame on the wire
    assert TABLE_ROW_BYTES == 8 * META_LEN  # a BATCH table row
    wire, tok = WireFormat(hidden=64, stage_anchors=(3, 3, 3)), Header(Kind.BATCH, rows=1)  # a request alone's
    topo = Topology((1, 1, 1), colocate=False)  # driver rank 0, stage p on rank p + 1
    caps = link_frames(topo, wire, 2)
    sizes = message_bytes(64, 2, 3)
    for name, payloads, link in (("token", wire.from_driver(tok), (0, 1)), ("activation", wire.downstream(tok), (1, 2)),
                                 ("anchors", wire.to_driver(0, tok), (1, 0)), ("exit", wire.to_driver(2, tok), (3, 0))):
        assert sizes[name] == HEADER_BYTES + payload_bytes(payloads, 2), name
        assert caps[link] >= payload_bytes(payloads, 2), name  # the payloads ride inside the frame ...
        assert MESSAGE_PARTS[name] == 1, name  # ... so a decode-tick message is one tensor on the wire


def test_late_receives_cost_every_tensor_found_waiting():
    # a receive posted after its send waits late_ms (gloo's rendezvous); every decode-tick message
    # is one frame (MESSAGE_PARTS). 3 + 2 ms stages, zero posts and reads, late 0.05 ms:
    #   stage 0: its token is waiting when it finishes: 0.05 + 3 = 3.05 per tick
    #   stage 1: its activation frame: 0.05 + 2 = 2.05
    #   driver: stage 0's anchors + the exit, one frame each: 2 x 0.05 + PDM 0.5 + verify 0.2 = 0.8
    #   verify loop: as without (5.9): every message on it is awaited, none found waiting
    case = sep_case(late_ms=0.05)
    cycles = spd_cycles(case)
    assert cycles["stage 0 compute"] == pytest.approx(3.05) and cycles["stage 1 compute"] == pytest.approx(2.05)
    assert cycles["driver: PDM + verify"] == pytest.approx(0.8)
    assert cycles["verify loop (token through all stages, verify, next token)"] == pytest.approx(5.9 / 2)
    assert simulate_spd(case, 2000)["tick_ms"] == pytest.approx(3.05, rel=2e-3)
    assert simulate_spd(sep_case(), 2000)["tick_ms"] == pytest.approx(3.0, rel=2e-3)  # late 0: as before


# ---------------------------------------------------------------- verification on the last stage

def test_verify_on_last_moves_the_head_into_the_last_stage_separate_driver():
    # the sep_case numbers, the head (verify 0.2) on stage 1:
    #   stage 1: 2 + 0.2 = 2.2; driver: PDM 0.5 alone (its compare of the stage's token is free)
    #   verify loop: unchanged, 5.9 / 2: the head is before the exit hop instead of after it
    #   anchor loop via stage 0: token 0.1 + stage 0 3.0 + anchors 0.3 + PDM 0.5, no verify: 3.9 / 2
    case = sep_case(verify_on_last=True)
    cycles = spd_cycles(case)
    assert cycles["stage 0 compute"] == pytest.approx(3.0)
    assert cycles["stage 1 compute (+ verify)"] == pytest.approx(2.2)
    assert cycles["driver: PDM"] == pytest.approx(0.5)
    assert cycles["verify loop (token through all stages, verify, next token)"] == pytest.approx(5.9 / 2)
    assert cycles["anchor loop via stage 0"] == pytest.approx(3.9 / 2)
    assert simulate_spd(case, 2000)["tick_ms"] == pytest.approx(3.0, rel=2e-3)  # still stage 0's
    # a last stage that bounds the tick pays the head: 2.9 + 0.2 = 3.1; verifying on the driver the
    # tick is 2.9 (stage 1, and the verify loop: (0.1 + 2 + 2.9 + 0.2 + 0.4 + 0.2) / 2)
    late = dict(stage_ms=(2.0, 2.9))
    assert simulate_spd(sep_case(verify_on_last=True, **late), 2000)["tick_ms"] == pytest.approx(3.1, rel=2e-3)
    assert simulate_spd(sep_case(**late), 2000)["tick_ms"] == pytest.approx(2.9, rel=2e-3)
    pred = predict_spd(case, 2000)
    assert pred["driver_ms"] == pytest.approx(0.5) and pred["slowest_stage_ms"] == pytest.approx(3.0)
    assert pred["driver_slack_ms"] == pytest.approx(2.5) and pred["verify_at"] == "last"
    assert predict_spd(sep_case(), 2000)["driver_ms"] == pytest.approx(0.7)  # on the driver: PDM + verify


def test_verify_on_last_rejections_by_hand():
    # test_rejections_refill_the_pipeline_by_hand with the head (0.25) on stage 1, which computes
    # it for every token, stale ones included:
    # tick 1: x_P at stage 0 [0,1], stage 1 [1,2.25]; driver: PDM -> 0.25, sends d.
    # tick 2: stage 0 [1,2], stage 1 [2.25,3.5]; driver: anchors (1), PDM -> 1.25, x_P's exit and
    #         token at 2.25, the compare costs nothing: reject at 2.25.
    # tick 3: the correction: stage 0 [2.25,3.25]; stage 1 is busy with the stale d until 3.5:
    #         [3.5,4.75]; refill: PDM -> 2.5, sends d'.
    # tick 4: stage 0 [3.25,4.25]; driver: the correction's anchors (3.25), PDM -> 3.5, its exit at
    #         4.75: reject, the run ends (N-1 = 2).
    case = sep_case(stage_ms=(1.0, 1.0), pdm_ms=0.25, verify_ms=0.25, alpha=0.0, hop_token_ms=0.0,
                    hop_act_ms=(0.0,), hop_anchor_ms=(0.0,), hop_exit_ms=0.0, verify_on_last=True)
    sim = simulate_spd(case, decode_tokens=2)
    assert sim["ticks"] == 4 and sim["time_ms"] == pytest.approx(4.75)


def test_verify_on_last_co_located():
    # test_colocated_driver_adds_its_work_to_stage_0's case, the head (0.5) on stage 1:
    #   rank 0: stage 0 1.0 + post 0.05 + 1 read 0.05 + PDM 1.0 = 2.1 (2.6 verifying there)
    #   stage 1: read 0.05 + 3.0 + 0.5 + post 0.05 = 3.6 (3.1 without the head): the slow stage pays it
    #   verify loop: (stage 0 1.0 + stage 1 3.5 + activation 0.2 + exit 0.3 + 2 reads 0.1) / 2 = 2.55
    kw = dict(stage_ms=(1.0, 3.0), pdm_ms=1.0, verify_ms=0.5, alpha=1.0, colocate=True, hop_token_ms=0.0,
              hop_act_ms=(0.2,), hop_anchor_ms=(0.3,), hop_exit_ms=0.3, post_ms=0.05, recv_ms=0.05)
    case = SpdCase(**kw)  # verify_on_last by default: co-located, the runtime's --verify-at auto puts the head there
    cycles = spd_cycles(case)
    assert cycles == pytest.approx({"stage 1 compute (+ verify)": 3.6, "rank 0: stage 0 + driver (PDM)": 2.1,
                                    "verify loop (token through all stages, verify, next token)": 2.55})
    assert simulate_spd(case, 2000)["tick_ms"] == pytest.approx(3.6, rel=2e-3)
    # the other way round (stage 0 3.0, stage 1 1.0) rank 0 bounds the tick and sheds the head:
    # 3.0 + 0.1 + 1.0 = 4.1 instead of 4.6
    swapped = {**kw, "stage_ms": (3.0, 1.0)}
    assert simulate_spd(SpdCase(**swapped), 2000)["tick_ms"] == pytest.approx(4.1, rel=2e-3)
    assert simulate_spd(SpdCase(**swapped, verify_on_last=False), 2000)["tick_ms"] == pytest.approx(4.6, rel=2e-3)
    # n = 1: the last stage is stage 0, on the driver's rank: the driver verifies (RunConfig.verifies_on_last)
    one = SpdCase(**{**kw, "stage_ms": (1.0,), "hop_act_ms": (), "hop_anchor_ms": ()})
    assert not one.head_on_last and one.driver_verify_ms == 0.5 and one.stage_work_ms == (1.0,)


def test_branch_points_leave_a_share_of_verification_on_the_driver():
    # half the exits are branch chains the driver verifies: stage 1 2 + 0.1, driver 0.5 + 0.1,
    # the verify loop still carries the whole head (5.9 / 2), the anchor loop the driver's half
    case = sep_case(verify_on_last=True, driver_verify_share=0.5)
    cycles = spd_cycles(case)
    assert cycles["stage 1 compute (+ verify)"] == pytest.approx(2.1)
    assert cycles["driver: PDM + verify"] == pytest.approx(0.6)
    assert cycles["verify loop (token through all stages, verify, next token)"] == pytest.approx(5.9 / 2)
    assert cycles["anchor loop via stage 0"] == pytest.approx(4.0 / 2)
    with pytest.raises(ValueError, match="driver_verify_share"):
        sep_case(driver_verify_share=1.5)


def test_spd_plan_hand_computed_verifying_on_the_last_stage(tmp_path, capsys):
    """test_spd_plan_hand_computed's inputs with --verify-at last: the head (0.2) is stage 1's
    work, the driver's is the PDM."""
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    out = str(tmp_path / "plan.json")
    assert main(["plan", "--profile", profile, "--net", net, "--alpha", "1.0", "--n", "2", "--sim-tokens", "2000",
                 "--verify-at", "last", "--json", out]) == 0
    result = json.loads(open(out).read())
    assert result["verify_at"] == "last"
    rows = {(r["method"], r["layout"]): r for r in result["rows"]}
    assert rows[("pp", "-")]["token_ms"] == pytest.approx(4.4) and result["ar_token_ms"] == pytest.approx(4.2)
    # separate driver, [2, 2] layers (the balanced split is the same: [3, 1] puts 3 ms on stage 0);
    # post = read = 0.01 ms per message. Cycles per tick:
    #   stage 0: 2.03; stage 1: read + 2 + head 0.2 + 1 post = 2.22; driver: post + 2 reads + PDM 0.5 = 0.53
    #   verify loop: as verifying on the driver, 4.53 / 2 = 2.265
    #   anchor loop via stage 0: (token 0.1 + 2 + read + post + anchors 0.1 + 2 reads + PDM 0.5) / 2 = 1.37
    sep = rows[("spd", "sep")]
    assert sep["partition"] == "even" and sep["stage_layers"] == [2, 2]
    assert sep["critical"].startswith("verify loop") and sep["steady_tick_ms"] == pytest.approx(2.265)
    assert sep["driver_ms"] == pytest.approx(0.5) and sep["slowest_stage_ms"] == pytest.approx(2.2)
    # co-located: rank 0 does stage 0 (2) + post + 1 read + PDM = 2.52 per tick (2.72 verifying there);
    #   stage 1 2.22; verify loop (4.2 + activation 0.1 + exit 0.1 + 2 reads) / 2 = 2.21
    col = rows[("spd", "coloc")]
    assert col["critical"] == "rank 0: stage 0 + driver (PDM)" and col["steady_tick_ms"] == pytest.approx(2.52)
    assert col["tick_ms"] == pytest.approx(2.52, rel=2e-3)
    # now co-located SPD (2.52 ms per token at alpha 1) beats TP (2.69 ms) on 2 devices
    assert result["best_by_devices"]["2"]["method"] == "spd"
    assert "verifies at T=0 on the last stage (--verify-at last)" in capsys.readouterr().out
    # --verify-at auto, the default as the runtime's: each layout as the runtime runs it, the
    # co-located row verifying on the last stage (2.52), the separate driver's on the driver
    # (test_spd_plan_hand_computed: 2.265 through the verify loop, its driver 0.7 ms)
    assert main(["plan", "--profile", profile, "--net", net, "--alpha", "1.0", "--n", "2", "--sim-tokens", "2000",
                 "--json", out]) == 0
    auto = json.loads(open(out).read())
    assert auto["verify_at"] == "auto"
    rows = {(r["method"], r["layout"]): r for r in auto["rows"]}
    col = rows[("spd", "coloc")]
    assert col["verify_at"] == "last" and col["steady_tick_ms"] == pytest.approx(2.52)
    assert rows[("spd", "sep")]["verify_at"] == "driver" and rows[("spd", "sep")]["driver_ms"] == pytest.approx(0.7)
    assert "on the last stage co-located, on the driver with a separate driver (--verify-at auto)" in \
        capsys.readouterr().out


def test_balanced_split_moves_layers_off_the_verifying_last_stage():
    from spd_engine.costmodel.cost_model import Links, plan

    # 8 layers of 1 ms, a 2 ms head, PDM 0.5 ms. The head on stage 1: [5, 3] (5 | 3 + 2) beats the
    # even [4, 4] (4 | 6), separate or co-located (5.5 | 5); on the driver: separate, [4, 4] is
    # already best; co-located, the driver's 2.5 ms sit on stage 0: [3, 5] (5.5 | 5)
    prof = Profile.from_dict({"name": "head", "num_layers": 8, "layer_ms": 1.0, "pdm_ms": 0.5, "verify_ms": 2.0,
                              "hidden_size": 64})
    link = LinkModel.assume("hand", 1.0, 100.0, None)
    for verify_at, want in (("last", {"sep": [5, 3], "coloc": [5, 3]}), ("driver", {"coloc": [3, 5]}),
                            ("auto", {"coloc": [5, 3]})):
        rows = plan(prof, Links(link), AlphaCurve({0: 1.0}), [2], sim_tokens=200, verify_at=verify_at)["rows"]
        got = {r["layout"]: r["stage_layers"] for r in rows if r["method"] == "spd" and r["partition"] == "balanced"}
        assert got == want, verify_at
    with pytest.raises(ValueError, match="verify_at must be one of"):
        plan(prof, Links(link), AlphaCurve({0: 1.0}), [2], verify_at="stage0")


def test_hybrid_last_stage_runs_a_vocab_parallel_head(tmp_path):
    # tp2xspd at n = 4: 2 SPD stages of 1.2 ms (test_hybrid_tp_inside_spd_across); verifying on the
    # last stage group, its head is vocab-parallel: 0.2 / 2 + an 8-byte all-reduce (0.04) = 0.14
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    for flag, slowest, driver in (("last", 1.2 + 0.14, 0.5), ("driver", 1.2, 0.7)):
        out = tmp_path / f"plan-{flag}.json"
        assert main(["plan", "--profile", profile, "--net", net, "--alpha", "0.9", "--n", "4", "--sim-tokens", "200",
                     "--verify-at", flag, "--json", str(out)]) == 0
        rows = [r for r in json.loads(out.read_text())["rows"] if r["method"] == "tp2xspd"]
        assert rows and all(r["slowest_stage_ms"] == pytest.approx(slowest) for r in rows), flag
        assert all(r["driver_ms"] == pytest.approx(driver) for r in rows), flag


def test_verify_at_flag_is_refused_where_it_prices_nothing(tmp_path, capsys):
    from spd_engine.tools.cli import main

    profile, net = _write_plan_inputs(tmp_path)
    assert main(["plan", "--validate", "--verify-at", "driver"]) == 2
    assert "--verify-at: not used by --validate" in capsys.readouterr().err
    assert main(["plan", "--revalidate", str(tmp_path / "saved.json"), "--verify-at", "last"]) == 2
    assert "--verify-at: not used" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not a choice
        main(["plan", "--profile", profile, "--net", net, "--alpha", "1.0", "--verify-at", "stage0"])
    from spd_engine.engine.runtime.run_config import VERIFY_AT
    from spd_engine.tools.cli import sub_parser
    from spd_engine.tools.plan import add_arguments

    parser = sub_parser("spd plan", "")
    add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "verify_at")
    # the runtime's choices and default (the cost model keeps its own copy: it needs no torch)
    from spd_engine.costmodel.cost_model_spd import VERIFY_AT as MODEL_VERIFY_AT
    from spd_engine.engine.runtime.run_config import ParallelLayout

    assert tuple(action.choices) == MODEL_VERIFY_AT == VERIFY_AT and action.default == ParallelLayout.verify_at
