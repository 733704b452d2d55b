"""The reachability check before the mesh (engine/comm/mesh_check.py) on one in-process store:
a peer's address that refuses connections, a rank that never reports, and a clean pass; the one
line each failure gives."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch.distributed as dist

from spd_engine.engine.comm.iface import IfaceChoice
from spd_engine.engine.comm.mesh_check import Advert, JoinError, check_mesh

ME = IfaceChoice("lo", "127.0.0.1", "the route to 127.0.0.2")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_that_refuses_fails_the_check_naming_both_ends_and_the_fix():
    store = dist.HashStore()
    port = closed_port()
    store.set("advert/1", json.dumps(Advert(1, "127.0.0.1", port, "eth9", "GLOO_SOCKET_IFNAME as set").__dict__))
    store.set("result/1", "")  # rank 1 reached everyone: only rank 0's own probe fails
    with pytest.raises(JoinError) as info:
        check_mesh(store, 0, 2, ME, time.monotonic() + 10)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("could not join the process group: rank 0 advertising 127.0.0.1 (interface lo, the "
                           "route to 127.0.0.2) cannot reach rank 1 at 127.0.0.1:")
    assert f":{port} (interface eth9, GLOO_SOCKET_IFNAME as set): Connection refused; pass --iface NAME" in line


def test_a_rank_that_reached_everyone_reports_the_other_ranks_failure():
    store = dist.HashStore()
    with socket.create_server(("127.0.0.1", 0)) as rank0:  # rank 0 listens: rank 1 reaches it
        store.set("advert/0", json.dumps(Advert(0, "127.0.0.1", rank0.getsockname()[1], "lo", "x").__dict__))
        store.set("result/0", "rank 0 advertising A cannot reach rank 1 at B: Connection refused")
        with pytest.raises(JoinError, match=r"^could not join the process group: rank 0 advertising A cannot reach "
                                            r"rank 1 at B: Connection refused; this rank advertises 127\.0\.0\.1 "
                                            r"\(interface lo, the route to 127\.0\.0\.2\); pass --iface"):
            check_mesh(store, 1, 2, ME, time.monotonic() + 10)
    assert store.get("result/1") == b""  # rank 1's own probe passed


def test_a_rank_that_never_reports_ends_the_check_at_the_deadline():
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(JoinError, match=r"waiting for every rank's address: rank\(s\) 1, 2 did not report within "
                                        r"the join deadline"):
        check_mesh(store, 0, 3, ME, time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 5


def test_ranks_that_reach_each_other_pass():
    store = dist.HashStore()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            check_mesh(store, r, 3, ME, time.monotonic() + 20)
        except JoinError as err:
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert [store.get(f"result/{r}") for r in range(3)] == [b""] * 3


WATCHED = """
import datetime, time
import torch.distributed as dist
from spd_engine.engine.comm.dist import _JoinWatch
from spd_engine.engine.comm.iface import IfaceChoice
watch = _JoinWatch(3, 1.0, IfaceChoice("lo", "127.0.0.1", "the route to 127.0.0.1"))
watch.stage = "connecting the gloo mesh"
t0 = time.monotonic()
try:  # blocks inside the backend (nothing listens on port 1) far past the watch's second
    dist.TCPStore("127.0.0.1", 1, 2, False, timeout=datetime.timedelta(seconds=30))
except RuntimeError:
    pass
print("not ended by the watch", time.monotonic() - t0)
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_join_watch_ends_a_rank_stuck_inside_the_backend(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WATCHED], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("spd: ")]
    assert lines == ["spd: rank 3 failed: could not join the process group within 1s while connecting the gloo "
                     "mesh; this rank advertises 127.0.0.1 (interface lo, the route to 127.0.0.1); pass --iface NAME "
                     "(or set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME) naming the interface on the network the nodes "
                     "share"], proc.stderr
