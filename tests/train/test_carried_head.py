"""Heads shipped as carried over from another split (train/carried_head.py): built once into the
cache as the transplant of their source, reused after, and refused clearly when the manifest is bad."""
from __future__ import annotations

import json

import pytest
import torch

from spd_engine.engine.model.model_config import tiny_config
from spd_engine.engine.model.pdm import PDM, load_pdm, random_pdm, read_pdm_config, save_pdm
from spd_engine.train.carried_head import CARRIED, CARRIED_FORMAT, materialize
from spd_engine.train.head_transplant import transplant


def _shipped(tmp_path):
    """heads/src (a trained-looking n=3 head) and heads/dst (its n=2 carried manifest)."""
    cfg = tiny_config()
    src = random_pdm(cfg, (2, 2, 2), num_layers=1, seed=3, draft_vocab=tuple(range(0, 96, 2)))
    heads = tmp_path / "heads"
    save_pdm(src, heads / "src")
    dst_cfg = random_pdm(cfg, (3, 3), num_layers=1, draft_vocab=src.pcfg.draft_vocab).pcfg
    (heads / "dst").mkdir()
    manifest = {"format": CARRIED_FORMAT, "source": "src", "stage_layers": list(dst_cfg.stage_layers),
                "anchors": list(dst_cfg.anchors)}
    (heads / "dst" / CARRIED).write_text(json.dumps(manifest))
    return cfg, heads, dst_cfg


def test_built_once_as_the_transplant_of_its_source(tmp_path):
    cfg, heads, dst_cfg = _shipped(tmp_path)
    built = materialize(heads / "dst", cfg, cache=tmp_path / "cache")
    head = load_pdm(built, cfg, (3, 3))
    want = transplant(load_pdm(heads / "src", cfg, (2, 2, 2)), PDM(cfg, dst_cfg))
    for k, v in want.state_dict().items():
        torch.testing.assert_close(head.state_dict()[k], v.half().float(), rtol=0, atol=0)  # stored in fp16
    assert read_pdm_config(built)[0] == dst_cfg
    stamp = (built / "pdm.json").stat().st_mtime_ns
    assert materialize(heads / "dst", cfg, cache=tmp_path / "cache") == built  # cached: not rebuilt
    assert (built / "pdm.json").stat().st_mtime_ns == stamp


def test_a_changed_source_builds_a_new_head(tmp_path):
    cfg, heads, _ = _shipped(tmp_path)
    first = materialize(heads / "dst", cfg, cache=tmp_path / "cache")
    save_pdm(random_pdm(cfg, (2, 2, 2), num_layers=1, seed=4, draft_vocab=tuple(range(0, 96, 2))), heads / "src")
    assert materialize(heads / "dst", cfg, cache=tmp_path / "cache") != first


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(format="other"), "format"),
    (lambda m: m.pop("anchors"), "anchors"),
    (lambda m: m.update(source="missing"), "not a PDM checkpoint"),
])
def test_a_bad_manifest_is_refused_by_name(tmp_path, edit, match):
    cfg, heads, _ = _shipped(tmp_path)
    path = heads / "dst" / CARRIED
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=match):
        materialize(heads / "dst", cfg, cache=tmp_path / "cache")


def test_a_carried_manifest_given_as_spec_is_built(tmp_path, monkeypatch):
    """`--spec DIR` with a carried-head manifest (another split of a shipped head): the command
    builds it as the default heads are built; a plain head directory passes as given."""
    from spd_engine.tools.model_args import carried_or_given

    cfg, heads, dst_cfg = _shipped(tmp_path)
    monkeypatch.setattr("spd_engine.tools.model_args.model_config", lambda spec: cfg)
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    built = carried_or_given(str(heads / "dst"), "random:tiny-llama")
    assert read_pdm_config(built)[0] == dst_cfg
    assert carried_or_given(str(heads / "src"), "random:tiny-llama") == str(heads / "src")
    assert carried_or_given("random", "random:tiny-llama") == "random"
