"""tests/multinode/two_node_links.py, the two-node comparison at emulated links, end to end on the
tiny random model: every row (ar on one node; pp, tp, SPD co-located and with a driver across two
namespace nodes) at the slowest link setting gives ar's tokens, and the report holds every row."""
from __future__ import annotations

import json

import pytest
import two_node_links
from nodes import namespaces_unusable

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_every_row_across_an_emulated_link_is_lossless(tmp_path, capsys):
    why = namespaces_unusable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    out = tmp_path / "links.json"
    assert two_node_links.main(["--model", "random:tiny-llama", "--tp", "2", "--links", "2", "--repeats", "1",
                                "--max-new-tokens", "8", "--prompt", "hello there", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["ar", "pp", "tp", "spd-colocate", "spd"]
    assert all(r["lossless"] and len(r["token_ids"]) == 8 and r["delay_us"] == 200.0 for r in rows)
    assert next(r for r in rows if r["config"] == "tp")["tp_collective_ms_per_token"] > 0.2  # 200 us per step, counted
    table = capsys.readouterr().out
    assert table.count("| 100 Mbit/s + 200 us |") == 5
