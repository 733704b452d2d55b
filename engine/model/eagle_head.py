"""The EAGLE-3-style draft head of the serial baseline (`--mode eagle`, docs/design.md 3.10) and its
checkpoint format.

Input row of position t: the target's raw hidden states after three layers (low, mid, high) at t,
concatenated and fused by one linear to H, then `[embedding(x_{t+1}); fused]` through a second
linear to H. One decoder layer of the target's family (own RoPE and KV cache), the target's
frozen final norm and a head over a draft vocabulary (a sorted subset of target ids, as the
PDM's) give the draft of x_{t+2}. Later draft steps of a chain put the head's own hidden output
in place of the fused target features (EAGLE-3's training-time test). The token embedding is
the target's own (frozen), passed in, so the head does not carry a copy of it.
Checkpoint: `eagle.safetensors` + `eagle.json` (feature layers, draft vocabulary, the target's
config fingerprint).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spd_engine.engine.model.draft_stack import DraftStack, check_draft_vocab
from spd_engine.engine.model.head_io import HeadFormat, check_fingerprint, read_head_meta, read_head_state, save_head
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import ModelConfig

EAGLE_FORMAT = "spd-eagle-v1"
EAGLE_FILES = HeadFormat("eagle", EAGLE_FORMAT, name="EAGLE head", head_name="EAGLE head", dir_name="EAGLE head")


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / mid / high choice (HF hidden_states 2, L/2 and L-3): the outputs of layers
    1, L/2 - 1 and L - 4; on models under 8 layers the first, middle and last layer."""
    L = num_layers
    if L >= 8:
        return 1, L // 2 - 1, L - 4
    return 0, (L - 1) // 2, L - 1


@dataclass(frozen=True)
class EagleConfig:
    feature_layers: tuple[int, int, int]  # target layers whose raw outputs are fused (low, mid, high)
    draft_vocab: tuple[int, ...] | None = None  # sorted target ids; None = full vocabulary
    target_fingerprint: str = ""

    def __post_init__(self) -> None:
        fl = tuple(self.feature_layers)
        if len(fl) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in fl):
            raise ValueError(f"EAGLE head needs three feature layers (low, mid, high), got {list(fl)}")
        if list(fl) != sorted(fl):
            raise ValueError(f"feature layers must be in order low <= mid <= high, got {list(fl)}")
        check_draft_vocab(self.draft_vocab)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        d["draft_vocab"] = list(self.draft_vocab) if self.draft_vocab is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        dv = d.get("draft_vocab")
        return cls(tuple(int(x) for x in d["feature_layers"]), tuple(dv) if dv is not None else None,
                   d.get("target_fingerprint", ""))


class EagleHead(DraftStack):
    def __init__(self, target: ModelConfig, ecfg: EagleConfig, device=None, dtype=torch.float32) -> None:
        super().__init__()
        if ecfg.feature_layers[-1] >= target.num_layers:
            raise ValueError(f"feature layer {ecfg.feature_layers[-1]} is outside the target's "
                             f"{target.num_layers} layers")
        self.target_cfg, self.ecfg = target, ecfg
        H = target.hidden_size
        kw = dict(bias=False, device=device, dtype=dtype)
        self.fuse = nn.Linear(3 * H, H, **kw)  # [low; mid; high] -> fused feature
        self.inp = nn.Linear(2 * H, H, **kw)  # [embedding; feature] -> decoder input
        self.build_stack(target, 1, ecfg.draft_vocab, device=device, dtype=dtype)

    @property
    def feature_layers(self) -> frozenset[int]:
        return frozenset(self.ecfg.feature_layers)

    def fused(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's captured layer outputs {layer: [..., H]} -> fused features [..., H]."""
        return self.fuse(torch.cat([captured[i] for i in self.ecfg.feature_layers], dim=-1))

    def rows(self, emb: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """emb, feature [..., H] -> decoder input rows [..., H]."""
        return self.inp(torch.cat([emb, feature], dim=-1))

    # new_cache, forward_rows (whose hidden output is the next draft step's feature) and
    # draft_logits: engine/model/draft_stack.py

    @torch.no_grad()
    def init_from_target(self, target: StageModel, layer: int = -1) -> "EagleHead":
        """Fuse = identity on the high feature, input = embedding + feature, the decoder layer
        copied from a target layer, final norm and head rows from the target: a start for training."""
        H = self.target_cfg.hidden_size
        self.fuse.weight.zero_()
        self.fuse.weight[:, 2 * H:] = torch.eye(H)
        self.inp.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1))
        src = target.decoder.layers[str(layer % target.cfg.num_layers)]
        self.stack.decoder.layers["0"].load_state_dict(src.state_dict())
        norm = target.decoder.final_layernorm
        self.copy_target_head(norm.weight, target.output_weight(), getattr(norm, "bias", None))
        return self


def save_eagle(head: EagleHead, out_dir: str | Path, extra: dict | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """Write eagle.safetensors (optionally cast; torch.int8: int8 rows with fp16 scales,
    engine/model/pdm_quant.py) + eagle.json."""
    return save_head(head, out_dir, EAGLE_FILES, head.ecfg.to_dict(), extra, dtype)


def read_eagle_config(path: str | Path) -> tuple[EagleConfig, dict]:
    meta = read_head_meta(path, EAGLE_FILES)
    return EagleConfig.from_dict(meta["config"]), meta


def check_eagle_matches(ecfg: EagleConfig, target: ModelConfig) -> None:
    """A clear error for a head trained for another model."""
    check_fingerprint(ecfg.target_fingerprint, target, EAGLE_FILES)


def load_eagle(path: str | Path, target: ModelConfig, device=None, dtype=torch.float32) -> EagleHead:
    ecfg, _ = read_eagle_config(path)
    check_eagle_matches(ecfg, target)
    head = EagleHead(target, ecfg, device=device, dtype=dtype)
    state, wpath = read_head_state(path, EAGLE_FILES, dtype)  # int8 rows + scales, or as stored
    expected = head.state_dict()
    for k, v in expected.items():
        if k not in state or tuple(state[k].shape) != tuple(v.shape):
            got = tuple(state[k].shape) if k in state else "missing"
            raise ValueError(f"EAGLE head tensor {k}: {got}, expected {tuple(v.shape)} ({wpath})")
    head.load_state_dict({k: state[k] for k in expected}, strict=True)
    return head.eval()


def random_eagle(target: ModelConfig, seed: int = 0, feature_layers: tuple[int, int, int] | None = None,
                 draft_vocab: tuple[int, ...] | None = None, device=None, dtype=torch.float32) -> EagleHead:
    """An untrained head (random weights): eagle output must still be lossless with it."""
    layers = feature_layers or default_feature_layers(target.num_layers)
    head = EagleHead(target, EagleConfig(layers, draft_vocab, target.fingerprint()), device=device, dtype=dtype)
    head.randomize_(seed)
    return head.eval()
