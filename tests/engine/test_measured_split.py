"""Measured splits (engine/runtime/measured_split.py): the store keeps a bench's split advice per
model, n, T, driver placement and device; `--stage-layers balanced` takes it where the run's head
can serve it, else the even split, and says which."""
from __future__ import annotations

import json

import pytest

from spd_engine.engine.runtime.measured_split import SplitKey, SplitStore, balanced_choice

pytestmark = pytest.mark.pure

ADVICE = {"stage_layers": [12, 12], "busiest_ms": 67.0, "balanced_layers": [14, 10], "balanced_busiest_ms": 59.6}
KEY = SplitKey("qwen2.5-coder-0.5b-0123", 2, 1, True, "AMD EPYC, 2 cores, 1 thread(s)")


def test_a_record_is_found_under_its_own_key_only(tmp_path):
    store = SplitStore(tmp_path / "sub" / "splits.json")
    assert store.lookup(KEY) is None  # no file yet
    store.record(KEY, {**ADVICE, "extra": 1}, head="heads/q-n2")
    got = store.lookup(KEY)
    assert got["balanced_layers"] == [14, 10] and got["stage_layers"] == [12, 12] and got["head"] == "heads/q-n2"
    assert "extra" not in got and got["date"]
    for other in (SplitKey(KEY.model, 2, 1, False, KEY.device), SplitKey(KEY.model, 2, 1, True, "NVIDIA H100, 1 thread(s)"),
                  SplitKey(KEY.model, 4, 1, True, KEY.device), SplitKey("smollm2-135m-99", 2, 1, True, KEY.device)):
        assert store.lookup(other) is None, other
    store.record(KEY, {**ADVICE, "balanced_layers": [13, 11]}, head="h")  # a newer bench replaces it
    assert store.lookup(KEY)["balanced_layers"] == [13, 11]
    assert len(json.loads(store.path.read_text())["splits"]) == 1
    assert not list(store.path.parent.glob(".measured_splits.*"))  # the temporary file was renamed


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 7, "splits": {}}), json.dumps([1, 2])])
def test_a_corrupt_or_foreign_file_is_a_clear_error(tmp_path, text):
    path = tmp_path / "splits.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="measured splits file .*splits.json"):
        SplitStore(path).lookup(KEY)


def test_balanced_choice():
    record = {**ADVICE, "date": "2026-12-05 21:00", "head": "h"}
    split, why = balanced_choice(record, [12, 12], lambda s: None)
    assert split == [14, 10] and "measured here on 2026-12-05 21:00" in why and "67.00 at [12, 12]" in why
    split, why = balanced_choice(None, [12, 12], lambda s: None)
    assert split == [12, 12] and "no split measured" in why
    split, why = balanced_choice(record, [15, 15], lambda s: None)  # a record of another model's layers
    assert split == [15, 15] and "another model" in why
    split, why = balanced_choice(record, [12, 12], lambda s: "its anchors fall in other stages")
    assert split == [12, 12] and "does not suit this run's head (its anchors fall in other stages)" in why


@pytest.mark.parametrize("bad", [{"balanced_layers": [14, 0]}, {"balanced_layers": "14,10"}, {"busiest_ms": None},
                                 {"stage_layers": []}])
def test_a_malformed_record_is_a_clear_error(tmp_path, bad):
    store = SplitStore(tmp_path / "splits.json")
    store.record(KEY, ADVICE, head="h")
    doc = json.loads(store.path.read_text())
    doc["splits"][KEY.text()].update(bad)
    store.path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="record for .* is malformed"):
        store.lookup(KEY)
