"""The server's stall watch (server/stall.py): a silent pipeline fails, a stopped rank is named,
and ranks that compute or wait for a CPU are not stalled. Unit cases over given /proc samples,
then the rule over real processes: one starved of its core by others, and processes polling a
peer that never answers (a deadlock); and `spd measure serve-neighbour`, which measures a real
server beside such neighbours."""
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


def watch_over(monkeypatch, samples: list[dict[int, RankSample]], stall_s: float = 10.0,
               watch: StallWatch | None = None) -> list[str | None]:
    """check() at t = 0, 5, 10, ... with the given samples of ranks {rank: pid = rank}, the last
    token at t = 0: what each call returned."""
    current: dict[int, RankSample] = {}
    monkeypatch.setattr(stall, "sample", lambda pid: current[pid])
    watch = watch or StallWatch(stall_s, {r: r for r in samples[0]})
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


def test_ranks_polling_a_peer_that_never_answers_are_stalled_however_many(monkeypatch):
    """Six ranks each polling at 0.03 CPU s/s and 0.1 run-queue s/s: together 0.18 and 0.6, which a
    sum over ranks would have taken for a computing or a starved rank."""
    out = watch_over(monkeypatch, [ranks("S", 1.0 + 0.15 * i, 2.0 + 0.5 * i, n=6) for i in range(3)])
    assert out[2] is not None and "no stage rank is computing" in out[2]


def test_computing_ranks_are_not_stalled(monkeypatch):
    out = watch_over(monkeypatch, [ranks("R", 1.0, 0.0), ranks("R", 3.0, 0.0), ranks("R", 5.0, 0.0)])
    assert out == [None, None, None]


def test_ranks_waiting_for_a_cpu_are_not_stalled_and_it_is_logged_once_per_job(monkeypatch, caplog):
    """All ranks runnable, hardly any CPU time, seconds on the run queue: the host's other processes
    hold the cores (a 4-stage server beside two processes of GIL-bound threads did exactly this)."""
    starved = [ranks("R", 1.0 + 0.01 * i, 10.0 + 3.0 * i) for i in range(4)]
    counted = []
    watch = StallWatch(10.0, {1: 1, 2: 2, 3: 3}, on_cpu_wait=lambda: counted.append(1))
    with caplog.at_level(logging.WARNING, logger="spd.serve"):
        assert watch_over(monkeypatch, starved, watch=watch) == [None] * 4
        told = [r.getMessage() for r in caplog.records if "waiting for a CPU" in r.getMessage()]
        assert len(told) == 1 and "on the run queue" in told[0], told
        watch.reset(now=0.0)  # the next job (on the same clock as the checks)
        assert watch_over(monkeypatch, starved, watch=watch) == [None] * 4
    assert sum("waiting for a CPU" in r.getMessage() for r in caplog.records) == 2 and len(counted) == 2


def test_a_rank_found_runnable_in_most_samples_is_waiting_for_a_cpu(monkeypatch, caplog):
    """A thread's run-queue wait is counted only when it next runs: a rank kept off every CPU for the
    whole window shows none, but the samples find it runnable (state R)."""
    samples = [ranks("S", 1.0, 2.0)] + [ranks("R", 1.0, 2.0) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="spd.serve"):
        assert watch_over(monkeypatch, samples, stall_s=20.0) == [None] * 5
    assert "runnable in 80% of the samples" in caplog.text, caplog.text
    mostly_asleep = [ranks("S", 1.0, 2.0)] * 3 + [ranks("R", 1.0, 2.0)] + [ranks("S", 1.0, 2.0)]
    assert watch_over(monkeypatch, mostly_asleep, stall_s=20.0)[4] is not None
    few = [ranks("R", 1.0, 2.0)] * 3  # under MIN_SAMPLES samples a window: the state does not count yet
    assert watch_over(monkeypatch, few)[2] is not None


