"""`--stage-layers balanced` end to end: `spd bench` records each default SPD row's balanced split
for this device, a later command's engine config takes it (the co-located record for a co-located
run), a head that cannot serve it keeps the even split, and the run at that split stays lossless."""
from __future__ import annotations

import argparse
import json

import pytest

from spd_engine.engine.model.pdm import random_pdm, save_pdm
from spd_engine.engine.runtime.run_config import PRESETS
from spd_engine.tools import generate
from spd_engine.tools.cli import main
from spd_engine.tools.engine_args import engine_config
from spd_engine.tools.measured_args import split_key, split_store


def config(argv: list[str]):
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    return engine_config(p.parse_args(argv))[0]


def test_engine_config_takes_the_recorded_split(tmp_path, capsys):
    base = ["--model", "random:tiny-llama", "--stages", "2", "--colocate", "--prompt", "x"]
    even = config(base + ["--stage-layers", "balanced"])
    assert even.parallel.topology.stage_layers == (3, 3) and "no split measured" in capsys.readouterr().err
    advice = {"stage_layers": [3, 3], "busiest_ms": 2.0, "balanced_layers": [2, 4], "balanced_busiest_ms": 1.5}
    split_store().record(split_key(even), advice, head="random")
    got = config(base + ["--stage-layers", "balanced"])
    assert got.parallel.topology.stage_layers == (2, 4) and got.parallel.topology.colocate
    assert "stage layers [2, 4], the split balancing" in capsys.readouterr().err
    apart = config(["--model", "random:tiny-llama", "--stages", "2", "--prompt", "x", "--stage-layers", "balanced"])
    assert apart.parallel.topology.stage_layers == (3, 3)  # the driver on a rank of its own: another record
    # flags that change what a tick computes have records of their own
    for other in (["--pdm-dtype", "float32"], ["--head-screen", "off"], ["--suffix-run", "1"], ["--suffix-drafts", "off"]):
        assert config(base + ["--stage-layers", "balanced", *other]).parallel.topology.stage_layers == (3, 3), other
        assert split_key(config(base + other)) != split_key(even), other
    # a head whose anchors fall in other stages at [1, 5] cannot serve it
    cfg = PRESETS["tiny-llama"]
    head = save_pdm(random_pdm(cfg, (3, 3)), tmp_path / "head")
    split_store().record(split_key(even), {**advice, "balanced_layers": [1, 5]}, head=str(head))
    kept = config(base + ["--stage-layers", "balanced", "--spec", str(head)])
    assert kept.parallel.topology.stage_layers == (3, 3) and "does not suit this run's head" in capsys.readouterr().err
    assert config(base + ["--stage-layers", "balanced", "--spec", "random"]).parallel.topology.stage_layers == (1, 5)


@pytest.mark.multiproc
def test_bench_records_and_a_balanced_run_is_lossless(tmp_path, capsys):
    out = tmp_path / "bench.json"
    common = ["--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--prompt", "hello", "--max-new-tokens",
              "12", "--repeats", "1", "--configs", "ar,spd-colocate"]
    assert main(["bench", *common, "--json", str(out)]) == 0
    row = next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "spd-colocate")
    printed = capsys.readouterr().out
    assert f"spd-colocate: its balanced split {row['split']['balanced_layers']} recorded" in printed
    record = next(iter(json.loads(split_store().path.read_text())["splits"].values()))
    assert record["balanced_layers"] == row["split"]["balanced_layers"] and record["stage_layers"] == [3, 3]
    # force a split the tiny model's costs would not pick, then run at it: every row equals ar
    key = next(iter(json.loads(split_store().path.read_text())["splits"]))
    assert "co-located" in key and "tiny-llama" in key
    doc = json.loads(split_store().path.read_text())
    doc["splits"][key]["balanced_layers"] = [1, 5]
    split_store().path.write_text(json.dumps(doc))
    assert main(["bench", *common, "--stage-layers", "balanced", "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["spd-colocate"]["split"]["stage_layers"] == [1, 5] and rows["spd-colocate"]["lossless"]
    err = capsys.readouterr().err
    assert "spd-colocate, --stage-layers balanced: stage layers [1, 5]" in err
    assert "--stage-layers balanced (driver on a rank of its own): " in err  # the engine config's own lookup, named
    # a synthetic run records nothing: its drafts are not the run's own
    before = split_store().path.read_text()
    assert main(["bench", *common, "--synthetic-alpha", "1", "--suffix-drafts", "off"]) == 0
    assert split_store().path.read_text() == before
