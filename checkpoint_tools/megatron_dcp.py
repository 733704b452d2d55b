"""Export to / import from Megatron-core's `torch_dist` checkpoint format, single process.

A `torch_dist` directory is a `torch.distributed.checkpoint` (DCP) checkpoint plus two small files:
  .metadata, __0_0.distcp   DCP: global tensors, read and written here with `dcp.save` / `dcp.load`
                            and no process group (`no_dist=True`)
  common.pt                 `torch.save` of the non-sharded part of the state dict
  metadata.json             {"sharded_backend": "torch_dist", ...}: how Megatron recognises the format
Keys and shapes are what `GPTModel.sharded_state_dict()` produces with the local layer spec:
  - per-layer tensors are ONE global tensor per kind, layers stacked on a leading dim:
    `decoder.layers.self_attention.linear_qkv.weight` [L, (nh + 2 nkv) hd, H], stored (like Megatron
    does) as one chunk per layer, so no stacked copy of the model is ever made on export
  - norms use the Transformer-Engine names (`...linear_qkv.layer_norm_weight`,
    `...linear_fc1.layer_norm_weight`), which the local spec maps its own names to
  - each linear layer's `_extra_state` is an object `<key>/shard_<i>_<L>` holding `[None]`
  - tensors are unsharded (TP-agnostic): qkv grouped per query group, fc1 = [gate; up]; Megatron
    reshards on load for any TP size
`common.pt` also records the engine model config (`spd_model_config`), so an import needs no other
input; a checkpoint Megatron-LM wrote is described by the args it saves there
(checkpoint_tools/megatron_args.py), one that records neither by an HF config.
Nothing a checkpoint holds is unpickled: `.metadata` and `common.pt` go through the allowlist
unpicklers of checkpoint_tools/safe_unpickle.py, tensors through torch's `weights_only` loader. Every
tensor of the checkpoint is either read into the model or named in an error (optimizer state and
`_extra_state` objects aside), so a checkpoint the config does not fully explain is refused.
"""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from spd_engine.checkpoint_tools import hf, key_maps, megatron_args
from spd_engine.checkpoint_tools.safe_unpickle import load_dcp_metadata, load_megatron_common
from spd_engine.engine.model.checkpoint import EMBEDDING_KEY, OUTPUT_KEY, expected_shapes
from spd_engine.engine.model.model_config import ModelConfig

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}
COMMON_FILE = "common.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's `--load` directory layout
CONFIG_KEY = "spd_model_config"
TOKENIZER_DIR = "tokenizer"
# Tensors a training checkpoint holds besides the model: none of them is part of the model.
NON_MODEL_PREFIXES = ("optimizer.",)


