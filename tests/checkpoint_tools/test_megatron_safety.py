"""A Megatron checkpoint is read without unpickling: hostile `.metadata` / `common.pt` files are refused
and their payload never runs; truncated or corrupt checkpoints are one clear error (CLI: exit 2)."""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import pickle
import sys
import types
from enum import Enum
from pathlib import Path

import numpy
import pytest
import torch
from ckpt_helpers import tiny_state

from spd_engine.checkpoint_tools import megatron_dcp, safe_unpickle
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.tools.cli import main


class Payload:
    """Unpickling this runs `touch MARKER` (what a plain pickle.load does with a hostile file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _export(path: Path) -> Path:
    cfg = tiny_config("llama", num_layers=2)
    megatron_dcp.export_megatron(path, cfg, tiny_state(cfg))
    return path


def test_the_payload_runs_under_plain_pickle(tmp_path):
    """Control: the payload used below does create its marker when unpickled the ordinary way."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("action", ["import-megatron", "verify", "export-megatron"])
def test_hostile_metadata_is_refused_by_every_command(tmp_path, capsys, action):
    ckpt = _export(tmp_path / "m")
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    argv = {"import-megatron": [str(ckpt), str(tmp_path / "out")],
            "verify": [str(ckpt), str(ckpt)],
            "export-megatron": [str(ckpt), str(tmp_path / "out")]}[action]
    assert main(["convert", action, *argv]) == 2
    err = capsys.readouterr().err
    assert "system" in err and "not on the allowlist" in err and err.count("\n") == 1, err
    assert not marker.exists()


def test_hostile_metadata_inside_real_metadata_is_refused(tmp_path):
    """A payload hidden in one field of an otherwise valid Metadata object."""
    ckpt = _export(tmp_path / "m")
    marker = tmp_path / "ran"
    meta = safe_unpickle.load_dcp_metadata(ckpt / ".metadata")
    meta.planner_data = {"x": Payload(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(safe_unpickle.UnsafePickleError, match="system"):
        megatron_dcp.import_megatron(ckpt)
    assert not marker.exists()


def test_hostile_common_pt_is_refused(tmp_path, capsys):
    ckpt = _export(tmp_path / "m")
    marker = tmp_path / "ran"
    torch.save({"args": Payload(marker)}, ckpt / "common.pt")
    assert main(["convert", "import-megatron", str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "common.pt" in err and "not on the allowlist" in err and err.count("\n") == 1, err
    assert not marker.exists()


class AttnBackend(Enum):
    """Stands in for megatron.core.transformer.enums.AttnBackend (pickled under that name)."""
    auto = 5


def test_common_pt_with_megatron_args_reads_safely(tmp_path, monkeypatch):
    """Megatron-LM's args namespace, dtypes, tensors and a Megatron enum (kept inert) all read back."""
    module = "megatron.core.transformer.enums"
    for name in ("megatron", "megatron.core", "megatron.core.transformer", module):  # megatron need not be installed
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(AttnBackend, "__module__", module)
    sys.modules[module].AttnBackend = AttnBackend
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto,
                              data_path=["a"], seq_length=64, groups=collections.defaultdict(list, a=[1]),
                              device=torch.device("cpu"), timeout=datetime.timedelta(minutes=10),
                              loss_scale=numpy.float32(1.5), blob=b"xy")
    torch.save({"args": args, "iteration": 100, "t": torch.arange(3)}, tmp_path / "common.pt")
    got = safe_unpickle.load_megatron_common(tmp_path / "common.pt")
    assert got["iteration"] == 100 and torch.equal(got["t"], torch.arange(3))
    assert got["args"].num_layers == 2 and got["args"].params_dtype is torch.bfloat16
    backend = got["args"].attention_backend
    assert isinstance(backend, safe_unpickle.OpaqueObject) and backend.args == (5,)
    assert backend.qualname == "megatron.core.transformer.enums.AttnBackend"
    assert got["args"].groups == {"a": [1]} and got["args"].device == torch.device("cpu")
    assert got["args"].timeout.total_seconds() == 600 and got["args"].blob == b"xy"
    assert isinstance(got["args"].loss_scale, safe_unpickle.OpaqueObject)  # numpy is never imported to read it


@pytest.mark.parametrize("damage", ["truncate-metadata", "truncate-data", "truncate-common", "garbage-metadata",
                                    "missing-data"])
def test_damaged_checkpoint_is_one_line_exit_2(tmp_path, capsys, damage):
    ckpt = _export(tmp_path / "m")
    name = {"truncate-metadata": ".metadata", "truncate-data": "__0_0.distcp", "truncate-common": "common.pt",
            "garbage-metadata": ".metadata", "missing-data": "__0_0.distcp"}[damage]
    file = ckpt / name
    if damage.startswith("truncate"):
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif damage == "garbage-metadata":
        file.write_bytes(b"\x80\x04not a pickle at all")
    else:
        file.unlink()
    assert main(["convert", "import-megatron", str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spd convert: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_megatron_cores_own_metadata_passes_the_allowlist():
    """A .metadata written by megatron-core 0.16.1's dist_checkpointing.save (GPTModel, 2 layers, biases,
    untied), kept as test data: it also records every rank's save plan, whose classes the allowlist admits."""
    from torch.distributed.checkpoint.planner import SavePlan

    meta = safe_unpickle.load_dcp_metadata(Path(__file__).parent / "data" / "megatron_core_0.16.1_gpt.metadata")
    assert meta.all_local_plans and isinstance(meta.all_local_plans[0], SavePlan)
    assert tuple(meta.state_dict_metadata["decoder.layers.mlp.linear_fc2.bias"].size) == (2, 64)
    assert "output_layer.weight" in megatron_dcp.unexplained_tensors(meta, set())