def test_the_wait_for_a_cpu_is_judged_over_the_window_not_since_the_job_began(monkeypatch):
    """Starved early, then silent for a whole window: stalled."""
    samples = [ranks("R", 1.0, 10.0), ranks("R", 1.0, 25.0), ranks("S", 1.0, 25.0), ranks("S", 1.0, 25.0),
               ranks("S", 1.0, 25.0)]
    out = watch_over(monkeypatch, samples)
    assert out[2] is None and out[3] is not None and out[4] is not None and "no stage rank is computing" in out[4]


def test_a_stopped_rank_is_named_even_when_the_others_wait_for_a_cpu(monkeypatch):
    samples = [ranks("R", 1.0, 10.0), ranks("R", 1.0, 30.0), ranks("R", 1.0, 50.0)]
    samples[2][2] = RankSample("T", 1.0, 50.0)
    out = watch_over(monkeypatch, samples)
    assert out[2] is not None and "stage rank 2 (pid 2) is stopped" in out[2]


def test_a_pause_of_the_watcher_restarts_its_window(monkeypatch, caplog):
    """Checks every 0.25 s, then none for 30 s (the server process stopped: SIGSTOP, a VM pause):
    silent ranks are not judged on the pause; once they stay silent a whole deadline after it, they are."""
    current = ranks("S", 1.0, 0.5)
    monkeypatch.setattr(stall, "sample", lambda pid: current[pid])
    watch = StallWatch(10.0, {r: r for r in current})
    times = [0.25 * i for i in range(9)] + [32.0 + 0.25 * i for i in range(42)]
    with caplog.at_level(logging.WARNING, logger="spd.serve"):
        out = {t: watch.check(last_progress=0.0, now=t) for t in times}
    assert all(v is None for t, v in out.items() if t < 42.0), out  # without the pause rule: stalled at 32.0
    assert out[42.0] is not None and "no stage rank is computing" in out[42.0]
    assert "did not run for 30.0 s" in caplog.text, caplog.text


def test_checks_a_fraction_of_the_deadline_apart_are_no_pause(monkeypatch):
    """The rule is no loophole: a silent pipeline checked every 0.25 s is stalled at the deadline,
    and a new job's first check after an idle spell is no pause."""
    current = ranks("S", 1.0, 0.5)
    monkeypatch.setattr(stall, "sample", lambda pid: current[pid])
    watch = StallWatch(2.0, {r: r for r in current})
    out = [watch.check(last_progress=0.0, now=0.25 * i) for i in range(10)]
    assert out[:8] == [None] * 8 and out[8] is not None
    watch.reset(now=100.0)  # the next job, 100 s later
    out = [watch.check(last_progress=100.0, now=100.0 + 0.25 * i) for i in range(10)]
    assert out[:8] == [None] * 8 and out[8] is not None


def test_a_pause_before_the_jobs_first_check_is_a_pause(monkeypatch):
    """The server stopped right after a job entered the pipeline, before the watch checked it once."""
    current = ranks("S", 1.0, 0.5)
    monkeypatch.setattr(stall, "sample", lambda pid: current[pid])
    watch = StallWatch(2.0, {r: r for r in current})
    watch.reset(now=0.0)
    assert watch.check(last_progress=0.0, now=30.0) is None
    assert watch.check(last_progress=0.0, now=30.25) is None
    late = StallWatch(2.0, {r: r for r in current})  # ... or before the watcher saw the job at all
    late.reset(now=30.0)
    out = [late.check(last_progress=0.0, now=30.0 + 0.25 * i) for i in range(9)]
    assert out[:8] == [None] * 8 and out[8] is not None  # a whole deadline after it saw the job


SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")
# every process below ends itself once the test's process is gone (its parent pid changes)
BUSY = "import os\nparent = os.getppid()\n{setup}\nwhile os.getppid() == parent:\n    pass\n"
POLL = "import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n    time.sleep(0.0002)\n"


