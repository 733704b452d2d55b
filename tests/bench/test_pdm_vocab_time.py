"""The PDM draft-vocabulary timing script runs on a tiny preset and reports both heads."""
from __future__ import annotations

import json

from spd_engine.tools.experiments.pdm_vocab_time import main, time_heads


def test_times_both_heads(tmp_path, capsys):
    t = time_heads("tiny-llama", (3, 3), 1, tuple(range(0, 96, 4)), pos=8, iters=3, warmup=1)
    assert set(t) == {"draft_vocab", "full"} and all(v > 0 for v in t.values())
    dv = tmp_path / "dv.json"
    dv.write_text(json.dumps({"ids": list(range(0, 96, 4))}))
    assert main(["--draft-vocab", str(dv), "--preset", "tiny-llama", "--stage-layers", "3,3", "--pdm-layers", "1"]) == 0
    assert "K=1: draft vocabulary (24 ids)" in capsys.readouterr().out


def test_times_each_precision(tmp_path, capsys):
    t = time_heads("tiny-llama", (3, 3), 1, tuple(range(0, 96, 4)), pos=8, iters=3, warmup=1, precisions=True)
    assert set(t) == {"float32", "bfloat16", "int8"} and all(v > 0 for v in t.values())
    dv = tmp_path / "dv.json"
    dv.write_text(json.dumps({"ids": list(range(0, 96, 4))}))
    assert main(["--draft-vocab", str(dv), "--preset", "tiny-llama", "--stage-layers", "3,3", "--pdm-layers", "1",
                 "--precisions"]) == 0
    out = capsys.readouterr().out
    assert "K=1, 24 draft ids, 3 rows: float32" in out and "int8" in out


def test_missing_or_corrupt_draft_vocab_is_a_clear_error(tmp_path, capsys):
    import pytest

    for path in (tmp_path / "missing.json", tmp_path / "bad.json"):
        if path.name == "bad.json":
            path.write_text("{not json")
        with pytest.raises(SystemExit) as exc:
            main(["--draft-vocab", str(path), "--preset", "tiny-llama", "--stage-layers", "3,3"])
        assert exc.value.code == 2 and f"--draft-vocab {path}" in capsys.readouterr().err