class SafeReader(FileSystemReader):
    """torch's DCP reader, with `.metadata` read through the allowlist unpickler instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta = load_dcp_metadata(Path(self.path) / ".metadata")
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class _LayerChunkPlanner(DefaultSavePlanner):
    """Writes stacked per-layer tensors as one chunk per layer, straight from the layer tensors.

    `layers[key][i]` is layer i's tensor; its chunk sits at offset i of the leading dim of a global
    tensor [L, *shape]. BytesIO values are written as they are (already `torch.save`d objects).
    """

    def __init__(self, layers: dict[str, list[torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.layers = layers

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for key, tensors in self.layers.items():
            global_size = torch.Size([len(tensors), *tensors[0].shape])
            for i, t in enumerate(tensors):
                assert t.shape == tensors[0].shape and t.dtype == tensors[0].dtype, key
                offsets = torch.Size([i] + [0] * t.dim())
                items.append(WriteItem(
                    index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, torch.Size([1, *t.shape])),
                                                TensorProperties.create_from_tensor(t), global_size)))
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if key in self.layers:
            data = self.layers[key][write_item.index.offset[0]].unsqueeze(0)
        elif write_item.type == WriteItemType.BYTE_IO:
            return self.state_dict[key]
        else:
            data = super().resolve_data(write_item)
        # torch.save writes a view's whole storage; write only the tensor's own bytes.
        return data if data.untyped_storage().nbytes() == data.nbytes else data.clone()


def _extra_state_bytes() -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([None], buf)  # what Megatron stores for a local-spec linear's (empty) extra state
    return buf


def export_megatron(dst: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], *,
                    release_layout: bool = False, tokenizer_src: str | Path | None = None) -> Path:
    """Write an unsharded engine state dict as a Megatron-core `torch_dist` checkpoint.

    `release_layout` writes Megatron-LM's `--load` layout: `dst/release/` plus the tracker file.
    Returns the directory holding the checkpoint itself.
    """
    missing = sorted(set(key_maps.mcore_keys(cfg)) ^ set(state))
    if missing:
        raise ValueError(f"state dict does not match the {cfg.arch} config: {missing[:4]}")
    root = Path(dst)
    out = root / "release" if release_layout else root
    out.mkdir(parents=True, exist_ok=True)
    L = cfg.num_layers
    whole: dict[str, object] = {}
    layers: dict[str, list[torch.Tensor | None]] = {}
    for name, t in state.items():
        key, layer = key_maps.to_dist_key(name)
        if layer is None:
            whole[key] = t
        else:
            layers.setdefault(key, [None] * L)[layer] = t
    assert all(t is not None for ts in layers.values() for t in ts), "a layer tensor is missing"
    for key in key_maps.extra_state_keys():
        for i in range(L):
            whole[f"{key}/shard_{i}_{L}"] = _extra_state_bytes()
    with warnings.catch_warnings():  # single-process DCP warns that it runs without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(whole, storage_writer=FileSystemWriter(out), planner=_LayerChunkPlanner(layers), no_dist=True)
    torch.save({"checkpoint_version": 3.0, CONFIG_KEY: cfg.to_dict()}, out / COMMON_FILE)
    (out / "metadata.json").write_text(json.dumps(METADATA_JSON))
    if release_layout:
        (root / TRACKER_FILE).write_text("release")
    if tokenizer_src is not None:
        (root / TOKENIZER_DIR).mkdir(exist_ok=True)
        hf.copy_tokenizer_files(tokenizer_src, root / TOKENIZER_DIR)
    return out


def checkpoint_dir(path: str | Path) -> Path:
    """The torch_dist directory itself: `path`, or the iteration the Megatron-LM tracker file names."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"Megatron checkpoint directory {root} does not exist")
    tracker = root / TRACKER_FILE
    if tracker.is_file():
        it = tracker.read_text().strip()
        root = root / ("release" if it == "release" else f"iter_{int(it):07d}")
    meta = root / "metadata.json"
    if not meta.is_file():
        raise ValueError(f"{root} is not a Megatron dist checkpoint: metadata.json is missing")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta} is not valid JSON: {err}") from None
    if backend != "torch_dist":
        raise ValueError(f"{root}: sharded backend {backend!r} is not supported (only torch_dist)")
    return root


def is_megatron_dir(path: str | Path) -> bool:
    """A torch_dist directory (metadata.json, DCP's .metadata) or Megatron-LM's --save layout (the
    tracker file, iter_NNNNNNN/ directories)."""
    p = Path(path)
    return (any((p / name).is_file() for name in ("metadata.json", ".metadata", TRACKER_FILE))
            or any(d.is_dir() for d in p.glob("iter_[0-9]*")))


def read_common(ckpt: Path) -> dict:
    """common.pt through the allowlist unpickler ({} when it holds no dict)."""
    file = ckpt / COMMON_FILE
    if not file.is_file():
        raise ValueError(f"{ckpt}: {COMMON_FILE} is missing")
    common = load_megatron_common(file)
    return common if isinstance(common, dict) else {}


