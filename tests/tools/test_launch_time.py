"""`spd measure launch-time` (tools/experiments/launch_time.py): local ranks spawned and forked from
the forkserver give the same tokens, timed; bad arguments are refused before any rank starts."""
from __future__ import annotations

import pytest

from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime
from spd_engine.tools.experiments import launch_time


@pytest.mark.multiproc
def test_spawned_and_forked_ranks_give_the_same_tokens_and_a_table(capsys):
    assert launch_time.main(["--stages", "2", "--colocate", "--repeats", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("random:tiny-llama, n=2 co-located, 1 repeats")
    assert [row.split(" | ")[0] for row in table[3:]] == ["| spawn", "| forkserver"]
    assert all(float(cell) > 0 for row in table[3:] for cell in row.strip(" |").split(" | ")[1:])


@pytest.mark.parametrize("argv,message", [(["--model", "smollm2-135m"], "a random:<preset> model"),
                                          (["--repeats", "0"], "must be >= 1")])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        launch_time.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_an_unknown_start_method_is_a_value_error_before_any_rank():
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 2)), runtime=Runtime(capacity=64))
    with pytest.raises(ValueError, match="start_method: forkserver or spawn, got 'fork'"):
        with launch(ecfg, start_method="fork"):
            pass
