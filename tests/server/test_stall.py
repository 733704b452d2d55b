"""The server's stall watch (server/stall.py): a silent pipeline fails, a stopped rank is named,
and ranks that compute or wait for a CPU are not stalled. Unit cases over given /proc samples,
then the rule over real processes: one starved of its core by others, one that only sleeps; and
`spd measure serve-neighbour`, which measures a real server beside such neighbours."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from spd_engine.server import stall
from spd_engine.server.stall import RankSample, StallWatch


def watch_over(monkeypatch, samples: list[dict[int, RankSample]], stall_s: float = 10.0) -> list[str | None]:
    """check() at t = 0, 5, 10, ... with the given samples of ranks {rank: pid = rank}, the last
    token at t = 0: what each call returned."""
    current: dict[int, RankSample] = {}
    monkeypatch.setattr(stall, "sample", lambda pid: current[pid])
    watch = StallWatch(stall_s, {r: r for r in samples[0]})
    out = []
    for i, s in enumerate(samples):
        current.clear()
        current.update(s)
        out.append(watch.check(last_progress=0.0, now=5.0 * i))
    return out


def ranks(state: str, cpu: float, wait: float, n: int = 3) -> dict[int, RankSample]:
    return {r: RankSample(state, cpu, wait) for r in range(1, n + 1)}


def test_silent_ranks_are_stalled_after_the_deadline(monkeypatch):
    out = watch_over(monkeypatch, [ranks("S", 1.0, 0.5), ranks("S", 1.01, 0.5), ranks("S", 1.02, 0.51)])
    assert out[:2] == [None, None]  # within the deadline
    assert out[2] is not None and "no stage rank is computing" in out[2] and "rank 2 pid 2 state S" in out[2]


def test_computing_ranks_are_not_stalled(monkeypatch):
    out = watch_over(monkeypatch, [ranks("R", 1.0, 0.0), ranks("R", 3.0, 0.0), ranks("R", 5.0, 0.0)])
    assert out == [None, None, None]


def test_ranks_waiting_for_a_cpu_are_not_stalled_and_it_is_logged_once(monkeypatch, caplog):
    """All ranks runnable, hardly any CPU time, seconds on the run queue: the host's other processes
    hold the cores (a 4-stage server beside two processes of GIL-bound threads did exactly this)."""
    starved = [ranks("R", 1.0 + 0.01 * i, 10.0 + 3.0 * i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="spd.serve"):
        out = watch_over(monkeypatch, starved)
    assert out == [None] * 4
    told = [r.getMessage() for r in caplog.records if "waiting for a CPU" in r.getMessage()]
    assert len(told) == 1 and "on the run queue" in told[0], told


def test_the_wait_for_a_cpu_is_judged_over_the_window_not_since_the_request_began(monkeypatch):
    """Starved early, then silent for a whole window: stalled."""
    samples = [ranks("R", 1.0, 10.0), ranks("R", 1.0, 25.0), ranks("S", 1.0, 25.0), ranks("S", 1.0, 25.0),
               ranks("S", 1.0, 25.0)]
    out = watch_over(monkeypatch, samples)
    assert out[2] is None and out[4] is not None and "no stage rank is computing" in out[4]


def test_a_stopped_rank_is_named_even_when_the_others_wait_for_a_cpu(monkeypatch):
    samples = [ranks("R", 1.0, 10.0), ranks("R", 1.0, 30.0), ranks("R", 1.0, 50.0)]
    samples[2][2] = RankSample("T", 1.0, 50.0)
    out = watch_over(monkeypatch, samples)
    assert out[2] is not None and "stage rank 2 (pid 2) is stopped" in out[2]


SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.skipif(not SCHEDSTAT, reason="needs Linux /proc with scheduler stats")
def test_real_processes_starved_of_a_core_and_sleeping(caplog):
    """Three processes on one core: two busy at nice 0, one busy at nice 10 (about 5% of the core,
    the rest runnable on the run queue) is waiting for a CPU, not stalled; a process that only
    sleeps (a rank polling a peer that never answers) is stalled."""
    cpu = min(os.sched_getaffinity(0))
    pin = f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
    procs = [spawn(pin + "\nwhile True: pass") for _ in range(2)]
    procs.append(spawn(pin + "os.nice(10)\nwhile True: pass"))
    procs.append(spawn("import time\nwhile True: time.sleep(0.001)"))
    try:
        time.sleep(0.5)  # started
        starved, sleeping = StallWatch(2.0, {1: procs[2].pid}), StallWatch(2.0, {1: procs[3].pid})
        t0 = time.monotonic()
        for w in (starved, sleeping):
            assert w.check(last_progress=t0) is None
        time.sleep(2.5)
        with caplog.at_level(logging.WARNING, logger="spd.serve"):
            verdict = starved.check(last_progress=t0)
        assert verdict is None, verdict
        assert any("waiting for a CPU" in r.getMessage() for r in caplog.records), caplog.text
        verdict = sleeping.check(last_progress=t0)
        assert verdict is not None and "no stage rank is computing" in verdict, verdict
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.multiproc
def test_serve_neighbour_streams_alone_beside_a_neighbour_and_alone_again(tmp_path):
    """`spd measure serve-neighbour` end to end on the tiny model (its figures: docs/serve.md)."""
    from spd_engine.tools.experiments.serve_neighbour import main

    out = tmp_path / "neighbour.json"
    assert main(["--neighbour", "busy", "--processes", "1", "--duration", "2", "--repeats", "1", "--max-tokens", "8",
                 "--json-out", str(out), "--", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1",
                 "--capacity", "256"]) == 0
    phases = json.loads(out.read_text())["phases"]
    assert [p["phase"] for p in phases] == ["alone (before)", "beside 1 x busy", "alone (after)"]
    for p in phases:
        assert p["streams"] >= 1 and p["failed"] == [] and p["largest_gap_max_s"] > 0, p
        assert p["cpu_per_s"] > 0 and p["run_queue_per_s"] >= 0, p


def test_serve_neighbour_refuses_bad_arguments():
    from spd_engine.tools.experiments.serve_neighbour import main

    with pytest.raises(ValueError, match="--processes"):
        main(["--processes", "0", "--", "--model", "random:tiny-llama"])
    with pytest.raises(ValueError, match="name the model"):
        main(["--", "--stages", "2"])
