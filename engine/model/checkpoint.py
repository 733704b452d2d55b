"""The engine checkpoint format: one safetensors file per (stage, TP rank) plus `index.json`.

Layout of a checkpoint directory:
  index.json                                   model config, stage layer counts, tp, dtype, and per
                                               shard file its tensors (shape, dtype, sha256), plus a
                                               content hash over the config, dtype and tensor list;
                                               written last, it marks the checkpoint complete
  stage-00-of-04.tp-00-of-01.safetensors       stage 0's tensors for TP rank 0, Megatron-core names
  ...
Tensor names are the `StageModel` parameter names with GLOBAL layer indices. Stage 0 holds the
embedding, the last stage the final norm and (untied) output layer; a tied model stores its
embedding once. Norms are replicated in every TP rank's file.

Loading reads only what one stage needs, for any stage split (the runtime picks `n`, not the
checkpoint): tensors are found by name through the index, whatever file holds them. A tied head
stage without the embedding reads the embedding from stage 0's file as its output layer.
Every tensor read is checked against the index (shape, dtype, sha256) and the model config.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.tensor_names import EMBEDDING_KEY, OUTPUT_KEY, layer_of  # noqa: F401 (re-exported)
from spd_engine.engine.model.tp_shard import check_tp, reshard_piece, tp_split_dim
from spd_engine.engine.protocol.topology import stage_bounds

INDEX_FILE = "index.json"
FORMAT_NAME = "spd-engine-checkpoint"
FORMAT_VERSION = 2  # 2: the content hash covers the model config and dtype
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported checkpoint dtype {dtype}; supported: {', '.join(DTYPES)}")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def owner_stage(name: str, bounds: list[int]) -> int:
    """Which stage of a split (boundaries B_0..B_n) stores this tensor."""
    n = len(bounds) - 1
    layer = layer_of(name)
    if layer is None:
        return 0 if name == EMBEDDING_KEY else n - 1
    for p in range(n):
        if bounds[p] <= layer < bounds[p + 1]:
            return p
    raise ValueError(f"tensor {name} belongs to layer {layer}, outside the model's {bounds[-1]} layers")


def save_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """`save_file` with the permissions a plain create gives (safetensors makes its files private)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def shard_file_name(stage: int, n: int, tp_rank: int, tp: int) -> str:
    return f"stage-{stage:02d}-of-{n:02d}.tp-{tp_rank:02d}-of-{tp:02d}.safetensors"


