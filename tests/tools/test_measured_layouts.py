"""`--weight-layout auto` end to end: `spd bench` times the layouts for its rows' thread counts and
records the fastest for this model and device, and a later command's engine config takes the
record for its own threads (a layout given by hand wins)."""
from __future__ import annotations

import argparse
import json

import pytest

from spd_engine.engine.runtime.measured_layout import layout_key
from spd_engine.tools import generate
from spd_engine.tools.cli import main
from spd_engine.tools.engine_args import engine_config
from spd_engine.tools.measured_args import layout_store


def config(argv: list[str]):
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    return engine_config(p.parse_args(argv))[0]


def test_engine_config_takes_the_recorded_layout_for_its_threads():
    base = ["--model", "random:tiny-llama", "--stages", "2", "--colocate", "--prompt", "x", "--threads", "1"]
    rule = config(base).resolved_weight_layout
    other = "row" if rule != "row" else "col"
    times = {(lay, w): (1.0 if lay == other else 2.0) for lay in ("row", "col") for w in (1, 4)}
    ecfg = config(base)
    layout_store().record(layout_key(ecfg.model.source, ecfg.parallel.device, 1), times)
    assert config(base).resolved_weight_layout == other
    assert config(base + ["--weight-layout", rule]).resolved_weight_layout == rule  # given by hand
    two = config(base[:-1] + ["2"])
    assert dict(two.model.measured_layouts).get(2) is None and two.resolved_weight_layout == two.replace(
        measured_layouts=()).resolved_weight_layout  # no record for two threads: the fixed rule


@pytest.mark.multiproc
def test_bench_records_the_layouts_of_its_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--prompt", "hello",
                 "--max-new-tokens", "8", "--repeats", "1", "--configs", "ar,spd-colocate", "--json", str(out)]) == 0
    assert "weight layout for ranks of 1 thread(s): " in capsys.readouterr().err
    doc = json.loads(layout_store().path.read_text())["layouts"]
    (key, record), = doc.items()
    assert "tiny-llama" in key and "1 thread(s)" in key and record["ms"]["col x1"] > 0
    assert all(r["lossless"] for r in json.loads(out.read_text())["rows"])
    assert config(["--model", "random:tiny-llama", "--prompt", "x", "--threads", "1"]).resolved_weight_layout == \
        record["layout"]
    # a bench given its layout, or under a made-up load, measures none
    path = layout_store().path
    path.unlink()
    assert main(["bench", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--prompt", "hello",
                 "--max-new-tokens", "4", "--repeats", "1", "--configs", "ar", "--weight-layout", "col"]) == 0
    assert not path.exists()


def test_measure_weight_layouts_records_for_a_later_command(capsys):
    assert main(["measure", "weight-layouts", "--model", "random:tiny-llama", "--threads", "1"]) == 0
    assert "weight layout for ranks of 1 thread(s): " in capsys.readouterr().out
    (record,) = json.loads(layout_store().path.read_text())["layouts"].values()
    assert config(["--model", "random:tiny-llama", "--prompt", "x", "--threads", "1"]).resolved_weight_layout == \
        record["layout"]
    with pytest.raises(SystemExit):
        main(["measure", "weight-layouts", "--model", "random:tiny-llama", "--threads", "0"])
