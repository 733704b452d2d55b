"""`spd netbench`: statistics, report invariants, two torchrun agents as two nodes, and a dead
rank ending the run with an error on every rank (gloo, small sizes)."""
from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spd_engine.bench.stats import bandwidth_gbps, parse_bytes, percentile, summarize_us
from spd_engine.engine.runtime.launch import spd_script

REPO = Path(__file__).resolve().parents[2]


def test_percentiles_are_ordered_and_interpolated():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)  # position 0.9 * 4 = 3.6 between 4 and 5
    s = summarize_us([x * 1e-6 for x in xs])
    assert s["p50_us"] <= s["p90_us"] <= s["p99_us"] <= s["max_us"]
    assert s["jitter_us"] == pytest.approx(s["p99_us"] - s["p50_us"])
    assert s["mean_us"] == pytest.approx(3.0)


def test_byte_sizes_parse():
    assert parse_bytes("4") == 4 and parse_bytes("8K") == 8192 and parse_bytes("64M") == 64 << 20
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes("lots")


def _check_report(report: dict, world: int) -> None:
    assert report["schema"] == "spd-netbench/1" and report["world_size"] == world
    assert report["backend"] == "gloo" and report["nccl_tested"] is False
    for kind in ("p2p", "allreduce", "fanin"):
        assert report[kind], f"no {kind} rows"
        for row in report[kind]:
            assert 0 < row["min_us"] <= row["p50_us"] <= row["p90_us"] <= row["p99_us"] <= row["max_us"]
            assert row["jitter_us"] == pytest.approx(row["p99_us"] - row["p50_us"])
    for row in report["p2p"]:
        assert row["bw_GBps"] == pytest.approx(bandwidth_gbps(row["bytes"], row["p50_us"]))
        assert row["bw_GBps"] == pytest.approx(row["bytes"] / (row["p50_us"] * 1e-6) / 1e9)
        assert row["algbw_GBps"] == row["busbw_GBps"] == row["bw_GBps"]  # P2P: every byte crosses the link once
        if row["bytes"] <= 65536:  # idle (cold) ping-pong and late receives for the small sizes a tick sends
            assert 0 < row["idle_p50_us"] <= row["idle_p99_us"] and row["late_p50_us"] > 0 and row["late_mean_us"] > 0
        else:
            assert "idle_p50_us" not in row and "late_p50_us" not in row
    for row in report["allreduce"]:  # nccl-tests: busbw = algbw * 2(r-1)/r
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["p50_us"] * 1e-6) / 1e9)
        r = row["ranks"]
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (r - 1) / r)
    for row in report["fanin"]:
        assert row["senders"] == world - 1
        assert row["bw_GBps"] == pytest.approx(row["bytes"] * row["senders"] / (row["p50_us"] * 1e-6) / 1e9)


