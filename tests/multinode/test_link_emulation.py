"""An emulated link between two namespace nodes (docs/cluster.md, "Emulating a slower link"):
bandwidth from tc's token bucket on each node's end (Nodes.shape), latency from the engine's own
per-message delay (--link-delay-us, engine/comm/transport.py DelayedTransport). `spd netbench`
with one rank per node shows the link asked for: its raw point-to-point rows move a large message
at the shaped rate, and the runtime's transport takes the asked delay longer one way than over
the same link without it."""
from __future__ import annotations

import pytest
from test_two_nodes import _netbench, nodes  # noqa: F401  (nodes: the fixture)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DELAY_US = 500.0
RATE_MBIT = 100


def _one_way_us(report: dict) -> float:
    """The gloo transport's 4-byte one-way p50 across the link (the shm rows share this host's memory)."""
    (row,) = [r for r in report["transport"] if r["transport"] == "gloo" and r["bytes"] == 4]
    return row["p50_us"]


def test_netbench_shows_the_emulated_link(nodes, tmp_path):  # noqa: F811
    for node in (0, 1):
        nodes.shape(node, f"{RATE_MBIT}mbit")
    for run in ("base", "delayed"):
        (tmp_path / run).mkdir()
    args = ["--tests", "p2p,transport", "--sizes", "4,1M", "--iters", "30", "--warmup", "3"]
    base = _netbench(nodes, tmp_path / "base", args)
    slow = _netbench(nodes, tmp_path / "delayed", [*args, "--link-delay-us", str(DELAY_US)])
    assert slow["link_delay_us"] == DELAY_US and base["link_delay_us"] == 0.0  # the report names it
    (big,) = [r for r in slow["p2p"] if r["bytes"] == 1 << 20]  # raw sends: tbf's rate, no added latency
    assert 0.7 * RATE_MBIT <= big["bw_GBps"] * 8e3 <= 1.07 * RATE_MBIT, big
    added = _one_way_us(slow) - _one_way_us(base)
    # the asked delay on top of the link's own time; the upper margin is a busy host's scheduling
    assert 0.9 * DELAY_US <= added <= DELAY_US + 1500, (added, _one_way_us(base), _one_way_us(slow))
