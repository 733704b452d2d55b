"""Two nodes as network namespaces (tests/multinode/nodes.py), each its own network stack, with
no interface hint in the environment: ranks join across the link on the interface that routes to
the master, `spd generate` under torchrun on both nodes is lossless, a node that dies ends the
other's ranks, and a join that cannot connect ends every rank with one line (docs/cluster.md)."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from nodes import IFNAME, Lines, Nodes, namespaces_unusable

from spd_engine.engine.comm.iface import GLOO_ENV, IFACE_ENV, NCCL_ENV
from spd_engine.engine.runtime.launch import spd_script

PORT = "29500"  # each namespace has its own ports: no clash with anything else on the host
TINY = ["--model", "random:tiny-llama", "--threads", "1", "--timeout", "20"]
SPD4 = ["--stages", "4", "--colocate"]  # four ranks, two per node
SPD2_TP2 = ["--stages", "2", "--tp", "2", "--colocate"]  # stage s on ranks 2s, 2s+1: node s

pytestmark = pytest.mark.multiproc


@pytest.fixture
def nodes():
    why = namespaces_unusable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    made = Nodes(2)
    yield made
    made.close()


def bare_env(**extra: str) -> dict[str, str]:
    """This environment without any interface hint, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in (GLOO_ENV, NCCL_ENV, IFACE_ENV)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def torchrun(nodes: Nodes, node: int, args: list[str], cwd: Path, nproc: int = 2, **env: str):
    """`torchrun --nnodes 2 --nproc-per-node NPROC ... spd ARGS` on `node`, master on node 0, run
    from `cwd` (not the repository root, which must not head sys.path)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
           "--node-rank", str(node), "--master-addr", nodes.addrs[0], "--master-port", PORT, spd_script(), *args]
    return nodes.popen(node, cmd, env=bare_env(**env), cwd=cwd)


JOIN = """
import os, sys, torch, torch.distributed as dist
from spd_engine.engine.comm.dist import join_group
join_group(int(sys.argv[1]), 2, "gloo", "cpu", "env://", 30.0)
t = torch.ones(1)
dist.all_reduce(t)
print(os.environ["GLOO_SOCKET_IFNAME"], t.item(), flush=True)
dist.destroy_process_group()
"""


def test_ranks_join_across_nodes_on_the_interface_routing_to_the_master(nodes, tmp_path):
    """gloo left to itself advertises the host name's address, 127.0.0.1 here: unreachable from the
    other node. join_group binds to the veth (the route to the master) and the all-reduce crosses."""
    env = bare_env(MASTER_ADDR=nodes.addrs[0], MASTER_PORT=PORT)
    procs = [nodes.popen(r, [sys.executable, "-c", JOIN, str(r)], env=env, cwd=tmp_path) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.split() == [IFNAME, "2.0"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [SPD4, SPD2_TP2], ids=["spd4", "spd2-tp2"])
def test_spd_across_two_nodes_gives_ar_tokens(nodes, capsys, tmp_path, layout):
    """SPD n=4 co-located (stages 0-1 on node 0, 2-3 on node 1), and SPD n=2 x TP 2 (each stage's
    TP group inside a node, the pipeline's hop across the link)."""
    from spd_engine.tools.cli import main

    args = [*TINY, "--prompt", "hello there", "--max-new-tokens", "24", "--ignore-eos"]
    assert main(["generate", *args, "--mode", "ar", "--stages", "1"]) == 0
    want = capsys.readouterr().out.strip()
    assert re.fullmatch(r"\[\d+(, \d+){23}\]", want), want
    procs = [torchrun(nodes, node, ["generate", *args, *layout], tmp_path) for node in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert outs[0][0].strip() == want  # rank 0, on node 0, prints the tokens
    assert outs[1][0].strip() == ""
    assert nodes.gone(0, 5.0) == [] and nodes.gone(1, 5.0) == []


def _mid_run(nodes: Nodes, cwd: Path) -> tuple[list, list[Lines]]:
    """SPD n=4 over both nodes, three prompts of 400 tokens; returns once the second is generating."""
    args = ["generate", *TINY, *SPD4, "--max-new-tokens", "400", "--ignore-eos", "--capacity", "512",
            "--prompt", "one", "--prompt", "two", "--prompt", "three"]
    procs = [torchrun(nodes, node, args, cwd) for node in (0, 1)]
    errs = [Lines(p.stderr) for p in procs]
    assert errs[0].wait_for(r"^\[2/3\]", 240), errs[0].text(1.0)[-3000:]
    assert all(p.poll() is None for p in procs), "the run ended before the fault: make it longer"
    return procs, errs


def _ended_within(procs: list, start: float, limit_s: float) -> list[float]:
    """Each process's seconds from `start` to its exit (it must exit within `limit_s` + 30)."""
    ends = []
    for p in procs:
        p.wait(timeout=max(1.0, start + limit_s + 30 - time.monotonic()))
        ends.append(time.monotonic() - start)
    return ends


@pytest.mark.slow
def test_a_killed_node_ends_the_other_within_a_minute(nodes, tmp_path):
    procs, errs = _mid_run(nodes, tmp_path)
    nodes.kill_node(1)
    (survived_s,) = _ended_within(procs[:1], time.monotonic(), 60)
    assert procs[0].returncode != 0
    assert survived_s < 60, f"node 0 ran on {survived_s:.0f}s after node 1 died"
    # a survivor names a peer on the dead node: (rank, peer, tick) of the transport's error
    assert re.search(r"\(rank=[01], peer=[23], tick=-?\d+\)", errs[0].text()), errs[0].text()[-3000:]
    assert nodes.gone(0, 5.0) == [] and nodes.gone(1, 5.0) == []


@pytest.mark.slow
def test_a_cut_link_ends_every_rank_on_both_nodes(nodes, tmp_path):
    """`ip link set down` on node 1's end: no connection closes, so every rank's wait ends by its
    timeout (--timeout 20) and every rank on both nodes exits non-zero within a minute."""
    procs, errs = _mid_run(nodes, tmp_path)
    nodes.link(1, up=False)
    ends = _ended_within(procs, time.monotonic(), 60)
    assert [p.returncode != 0 for p in procs] == [True, True], [p.returncode for p in procs]
    assert max(ends) < 60, f"nodes ended {ends} s after the cut"
    # each node ends by its ranks' own errors naming (rank, peer, tick); which rank fails first, and
    # on which peer (across the link, or a neighbour that failed first), is a race. Nothing closes
    # a connection at the cut, so the first failure is a receive timing out.
    texts = [err.text() for err in errs]
    for text in texts:
        assert re.search(r"\(rank=\d, peer=\d, tick=-?\d+\)", text), text[-3000:]
    assert any(re.search(r"timed out after 20.0s", text) for text in texts), texts[0][-3000:]
    assert nodes.gone(0, 5.0) == [] and nodes.gone(1, 5.0) == []


@pytest.mark.slow
def test_a_join_that_cannot_connect_ends_every_rank_with_one_line(nodes, tmp_path):
    """Node 1 is told to bind to loopback: its ranks advertise 127.0.0.1, which node 0 cannot
    reach. Every rank on both nodes leaves within the join deadline, each with one line."""
    args = ["generate", *TINY, *SPD4, "--prompt", "hi", "--max-new-tokens", "4"]
    start = time.monotonic()
    procs = [torchrun(nodes, 0, args, tmp_path), torchrun(nodes, 1, args, tmp_path, GLOO_SOCKET_IFNAME="lo")]
    outs = [p.communicate(timeout=150) for p in procs]
    elapsed = time.monotonic() - start
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert elapsed < 60 + 30, f"{elapsed:.0f}s: past the join deadline (60 s) and start-up"
    err = "\n".join(e for _, e in outs)
    for rank in range(4):
        lines = [ln for ln in err.splitlines() if ln.startswith(f"spd: rank {rank} failed: ")]
        assert len(lines) == 1, (rank, err[-4000:])
        line = lines[0]
        assert "could not join the process group" in line and "cannot reach rank" in line, line
        assert "127.0.0.1" in line and "interface lo" in line and "--iface" in line, line
    for rank in (0, 1):  # node 0's ranks name what they advertise themselves
        assert f"rank {rank} advertising {nodes.addrs[0]} (interface {IFNAME}" in err
    assert "connectFullMesh" not in err  # the backend's own failure never happens
    assert nodes.gone(0, 5.0) == [] and nodes.gone(1, 5.0) == []


def test_an_unknown_iface_is_a_one_line_error(capsys):
    from spd_engine.tools.cli import main

    assert main(["generate", *TINY, "--stages", "2", "--prompt", "hi", "--iface", "nosuch0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--iface nosuch0: no such network interface" in err[0], err


# ---- `spd serve` under torchrun across the two nodes: rank 0 (node 0) serves HTTP ----

HTTP = "8000"
PROMPT = [11, 42, 7, 90, 3, 50, 18, 64]
CLIENT = """
import json, sys, httpx
url, max_tokens, stream = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "stream"
body = {"model": "random:tiny-llama", "prompt": json.loads(sys.argv[4]), "max_tokens": max_tokens,
        "temperature": 0, "stream": stream}
if not stream:
    print(httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"], flush=True)
else:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                print(line, flush=True)
"""


def _server(nodes: Nodes, cwd: Path) -> tuple[list, Lines, str]:
    """SPD n=4 behind `spd serve` on both nodes; returns once rank 0 listens (procs, its stderr, url)."""
    args = ["serve", *TINY, *SPD4, "--capacity", "512", "--host", nodes.addrs[0], "--port", HTTP]
    procs = [torchrun(nodes, node, args, cwd) for node in (0, 1)]
    err0 = Lines(procs[0].stderr)
    assert err0.wait_for(r"spd serve: ready on http://", 240), err0.text(1.0)[-3000:]
    return procs, err0, f"http://{nodes.addrs[0]}:{HTTP}"


def _client(nodes: Nodes, node: int, url: str, max_tokens: int, stream: bool, cwd: Path):
    """A client on `node` (node 1: across the link from the server)."""
    import json

    cmd = [sys.executable, "-c", CLIENT, url, str(max_tokens), "stream" if stream else "whole", json.dumps(PROMPT)]
    return nodes.popen(node, cmd, env=bare_env(), cwd=cwd)


@pytest.mark.slow
def test_serve_across_two_nodes_answers_greedy_then_a_killed_node_fails_the_stream(nodes, tmp_path):
    from helpers import reference

    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime

    cfg = PRESETS["tiny-llama"]
    want = reference(RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                               parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 4), threads=1),
                               runtime=Runtime(capacity=512)), PROMPT, 16, eos=cfg.eos_token_ids)
    procs, err0, url = _server(nodes, tmp_path)
    answer = _client(nodes, 1, url, 16, False, tmp_path)
    out, err = answer.communicate(timeout=120)
    assert answer.returncode == 0, err[-2000:]
    assert [int(x) for x in out.split()] == want

    streaming = _client(nodes, 0, url, 480, True, tmp_path)  # beside the server: it outlives node 1
    events = Lines(streaming.stdout)
    assert events.wait_for(r"^data: ", 120) and streaming.poll() is None, events.text(1.0)
    time.sleep(0.5)  # a few tokens in
    for pid in nodes.pids(1):  # node 1 dies: its torchrun and ranks
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    (ended_s,) = _ended_within(procs[:1], killed, 60)
    assert procs[0].returncode != 0 and ended_s < 60, (procs[0].returncode, ended_s)
    streaming.wait(timeout=30)
    stream = events.text()
    # an error event naming a rank on the dead node, not a silent end
    assert re.search(r'^data: \{"error".*lost stage rank [23]: .*"code":"rank_failed"', stream, re.M), stream[-3000:]
    assert re.search(r"\(rank=[01], peer=[23], tick=-?\d+\)|rank [23]", err0.text()), err0.text()[-3000:]
    assert nodes.gone(0, 5.0) == [] and nodes.gone(1, 5.0) == []


def _netbench(nodes: Nodes, tmp_path: Path, args: list[str]) -> dict:
    """`spd netbench ARGS` with one rank per node; rank 0's report."""
    import json

    args = ["netbench", "--backend", "gloo", "--timeout", "20", "--no-png", *args]
    procs = [torchrun(nodes, node, [*args, "--out-dir", str(tmp_path / f"node{node}")], tmp_path, nproc=1)
             for node in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    return json.loads((tmp_path / "node0" / "netbench.json").read_text())  # rank 0 writes


@pytest.mark.slow
def test_netbench_across_two_nodes(nodes, tmp_path):
    """`spd netbench` with one rank per node: its point-to-point rows are the link's."""
    report = _netbench(nodes, tmp_path, ["--sizes", "4,64K", "--iters", "20", "--warmup", "2",
                                         "--allreduce-bytes", "4", "--hidden", "64", "--fanin-rows", "1"])
    assert sorted(r["node_rank"] for r in report["ranks"]) == [0, 1]
    rows = report["p2p"]
    assert [(r["src"], r["dst"], r["bytes"]) for r in rows] == [(0, 1, 4), (0, 1, 65536)]
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in rows)


@pytest.mark.slow
def test_netbench_measures_a_shaped_link_at_its_rate(nodes, tmp_path):
    """Both ends limited to 100 Mbit/s (tc tbf): a 1 MiB message's one-way time is the link's
    serialisation time, so netbench's bandwidth is the rate asked for (within 30%, never above
    it by more than the token bucket's burst)."""
    for node in (0, 1):
        nodes.shape(node, "100mbit")
    report = _netbench(nodes, tmp_path, ["--tests", "p2p", "--sizes", "1M", "--iters", "10", "--warmup", "2"])
    (row,) = report["p2p"]
    gbits = row["bw_GBps"] * 8
    assert 0.07 <= gbits <= 0.107, row
