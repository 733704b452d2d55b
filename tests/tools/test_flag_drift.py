"""The run-config flags and RunConfig's nested fields cannot drift apart: every engine flag sets a field,
named by its dotted path (`--suffix-run` -> `drafting.suffix_run`; the flag's name is the field's, or is
mapped below), every field is set by a flag (or is named below with where it comes from), and a flag's
default is the field's default (on/off flags as booleans) unless it is resolved when the command runs,
named below too. A new field or flag, or one moved to another group, fails here until it is placed."""
from __future__ import annotations

import argparse

import pytest

from spd_engine.engine.runtime.run_config import run_fields
from spd_engine.tools.engine_args import add_engine_arguments

pytestmark = pytest.mark.pure

FIELD_OF_FLAG = {  # a flag whose name is not its field's
    "spec": "drafting.pdm", "timeout": "runtime.timeout_s", "model": "model.source", "stages": "parallel.topology",
    "stage_layers": "parallel.topology", "tp": "parallel.topology", "colocate": "parallel.topology",
}
FLAGS_WITHOUT_FIELD = {
    "iface": "the process-group join (engine/comm/iface.py), before a RunConfig exists",
    "tokenizer": "the tokenizer directory engine_config returns beside the RunConfig",
}
FIELDS_WITHOUT_FLAG = {
    "model.cfg": "the model's config, read from the checkpoint",
    "drafting.anchors": "the trained head's pdm.json",
    "model.measured_layouts": "what `spd bench` measured, read by with_measured_layouts",
    "drafting.suffix_max_len": "the longest suffix the index looks up: a constant of the drafting rule, not tuned per run",
    "runtime.trace": "`spd bench` and the runtime validation set it on the configs they build",
}
RESOLVED_WHEN_RUN = {  # flag default -> the value engine_config computes
    "model.source": "the built-in model, resolved to a checkpoint",
    "parallel.backend": "nccl on CUDA, else the field's default",
    "model.dtype": "auto: bfloat16 on CUDA, float32 elsewhere",
    "runtime.capacity": "min(the field's default, the model's max positions)",
    "drafting.eagle_head": "the shipped eagle head for the model, else random",
    "drafting.pdm": "the shipped head for the model and n, else random",
    "parallel.topology": "Topology.build of --stages, --stage-layers, --tp and --colocate",
}


def _flags() -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}


def _field_of(flag: str, fields: dict) -> str | None:
    """The dotted field a flag sets: mapped above, else the one field whose last name is the flag's."""
    if flag in FIELD_OF_FLAG:
        return FIELD_OF_FLAG[flag]
    named = [f for f in fields if f.rsplit(".", 1)[-1] == flag]
    return named[0] if len(named) == 1 else None


def test_every_flag_sets_a_field_and_every_field_has_a_flag():
    flags, fields = _flags(), run_fields()
    set_by = {flag: _field_of(flag, fields) for flag in flags if flag not in FLAGS_WITHOUT_FIELD}
    unplaced_flags = sorted(flag for flag, field in set_by.items() if field not in fields)
    assert not unplaced_flags, f"flags that set no RunConfig field: {unplaced_flags}"
    unplaced_fields = set(fields) - set(set_by.values()) - set(FIELDS_WITHOUT_FLAG)
    assert not unplaced_fields, f"RunConfig fields no flag sets: {sorted(unplaced_fields)}"
    stale = (set(FIELD_OF_FLAG) | set(FLAGS_WITHOUT_FIELD)) - set(flags)
    assert not stale and not set(FIELDS_WITHOUT_FLAG) & set(set_by.values()), "a name above no longer applies"
    assert set(FIELDS_WITHOUT_FLAG) | set(RESOLVED_WHEN_RUN) <= set(fields), "a field named above does not exist"


def test_flag_defaults_are_the_fields_defaults():
    flags, fields = _flags(), run_fields()
    for flag, action in flags.items():
        name = _field_of(flag, fields)
        if name not in fields or name in RESOLVED_WHEN_RUN:
            continue
        default = action.default
        if action.choices is not None and set(action.choices) == {"on", "off"}:
            default = default == "on"
        want = fields[name].default
        assert default == want, f"--{flag.replace('_', '-')} defaults to {default!r}, RunConfig.{name} to {want!r}"


def test_a_drifted_flag_is_caught(monkeypatch):
    """The check is not vacuous: a flag whose default differs from its field's fails it."""
    import spd_engine.tools.engine_args as engine_args

    real = engine_args.run_default
    monkeypatch.setattr(engine_args, "run_default", lambda name: 999 if name == "runtime.prefill_chunk" else real(name))
    with pytest.raises(AssertionError, match="prefill-chunk"):
        test_flag_defaults_are_the_fields_defaults()


def test_a_renamed_or_moved_field_is_caught(monkeypatch):
    """A field renamed, or moved into a group where its flag's name no longer finds it, fails the check."""
    real = run_fields()
    for old, new in (("drafting.suffix_run", "drafting.suffix_run_len"), ("runtime.timeout_s", "parallel.timeout_s")):
        moved = {new if k == old else k: v for k, v in real.items()}
        monkeypatch.setitem(globals(), "run_fields", lambda moved=moved: moved)
        with pytest.raises(AssertionError, match="suffix_run|timeout"):
            test_every_flag_sets_a_field_and_every_field_has_a_flag()
