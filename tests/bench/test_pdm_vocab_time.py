"""The PDM draft-vocabulary timing script runs on a tiny preset and reports both heads."""
from __future__ import annotations

import json

from bench.pdm_vocab_time import main, time_heads


def test_times_both_heads(tmp_path, capsys):
    t = time_heads("tiny-llama", (3, 3), 1, tuple(range(0, 96, 4)), pos=8, iters=3, warmup=1)
    assert set(t) == {"draft_vocab", "full"} and all(v > 0 for v in t.values())
    dv = tmp_path / "dv.json"
    dv.write_text(json.dumps({"ids": list(range(0, 96, 4))}))
    assert main(["--draft-vocab", str(dv), "--preset", "tiny-llama", "--stage-layers", "3,3", "--pdm-layers", "1"]) == 0
    assert "K=1: draft vocabulary (24 ids)" in capsys.readouterr().out
