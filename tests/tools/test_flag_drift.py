"""The run-config flags and RunConfig's fields cannot drift apart: every engine flag sets a field (or
is named below with where it goes), every field is set by a flag (or is named below with where it
comes from), and a flag's default is the field's default (on/off flags as booleans) unless it is
resolved when the command runs, named below too. A new field or flag fails here until it is placed."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from spd_engine.engine.runtime.run_config import RunConfig
from spd_engine.tools.engine_args import add_engine_arguments

pytestmark = pytest.mark.pure

FLAG_TO_FIELD = {"spec": "pdm", "timeout": "timeout_s",
                 "stages": "topology", "stage_layers": "topology", "tp": "topology", "colocate": "topology"}
FLAGS_WITHOUT_FIELD = {
    "iface": "the process-group join (engine/comm/iface.py), before a RunConfig exists",
    "tokenizer": "the tokenizer directory engine_config returns beside the RunConfig",
}
FIELDS_WITHOUT_FLAG = {
    "cfg": "the model's config, read from the checkpoint",
    "anchors": "the trained head's pdm.json",
    "measured_layouts": "what `spd bench` measured, read by with_measured_layouts",
    "suffix_max_len": "the longest suffix the index looks up: a constant of the drafting rule, not tuned per run",
    "trace": "`spd bench` and the runtime validation set it on the configs they build",
}
RESOLVED_WHEN_RUN = {  # flag default -> the value engine_config computes
    "model": "the built-in model, resolved to a checkpoint",
    "backend": "nccl on CUDA, else the field's default",
    "dtype": "auto: bfloat16 on CUDA, float32 elsewhere",
    "capacity": "min(the field's default, the model's max positions)",
    "eagle_head": "the shipped eagle head for the model, else random",
}


def _flags() -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}


def test_every_flag_sets_a_field_and_every_field_has_a_flag():
    flags, fields = _flags(), {f.name for f in dataclasses.fields(RunConfig)}
    unplaced_flags = set(flags) - fields - set(FLAG_TO_FIELD) - set(FLAGS_WITHOUT_FIELD)
    assert not unplaced_flags, f"flags that set no RunConfig field: {sorted(unplaced_flags)}"
    unplaced_fields = fields - set(flags) - set(FLAG_TO_FIELD.values()) - set(FIELDS_WITHOUT_FLAG)
    assert not unplaced_fields, f"RunConfig fields no flag sets: {sorted(unplaced_fields)}"
    stale = (set(FLAG_TO_FIELD) | set(FLAGS_WITHOUT_FIELD)) - set(flags)
    assert not stale and not set(FIELDS_WITHOUT_FLAG) & set(flags), "a name below no longer applies"


def test_flag_defaults_are_the_fields_defaults():
    flags = _flags()
    for f in dataclasses.fields(RunConfig):
        if f.name not in flags or f.name in RESOLVED_WHEN_RUN:
            continue
        default = flags[f.name].default
        if flags[f.name].choices is not None and set(flags[f.name].choices) == {"on", "off"}:
            default = default == "on"
        assert default == f.default, f"--{f.name.replace('_', '-')} defaults to {default!r}, RunConfig.{f.name} to {f.default!r}"


def test_a_drifted_flag_is_caught(monkeypatch):
    """The check is not vacuous: a flag whose default differs from its field's fails it."""
    import spd_engine.tools.engine_args as engine_args

    real = engine_args.run_default
    monkeypatch.setattr(engine_args, "run_default", lambda name: 999 if name == "prefill_chunk" else real(name))
    with pytest.raises(AssertionError, match="prefill-chunk"):
        test_flag_defaults_are_the_fields_defaults()