def model_config(ckpt: Path, given: ModelConfig | None = None) -> ModelConfig:
    """The model config of a checkpoint: `given`, else the engine config our export records, else the one
    Megatron-LM's args in common.pt describe. `given` is checked against recorded args."""
    common = read_common(ckpt)
    args = common.get("args")
    if given is not None:
        if args is not None:
            megatron_args.check_config_against_args(given, args)
        return given
    if CONFIG_KEY in common:
        return ModelConfig.from_dict(common[CONFIG_KEY])
    if args is not None:
        return megatron_args.config_from_args(args)
    raise ValueError(f"{ckpt} records no model config (no Megatron-LM args in {COMMON_FILE}); pass --hf-config "
                     "DIR (a directory whose config.json describes the model)")


def unexplained_tensors(meta: Metadata, explained: set[str]) -> list[str]:
    """The checkpoint's model tensors that `explained` (torch_dist keys) does not cover."""
    return sorted(k for k, md in meta.state_dict_metadata.items()
                  if isinstance(md, TensorStorageMetadata) and k not in explained
                  and not k.startswith(NON_MODEL_PREFIXES) and not k.endswith("_extra_state"))


def _dist_names(cfg: ModelConfig) -> dict[str, list[tuple[str, int | None]]]:
    """torch_dist key -> the engine names (and layer index) it holds, for this config."""
    names_by_key: dict[str, list[tuple[str, int | None]]] = {}
    for name in key_maps.mcore_keys(cfg):
        key, layer = key_maps.to_dist_key(name)
        names_by_key.setdefault(key, []).append((name, layer))
    return names_by_key


def _load(ckpt: Path, reader: SafeReader, buffers: dict[str, torch.Tensor]) -> None:
    """dcp.load into `buffers`; a checkpoint whose data files are missing or damaged is a ValueError."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(buffers, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False),
                     no_dist=True)
        except (CheckpointException, RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
            first = str(err).strip().splitlines()
            raise ValueError(f"{ckpt}: the tensor data is missing, truncated or corrupt "
                             f"({type(err).__name__}: {first[-1] if first else ''})") from None


def import_megatron(src: str | Path, cfg: ModelConfig | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a torch_dist checkpoint into an unsharded engine state dict (engine names).

    `cfg` defaults to the config our export records in common.pt. Vocabulary padding (Megatron-LM
    pads the embedding to a multiple of 128 x tp) is dropped. A tensor the config does not explain
    (a bias, an untied output layer, ...) is an error naming it, never silently left out.
    """
    ckpt = checkpoint_dir(src)
    cfg = model_config(ckpt, cfg)
    reader = SafeReader(ckpt)
    metadata = reader.read_metadata()
    names_by_key = _dist_names(cfg)
    extra = unexplained_tensors(metadata, set(names_by_key))
    if extra:
        raise ValueError(f"{ckpt} holds {len(extra)} tensors the model config does not explain: "
                         f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}; refusing to drop them")
    meta, L = metadata.state_dict_metadata, cfg.num_layers
    buffers = {}
    shapes = expected_shapes(cfg, range(L), True, True)
    for key, names in names_by_key.items():
        md = meta.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{ckpt}: tensor {key} is missing")
        name, layer = names[0]
        want = shapes[name] if layer is None else (L, *shapes[name])
        got = tuple(md.size)
        vocab_padded = name in (EMBEDDING_KEY, OUTPUT_KEY) and got[1:] == want[1:] and got[0] > want[0]
        if got != want and not vocab_padded:
            raise ValueError(f"{ckpt}: tensor {key} has shape {got}, the model config needs {want}")
        buffers[key] = torch.empty(got, dtype=md.properties.dtype)
    _load(ckpt, reader, buffers)
    state = {}
    for key, names in names_by_key.items():
        for name, layer in names:
            t = buffers[key] if layer is None else buffers[key][layer]
            if layer is None and t.shape[0] > shapes[name][0]:
                t = t[:cfg.vocab_size].clone()  # drop Megatron-LM's vocabulary padding rows
            state[name] = t
    return cfg, state


def tokenizer_dir(src: str | Path) -> Path | None:
    p = Path(src) / TOKENIZER_DIR
    return p if p.is_dir() else None