@pytest.mark.multiproc
def test_local_run_report_invariants(tmp_path, capfd):
    from spd_engine.tools.cli import main

    # 256K is above the idle ping-pong's 64 KiB limit
    rc = main(["netbench", "--nproc", "3", "--sizes", "4,1K,256K", "--iters", "20", "--warmup", "2",
               "--allreduce-bytes", "4,1K", "--allreduce-busy-us", "50", "--hidden", "256", "--fanin-rows", "1,2",
               "--timeout", "20", "--out-dir", str(tmp_path)])
    out = capfd.readouterr()
    assert rc == 0, out.err
    report = json.loads((tmp_path / "netbench.json").read_text())
    _check_report(report, 3)
    pairs = {(r["src"], r["dst"]) for r in report["p2p"]}
    assert pairs == {(0, 1), (0, 2), (1, 2)}  # driver <-> each stage, then neighbouring stages
    assert {r["bytes"] for r in report["p2p"]} == {4, 1024, 262144}
    assert {(r["ranks"], r["bytes"]) for r in report["allreduce"]} == {(2, 4), (2, 1024), (3, 4), (3, 1024)}
    assert report["config"]["allreduce_busy_us"] == 50.0  # compute before every timed all-reduce
    with open(tmp_path / "netbench.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(report["p2p"]) + len(report["allreduce"]) + len(report["fanin"])
    assert "P2P ping-pong" in out.out and "algbw(GB/s)" in out.out and "busbw(GB/s)" in out.out
    allreduce_table = out.out.split("# all-reduce")[1]
    assert "algbw(GB/s)" in allreduce_table and "busbw(GB/s)" in allreduce_table
    assert (tmp_path / "netbench.png").stat().st_size > 1000  # matplotlib is a test dependency


def test_user_errors_are_reported_cleanly(capsys):
    from spd_engine.tools.cli import main

    assert main(["netbench", "--nproc", "2", "--pairs", "0-5"]) == 2
    assert "pair '0-5'" in capsys.readouterr().err
    assert main(["netbench", "--nproc", "2", "--tests", "replay", "--stage-ms", "1,1,1"]) == 2
    assert "need 4 ranks" in capsys.readouterr().err
    assert main(["netbench", "--nproc", "3", "--tests", "p2p,bogus"]) == 2
    assert "unknown tests ['bogus']" in capsys.readouterr().err
    assert main(["netbench", "--nproc", "2", "--allreduce-busy-us", "-1"]) == 2
    assert "--allreduce-busy-us" in capsys.readouterr().err


def test_busy_compute_lasts_as_long_as_asked():
    import time

    import torch

    from spd_engine.bench.interconnect import _compute_for

    t0 = time.perf_counter()
    _compute_for(torch.ones(64, 64), 3000)
    assert time.perf_counter() - t0 >= 3e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
def test_two_torchrun_agents_as_two_nodes(tmp_path):
    port = str(_free_port())
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
               spd_script(), "netbench", "--backend", "gloo", "--sizes", "4,1K", "--iters", "10",
               "--warmup", "2", "--allreduce-bytes", "4", "--hidden", "64", "--fanin-rows", "1",
               "--timeout", "20", "--no-png", "--out-dir", str(tmp_path / f"node{node}")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        agents.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=env))
    outs = [a.communicate(timeout=150) for a in agents]
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    report = json.loads((tmp_path / "node0" / "netbench.json").read_text())  # rank 0 lives on node 0
    assert not (tmp_path / "node1").exists()  # only rank 0 writes
    _check_report(report, 2)
    assert sorted(r["node_rank"] for r in report["ranks"]) == [0, 1]
    assert [(r["src"], r["dst"]) for r in report["p2p"]] == [(0, 1), (0, 1)]


def _faulty_run(fault: str, timeout: str) -> tuple[int, float]:
    from spd_engine.tools.cli import main

    t0 = time.monotonic()
    rc = main(["netbench", "--nproc", "3", "--tests", "replay", "--stage-ms", "2,2", "--tokens", "400",
               "--hidden", "64", "--fault-rank", "2", "--fault-tick", "5", "--fault", fault, "--timeout", timeout,
               "--out-dir", ""])
    return rc, time.monotonic() - t0


@pytest.mark.multiproc
def test_dead_rank_ends_the_run_with_an_error_on_every_rank(capfd):
    rc, elapsed = _faulty_run("exit", "4")
    err = capfd.readouterr().err
    assert rc == 1, err
    assert "run failed on 3 of 3 ranks" in err
    assert "rank 2: exit code 17" in err  # the injected fault
    # each survivor ends with its own error, naming the operation that found the dead peer
    # which operation finds the dead peer first (posting or finishing a receive or a send)
    # varies with timing, but each error names the role and the operation
    assert re.search(r"rank 0: exit code 1: driver: (receive from stage \d|send to rank \d)", err), err
    assert re.search(r"rank 1: exit code 1: stage 0: (receive from|send to) rank \d", err), err
    assert "hung" not in err, err
    assert elapsed < 60, f"took {elapsed:.0f}s: ranks should fail within a few timeouts"


