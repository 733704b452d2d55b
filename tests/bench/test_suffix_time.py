"""tools/experiments/suffix_time.py: runs on a reference-cache directory, refuses an empty or corrupt one."""
from __future__ import annotations

import json

from spd_engine.tools.experiments.suffix_time import main


def test_times_outputs_and_refuses_bad_dirs(tmp_path, capsys):
    assert main(["--reference-cache", str(tmp_path)]) == 2  # empty
    (tmp_path / "a.json").write_text(json.dumps({"tokens": [1, 2, 3, 1, 2, 3, 1, 2]}))
    assert main(["--reference-cache", str(tmp_path)]) == 0
    assert "per committed token: median" in capsys.readouterr().out
    (tmp_path / "b.json").write_text("{not json")
    assert main(["--reference-cache", str(tmp_path)]) == 2