@pytest.mark.multiproc
@pytest.mark.skipif(not SCHEDSTAT, reason="needs Linux /proc with scheduler stats")
def test_real_processes_starved_of_a_core_and_polling(caplog):
    """Three processes on one core: two busy at nice 0, one busy at nice 10 (about 5% of the core,
    the rest runnable on the run queue) is waiting for a CPU, not stalled; three processes polling
    every 0.2 ms, as ranks waiting on a peer that never answers do, are stalled."""
    cpu = min(os.sched_getaffinity(0))
    pin = f"os.sched_setaffinity(0, {{{cpu}}})"
    procs: list[subprocess.Popen] = []
    try:
        for setup in (pin, pin, pin + "\nos.nice(10)"):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY.format(setup=setup)]))
        procs += [subprocess.Popen([sys.executable, "-c", POLL]) for _ in range(3)]
        time.sleep(0.5)  # started
        starved = StallWatch(2.0, {1: procs[2].pid})
        polling = StallWatch(2.0, {i + 1: p.pid for i, p in enumerate(procs[3:])})
        t0 = time.monotonic()
        starved_verdicts, verdict = [], None
        with caplog.at_level(logging.WARNING, logger="spd.serve"):
            # checked every fraction of a second, as the server does, until the polling ones are
            # stalled (2 s; later if this loaded host kept the checks a second apart: a pause)
            while verdict is None and time.monotonic() < t0 + 10.0:
                starved_verdicts.append(starved.check(last_progress=t0))
                verdict = polling.check(last_progress=t0)
                time.sleep(0.2)
        assert all(v is None for v in starved_verdicts) and time.monotonic() > t0 + 2.0, starved_verdicts
        assert any("waiting for a CPU" in r.getMessage() for r in caplog.records), caplog.text
        assert verdict is not None and "no stage rank is computing" in verdict, verdict
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.multiproc
def test_serve_neighbour_streams_alone_beside_a_neighbour_and_alone_again(tmp_path):
    """`spd measure serve-neighbour` end to end on the tiny model (its figures: docs/results/serve-shared-host.md)."""
    from spd_engine.tools.experiments.serve_neighbour import main

    out = tmp_path / "neighbour.json"
    assert main(["--neighbour", "busy", "--processes", "1", "--duration", "2", "--repeats", "1", "--max-tokens", "8",
                 "--json-out", str(out), "--", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1",
                 "--capacity", "256"]) == 0
    phases = json.loads(out.read_text())["phases"]
    assert [p["phase"] for p in phases] == ["alone (before)", "beside 1 x busy", "alone (after)"]
    for p in phases:
        assert p["streams"] >= 1 and p["failed"] == [], p
        assert p["first_token_max_s"] > 0 and p["cpu_per_s"] > 0, p


def test_serve_neighbour_refuses_bad_arguments():
    from spd_engine.tools.experiments.serve_neighbour import main

    with pytest.raises(ValueError, match="--processes"):
        main(["--processes", "0", "--", "--model", "random:tiny-llama"])
    for serve_args in (["--stages", "2"], ["--stages", "2", "--model"]):
        with pytest.raises(ValueError, match="name the model"):
            main(["--", *serve_args])


PAUSE_S = 6.0  # the server process stopped three stall deadlines (docs/serve.md: a 30 s pause measured too)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_paused_server_does_not_fail_its_healthy_request():
    """SIGSTOP of the server process alone (what a VM pause or `docker pause` does to it) for three
    stall deadlines in the middle of a stream: the ranks did nothing wrong, so the stream ends with
    its finish_reason and [DONE], the server stays healthy and drains to exit 0."""
    import signal

    import httpx

    from spd_engine.server.process import ServerProcess

    server = ServerProcess(["--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--capacity", "512",
                            "--suffix-run", "1", "--stall-timeout", "2"])
    try:
        body = {"model": "random:tiny-llama", "prompt": [5, 6], "max_tokens": 480, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(server.proc.pid, signal.SIGSTOP)
            time.sleep(PAUSE_S)
            os.kill(server.proc.pid, signal.SIGCONT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", (first, rest[-3:], server.stderr()[-2000:])
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length", rest[-2]
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert "stalled" not in server.stderr(), server.stderr()[-2000:]
        assert server.close() == 0, server.stderr()[-2000:]
    finally:
        server.kill()
