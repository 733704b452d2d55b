"""The training-step timing script runs on a tiny preset for every requested configuration."""
from __future__ import annotations

import pytest

from spd_engine.tools.experiments.train_step_time import main, time_steps


def test_times_every_configuration(capsys):
    t = time_steps("tiny-llama", 2, [1, 2], [1, 2], ["float32", "bfloat16"], 2, 8, iters=1)
    assert len(t) == 8 and all(v > 0 for v in t.values())
    assert main(["--preset", "tiny-llama", "--stages", "2", "--fills", "2", "--pdm-layers", "1",
                 "--autocast", "float32", "--batch", "1", "--seq-len", "8", "--iters", "1", "--threads", "1"]) == 0
    assert "K=1 fill=2 autocast=float32" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--preset", "tiny-llama", "--stages", "2", "--fills", "3"])
