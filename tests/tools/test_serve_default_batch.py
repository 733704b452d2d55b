"""`spd serve`'s default --max-batch: several requests share the pipeline for SPD on a CPU (a lone
request measured as fast at B = 4 as at B = 1, docs/serve.md), one elsewhere; a given B is kept."""
from __future__ import annotations

import argparse

import pytest

from spd_engine.engine.runtime.run_config import Mode
from spd_engine.tools.cli_conventions import SERVE_CPU_BATCH, resolve_max_batch


@pytest.mark.parametrize("given, mode, device, want", [
    (None, Mode.SPD, "cpu", SERVE_CPU_BATCH),
    (None, Mode.SPD, "cuda", 1),  # a lone request's one-row steps keep their CUDA graphs
    (None, Mode.AR, "cpu", 1),
    (None, Mode.PP, "cpu", 1),
    (2, Mode.SPD, "cuda", 2),
    (1, Mode.SPD, "cpu", 1),
])
def test_the_default_batch_is_four_for_spd_on_a_cpu_and_a_given_one_is_kept(given, mode, device, want):
    assert resolve_max_batch(argparse.Namespace(max_batch=given), mode, device) == want


def test_serve_help_names_the_automatic_default(capsys):
    from spd_engine.tools.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default auto: {SERVE_CPU_BATCH} for SPD on a CPU, else 1" in text
