"""Megatron-LM's flag spellings on the engine commands mean what the engine's own do."""
from __future__ import annotations

import argparse

import pytest

from spd_engine.tools import generate, serve


@pytest.mark.parametrize("module", [generate, serve])
def test_megatron_spellings_set_the_same_fields(module):
    p = argparse.ArgumentParser(allow_abbrev=False)
    module.add_arguments(p)
    theirs = p.parse_args(["--load", "ckpt", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                           "3", "--tokenizer", "tok.model"])
    ours = p.parse_args(["--model", "ckpt", "--tp", "2", "--stages", "3", "--tokenizer", "tok.model"])
    assert vars(theirs) == vars(ours)
    assert (ours.model, ours.tp, ours.stages, ours.tokenizer) == ("ckpt", 2, 3, "tok.model")