@pytest.mark.multiproc
def test_silent_rank_ends_the_run_by_timeouts(capfd):
    # rank 2 (the last stage) stays alive but stops talking: the driver's receive times out after
    # 2 s, then the others see their peer gone; the silent rank itself fails when it wakes up.
    rc, elapsed = _faulty_run("stall", "2")
    err = capfd.readouterr().err
    assert rc == 1, err
    # the engine's transport names (rank, peer, tick); the replay adds role and operation
    assert "rank 0: exit code 1: driver: receive from stage 1 (rank 2) failed: rank 0: receive timed out after 2.0s" in err
    assert re.search(r"\(rank=0, peer=2, tick=\d+\)", err), err
    assert "rank 1: exit code 1" in err and "rank 2: exit code 1" in err
    assert "hung" not in err
    assert 2 <= elapsed < 60


@pytest.mark.multiproc
def test_transport_test_times_both_runtime_transports(tmp_path, capfd):
    from spd_engine.tools.cli import main

    rc = main(["netbench", "--nproc", "2", "--tests", "transport", "--sizes", "64,4K,256K", "--iters", "20",
               "--busy-us", "100", "--timeout", "20", "--out-dir", str(tmp_path), "--no-png"])
    out = capfd.readouterr()
    assert rc == 0, out.err
    rows = json.loads((tmp_path / "netbench.json").read_text())["transport"]
    # 256K is above a tick's message sizes; the rings need Linux on x86-64 (else only gloo runs)
    kinds = {"gloo", "shm"} if sys.platform == "linux" and os.uname().machine == "x86_64" else {"gloo"}
    assert {(r["transport"], r["bytes"]) for r in rows} == {(k, b) for k in kinds for b in (64, 4096)}
    for r in rows:
        assert r["iters"] == 20 and r["busy_us"] == 100.0 and 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]
    assert "the runtime's transport" in out.out


@pytest.mark.multiproc
def test_transport_busy_mb_rows_run_through_both_transports(tmp_path, capfd):
    from spd_engine.tools.cli import main

    rc = main(["netbench", "--nproc", "2", "--tests", "transport", "--sizes", "4K", "--iters", "10",
               "--busy-mb", "8", "--timeout", "20", "--out-dir", str(tmp_path), "--no-png"])
    out = capfd.readouterr()
    assert rc == 0, out.err
    rows = json.loads((tmp_path / "netbench.json").read_text())["transport"]
    assert rows and all(r["busy_mb"] == 8.0 and r["iters"] == 10 for r in rows)
    assert all(0 < r["p50_us"] <= r["p99_us"] <= r["max_us"] for r in rows)


def test_pingpong_takes_both_ends_compute_out_of_the_hop(monkeypatch):
    """Each end's compute is a 30 ms sleep here (it evicts nothing, so the hop itself stays an
    in-process queue's); a round trip that kept either end's would be at least 30 ms."""
    import threading
    import time

    from spd_engine.bench import transport_p2p
    from spd_engine.engine.comm.transport import LocalHub

    def sleepy(weights, x, busy_us):
        t0 = time.perf_counter()
        time.sleep(0.03)
        return time.perf_counter() - t0

    monkeypatch.setattr(transport_p2p, "_compute", sleepy)
    hub = LocalHub(2)
    peer = threading.Thread(target=transport_p2p._pingpong, args=(hub.transport(1), 0, 4096, 4, False, 0.0, 10.0))
    peer.start()
    rtts = transport_p2p._pingpong(hub.transport(0), 1, 4096, 4, True, 0.0, 10.0)
    peer.join(10.0)
    assert len(rtts) == 4 and all(-0.005 < r < 0.02 for r in rtts), rtts


def test_netbench_refuses_a_negative_busy_mb(capfd):
    from spd_engine.tools.cli import main

    assert main(["netbench", "--nproc", "2", "--tests", "transport", "--busy-mb", "-1"]) == 2
    assert "--busy-mb" in capfd.readouterr().err