def expected_shapes(cfg: ModelConfig, layers: range, embedding: bool, head: bool, tp: int = 1
                    ) -> dict[str, tuple[int, ...]]:
    """Name -> per-TP-rank shape of every tensor a stage needs, from the model itself (meta device)."""
    from spd_engine.engine.model.model import StageModel  # the model defines the names; imported lazily (heavy)

    model = StageModel(cfg, layers, embedding=embedding, head=head, device="meta")
    shapes = {}
    for name, t in model.state_dict().items():
        shape = list(t.shape)
        dim = tp_split_dim(name)
        if dim is not None and tp > 1:
            if shape[dim] % tp:
                raise ValueError(f"{name}: dim {dim} of size {shape[dim]} is not divisible by tp={tp}")
            shape[dim] //= tp
        shapes[name] = tuple(shape)
    return shapes


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major, its own dtype)."""
    t = t.detach().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def content_hash(cfg: ModelConfig, dtype: str, tensor_hashes: dict[tuple[str, int], str]) -> str:
    """Hash over the model config, the dtype and all (name, tp rank) -> tensor sha256: an edit to any
    of them in `index.json` is caught. Independent of the stage split by construction."""
    h = hashlib.sha256()
    h.update(f"config\t{json.dumps(cfg.to_dict(), sort_keys=True)}\ndtype\t{dtype}\n".encode())
    for (name, rank), digest in sorted(tensor_hashes.items()):
        h.update(f"{name}\t{rank}\t{digest}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    sha256: str


@dataclass(frozen=True)
class ShardEntry:
    file: str
    stage: int
    tp_rank: int
    tensors: dict[str, TensorEntry]


@dataclass(frozen=True)
class CheckpointIndex:
    path: Path
    cfg: ModelConfig
    stage_layers: tuple[int, ...]
    tp: int
    dtype: str
    shards: tuple[ShardEntry, ...]
    content_hash: str

    @property
    def n(self) -> int:
        return len(self.stage_layers)

    @property
    def bounds(self) -> list[int]:
        return stage_bounds(list(self.stage_layers))

    def locate(self, name: str, tp_rank: int) -> tuple[ShardEntry, TensorEntry]:
        """The shard file holding tensor `name` for `tp_rank`."""
        for shard in self.shards:
            if shard.tp_rank == tp_rank and name in shard.tensors:
                return shard, shard.tensors[name]
        raise ValueError(f"checkpoint {self.path}: no shard holds tensor {name} for tp rank {tp_rank}")


def _index_dict(cfg: ModelConfig, stage_layers: list[int], tp: int, dtype: str,
                shards: list[ShardEntry], chash: str) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "stage_layers": list(stage_layers),
        "tp": tp,
        "dtype": dtype,
        "content_hash": chash,
        "shards": [{"file": s.file, "stage": s.stage, "tp_rank": s.tp_rank,
                    "tensors": {k: {"shape": list(e.shape), "dtype": e.dtype, "sha256": e.sha256}
                                for k, e in sorted(s.tensors.items())}} for s in shards],
    }


def write_shards(path: str | Path, cfg: ModelConfig, stage_layers: list[int], tp: int,
                 shards: dict[tuple[int, int], dict[str, torch.Tensor]]) -> CheckpointIndex:
    """Write already-split tensors, shards[(stage, tp_rank)] = {name: tensor}, into the empty directory
    `path`; returns the index, not yet written (`write_index`, last: it marks the checkpoint complete).

    The caller splits (checkpoint_tools.shard); this checks the result against the model config
    so a wrong split can never be written.
    """
    out = Path(path)
    n, bounds = len(stage_layers), stage_bounds(list(stage_layers))
    assert sum(stage_layers) == cfg.num_layers, (stage_layers, cfg.num_layers)
    assert set(shards) == {(p, r) for p in range(n) for r in range(tp)}, sorted(shards)
    dtypes = {t.dtype for sd in shards.values() for t in sd.values()}
    if len(dtypes) != 1:
        raise ValueError(f"a checkpoint holds one dtype; got {sorted(map(str, dtypes))}")
    dtype = dtype_name(dtypes.pop())
    out.mkdir(parents=True, exist_ok=True)
    # files of another checkpoint must never mix with these: converters write into a fresh
    # directory and rename it into place (checkpoint_tools/output_dir.py)
    assert not any(out.iterdir()), f"{out} is not empty"
    entries, hashes = [], {}
    for (p, r), sd in sorted(shards.items()):
        expected = expected_shapes(cfg, range(bounds[p], bounds[p + 1]), p == 0, p == n - 1, tp)
        if cfg.tie_embeddings and p == n - 1 and p != 0:
            expected.pop(OUTPUT_KEY, None)  # a tied head reads the embedding from stage 0
        if set(sd) != set(expected):
            raise ValueError(f"stage {p} tp rank {r}: tensors {sorted(set(sd) ^ set(expected))} "
                             "are missing or unexpected")
        tensors = {}
        for name, t in sd.items():
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {expected[name]}")
            tensors[name] = TensorEntry(tuple(t.shape), dtype, tensor_sha256(t))
            hashes[(name, r)] = tensors[name].sha256
        file = shard_file_name(p, n, r, tp)
        save_safetensors({k: t.contiguous() for k, t in sd.items()}, out / file)
        entries.append(ShardEntry(file, p, r, tensors))
    return CheckpointIndex(out, cfg, tuple(stage_layers), tp, dtype, tuple(entries), content_hash(cfg, dtype, hashes))


def write_index(index: CheckpointIndex) -> None:
    """Write `index.json`, the marker of a complete checkpoint, whole or not at all."""
    raw = _index_dict(index.cfg, list(index.stage_layers), index.tp, index.dtype, list(index.shards),
                      index.content_hash)
    tmp = index.path / f".{INDEX_FILE}.tmp"
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, index.path / INDEX_FILE)


def read_index(path: str | Path) -> CheckpointIndex:
    """Parse and validate `index.json` (no tensor data is read)."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"checkpoint path {root} does not exist")
    if not root.is_dir():
        raise ValueError(f"checkpoint path {root} is not a directory")
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        raise ValueError(f"{root} is not an engine checkpoint: {INDEX_FILE} is missing")
    try:
        raw = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{index_path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ValueError(f"{index_path}: not an {FORMAT_NAME} index")
    if raw.get("version") != FORMAT_VERSION:
        older = " (an older format: convert the model again)" if raw.get("version") == 1 else ""
        raise ValueError(f"{index_path}: format version {raw.get('version')!r}, this engine reads {FORMAT_VERSION}"
                         f"{older}")
    try:
        cfg = ModelConfig.from_dict(raw["model_config"])
        stage_layers, tp, dtype = tuple(raw["stage_layers"]), int(raw["tp"]), raw["dtype"]
        shards = tuple(ShardEntry(s["file"], int(s["stage"]), int(s["tp_rank"]),
                                  {k: TensorEntry(tuple(e["shape"]), e["dtype"], e["sha256"])
                                   for k, e in s["tensors"].items()}) for s in raw["shards"])
        chash = raw["content_hash"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: malformed index ({err!r})") from None
    if sum(stage_layers) != cfg.num_layers or any(c < 1 for c in stage_layers):
        raise ValueError(f"{index_path}: stage layers {list(stage_layers)} do not split {cfg.num_layers} layers")
    parse_dtype(dtype)
    if tp < 1 or {(s.stage, s.tp_rank) for s in shards} != {(p, r) for p in range(len(stage_layers))
                                                            for r in range(tp)}:
        raise ValueError(f"{index_path}: shard list does not cover {len(stage_layers)} stages x tp={tp}")
    hashes = {(k, s.tp_rank): e.sha256 for s in shards for k, e in s.tensors.items()}
    if content_hash(cfg, dtype, hashes) != chash:
        raise ValueError(f"{index_path}: content hash does not match the config and tensor list "
                         "(index edited or corrupt)")
    return CheckpointIndex(root, cfg, stage_layers, tp, dtype, shards, chash)


def _read_tensor(index: CheckpointIndex, shard: ShardEntry, name: str, entry: TensorEntry,
                 verify: bool) -> torch.Tensor:
    file = index.path / shard.file
    if not file.is_file():
        raise ValueError(f"checkpoint {index.path}: shard file {shard.file} is missing")
    try:
        # One open per tensor: the file's mapping is released as soon as the tensor is read, so a
        # stage never keeps pages of tensors it does not use resident.
        with safe_open(str(file), framework="pt") as f:
            if name not in f.keys():
                raise ValueError(f"{file}: tensor {name} listed in the index is not in the file")
            t = f.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"{file} is truncated or corrupt: {err}") from None
    if tuple(t.shape) != entry.shape or dtype_name(t.dtype) != entry.dtype:
        raise ValueError(f"{file}: tensor {name} has shape {tuple(t.shape)} {t.dtype}, the index says "
                         f"{entry.shape} {entry.dtype}")
    if verify and tensor_sha256(t) != entry.sha256:
        raise ValueError(f"{file}: tensor {name} is corrupt (sha256 does not match the index)")
    return t


def resolve_stage(index: CheckpointIndex, stage: int | range, embedding: bool | None,
                  head: bool | None) -> tuple[range, bool, bool]:
    """A stage of the checkpoint's own split, or any layer range, with embedding/head defaults."""
    L = index.cfg.num_layers
    if isinstance(stage, int):
        if not 0 <= stage < index.n:
            raise ValueError(f"stage {stage} does not exist: the checkpoint has {index.n} stages")
        b = index.bounds
        layers = range(b[stage], b[stage + 1])
    else:
        layers = stage
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= L:
            raise ValueError(f"layer range {layers} is outside the model's {L} layers")
    embedding = layers.start == 0 if embedding is None else embedding
    head = layers.stop == L if head is None else head
    return layers, embedding, head


def load_stage_state(path: str | Path, stage: int | range, embedding: bool | None = None,
                     head: bool | None = None, tp_rank: int = 0, *, cfg: ModelConfig | None = None,
                     dtype: torch.dtype | None = None, verify: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of one stage (`StageModel` names), reading only the tensors it needs.

    `stage` is a stage of the checkpoint's split or a layer range of any split; `embedding` and
    `head` default to whether the range starts at layer 0 / ends at layer L. `cfg`, if given,
    must equal the checkpoint's model config. `dtype` casts tensor by tensor (no full copy).
    """
    index = read_index(path)
    if cfg is not None and cfg != index.cfg:
        diff = {k: (v, index.cfg.to_dict()[k]) for k, v in cfg.to_dict().items() if index.cfg.to_dict()[k] != v}
        raise ValueError(f"checkpoint {index.path} was made for a different model config: "
                         f"(expected, checkpoint) = {diff}")
    if not 0 <= tp_rank < index.tp:
        raise ValueError(f"tp rank {tp_rank} does not exist: the checkpoint has tp={index.tp}")
    layers, embedding, head = resolve_stage(index, stage, embedding, head)
    expected = expected_shapes(index.cfg, layers, embedding, head, index.tp)
    state = {}
    for name, shape in expected.items():
        source = EMBEDDING_KEY if name == OUTPUT_KEY and index.cfg.tie_embeddings else name
        shard, entry = index.locate(source, tp_rank)
        if entry.shape != shape:
            raise ValueError(f"checkpoint {index.path}: tensor {source} has shape {entry.shape}, "
                             f"the model config needs {shape}")
        t = _read_tensor(index, shard, source, entry, verify)
        state[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
    return state


def load_stage_model(path: str | Path, stage: int | range, embedding: bool | None = None,
                     head: bool | None = None, *, device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None, verify: bool = True):
    """Build a `StageModel` for one stage and load it; nothing is allocated twice."""
    from spd_engine.engine.model.model import StageModel

    index = read_index(path)
    layers, embedding, head = resolve_stage(index, stage, embedding, head)
    state = load_stage_state(path, layers, embedding, head, dtype=dtype, verify=verify)
    model = StageModel(index.cfg, layers, embedding=embedding, head=head, device="meta")
    model.load_state_dict(state, assign=True)
    return model.to(device)


def load_tp_stage_state(path: str | Path, layers: range, embedding: bool, head: bool, tp: int, tp_rank: int, *,
                        cfg: ModelConfig | None = None, dtype: torch.dtype | None = None,
                        verify: bool = True) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank` of `tp`'s state dict of a layer range, from a checkpoint of any TP split
    that the runtime split is compatible with (engine/model/tp_shard.py `reshard_piece`: the pieces of
    one tensor are read, merged and re-sharded one tensor at a time, only those needed)."""
    index = read_index(path)
    if cfg is not None and cfg != index.cfg:
        raise ValueError(f"checkpoint {index.path} was made for a different model config")
    check_tp(index.cfg, tp)
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp rank {tp_rank} does not exist at tp={tp}")
    state = {}
    for name, shape in expected_shapes(index.cfg, layers, embedding, head, tp).items():
        source = EMBEDDING_KEY if name == OUTPUT_KEY and index.cfg.tie_embeddings else name

        def read(r: int, source=source) -> torch.Tensor:
            shard, entry = index.locate(source, r)
            return _read_tensor(index, shard, source, entry, verify)

        t = reshard_piece(source, read, index.cfg, index.tp, tp, tp_rank)
        if tuple(t.shape) != shape:
            raise ValueError(f"checkpoint {index.path}: tensor {source} gives a TP piece of shape "
                             f"{tuple(t.shape)}, rank {tp_rank} of tp={tp} needs {shape}")
        state[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
    return state
