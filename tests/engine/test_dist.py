"""The launch and process-group layer (engine/comm/dist.py): results and errors of local ranks, the
launcher's summary, a hung rank, and a dead rank ending a bounded wait on its peer (gloo)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from spd_engine.engine.comm.dist import (
    LocalRanks,
    PeerError,
    finish_group,
    gpu_for_rank,
    join_group,
    report_failure,
    resolve_backend,
)

pytestmark = pytest.mark.multiproc  # most tests start ranks as processes


def _answer(rank: int, value: int):
    return {"rank": rank, "value": value} if rank == 0 else None


def _mixed(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("receive from rank 0 failed\nsecond line")
    if rank == 2:
        os._exit(3)
    if rank == 3:
        raise KeyError("a bug")


def _environment_and_stdio(rank: int, name: str) -> dict:
    print(f"rank {rank} on stdout", flush=True)
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
    return {"value": os.environ.get(name)}


def _nap(rank: int) -> None:
    time.sleep(1.0)


def _sleeper(rank: int) -> None:
    time.sleep(60)


def _dead_peer(rank: int, init_method: str) -> dict | None:
    """Rank 1 leaves right after joining; rank 0's bounded barrier must fail by itself, fast."""
    ctx = join_group(rank, 2, "gloo", "cpu", init_method, timeout_s=3.0)
    if rank == 1:
        os._exit(5)
    t0 = time.monotonic()
    try:
        ctx.barrier("barrier with a dead peer")
    except PeerError as err:
        return {"error": str(err), "waited_s": time.monotonic() - t0}
    return {"error": None}


def _together(rank: int, init_method: str) -> dict:
    ctx = join_group(rank, 2, "gloo", "cpu", init_method, timeout_s=30.0)
    ctx.barrier()
    finish_group(ctx)
    return {"rank": ctx.rank, "world": ctx.world_size, "device": str(ctx.device)} if rank == 0 else None


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_get_the_launchers_environment_and_streams_as_they_are_at_each_launch(method, monkeypatch, capfd):
    """Forked ranks come from one forkserver per launching process, started by the first launch: a
    later launch's ranks still see the environment and stdout/stderr the launcher has then (and
    spawned ones, which inherit both, keep them)."""
    name = "SPD_TEST_LAUNCH_VALUE"
    for value in ("first", "second"):  # the server exists from the first launch on
        monkeypatch.setenv(name, value)
        with LocalRanks(_environment_and_stdio, range(1), (name,), method) as ranks:
            ranks.join(60.0)
            assert not ranks.failed(), ranks.failure_report()
            assert ranks.result(0) == {"value": value}
        out, err = capfd.readouterr()
        assert "rank 0 on stdout" in out and "rank 0 on stderr" in err
    monkeypatch.delenv(name)
    with LocalRanks(_environment_and_stdio, range(1), (name,), method) as ranks:
        ranks.join(60.0)
        assert ranks.result(0)["value"] is None  # unset since: gone in the rank too


def test_the_forkserver_outlives_a_group_sigterm_so_rank_statuses_stay_known():
    """A group SIGTERM (a draining launcher's) reaches the forkserver too: it ignores it, or every
    forked rank would read as dead (multiprocessing gets their statuses from it). Imported anywhere
    else, its set-up module changes nothing."""
    from multiprocessing import forkserver

    import spd_engine.engine.comm.forkserver_setup  # noqa: F401

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with LocalRanks(_nap, range(1)) as ranks:
        server = forkserver._forkserver._forkserver_pid
        os.kill(server, signal.SIGTERM)
        ranks.join(30.0)
        assert ranks.exitcodes() == {0: 0}
    os.kill(server, 0)  # still running


def test_rank_zero_result_comes_back():
    with LocalRanks(_answer, range(2), (7,)) as ranks:
        ranks.join(60)
        assert not ranks.failed(), ranks.failure_report()
        assert ranks.result(0) == {"rank": 0, "value": 7} and ranks.result(1) is None


def test_every_rank_status_and_first_error_line_are_reported(capfd):
    with LocalRanks(_mixed, range(4)) as ranks:
        ranks.join(60)
        report = ranks.failure_report()
    assert ranks.failed()
    assert report.startswith("run failed on 3 of 4 ranks:")
    assert "rank 0: exit code 0\n" in report
    assert "rank 1: exit code 1: receive from rank 0 failed\n" in report  # first line only
    assert "rank 2: exit code 3" in report
    assert "rank 3: exit code 1: 'a bug'" in report
    err = capfd.readouterr().err
    assert "spd: rank 1 failed: receive from rank 0 failed" in err
    assert "Traceback" in err and "KeyError" in err  # a bug (not a peer or user error) keeps its traceback


def test_a_hung_rank_is_terminated_and_named():
    with LocalRanks(_sleeper, range(1)) as ranks:
        ranks.join(1.0)
        assert ranks.hung == [0] and "rank 0: hung, terminated" in ranks.failure_report()


def test_join_and_finish_together():
    from spd_engine.engine.comm.dist import local_init_method

    with LocalRanks(_together, range(2), (local_init_method(),)) as ranks:
        ranks.join(120)
        assert not ranks.failed(), ranks.failure_report()
        assert ranks.result(0) == {"rank": 0, "world": 2, "device": "cpu"}


def test_a_dead_peer_ends_a_bounded_wait():
    from spd_engine.engine.comm.dist import local_init_method

    with LocalRanks(_dead_peer, range(2), (local_init_method(),)) as ranks:
        ranks.join(120)
        codes, got = ranks.exitcodes(), ranks.result(0)
    assert codes == {0: 0, 1: 5}
    assert got["error"] is not None and got["error"].startswith("barrier with a dead peer")
    assert got["waited_s"] < 3.0 + 5.0


def test_report_failure_names_the_rank(tmp_path, capsys):
    report_failure(3, RuntimeError("peer gone"), str(tmp_path))
    assert capsys.readouterr().err.strip() == "spd: rank 3 failed: peer gone"
    assert (tmp_path / "rank3.err").read_text() == "peer gone"


def test_device_and_backend_choice():
    assert gpu_for_rank(2, None, 4, 3) == 2 and gpu_for_rank(5, 1, 2, 6) == 1
    with pytest.raises(ValueError, match="rank 2 needs GPU 2, this node has 1"):
        gpu_for_rank(2, None, 1, 3)
    assert resolve_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("mpi")
