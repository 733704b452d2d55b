"""The speculation module (PDM, docs/design.md 3.5) and its checkpoint format.

Input rows: one projection per aggregation type, `W_a [H, (a+1)H]`, applied to the concatenated
anchor states `0..a` of a position. Then `K` decoder layers of the target's family (own RoPE and
KV cache), the target's frozen final norm, and a head over a draft vocabulary (a sorted subset
of target ids; default the full vocabulary). Checkpoint: `pdm.safetensors` + `pdm.json`
(n, stage layers, anchors, K, draft vocabulary, the target's config fingerprint).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spd_engine.engine.model.draft_stack import DraftStack, check_draft_vocab
from spd_engine.engine.model.head_io import HeadFormat, check_fingerprint, read_head_meta, read_head_state, save_head
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.row_invariance import Invariance, make_row_invariant_, probe_rows
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.kernels.anchor_gather import anchor_rows, pack_projection_weights, type_weight_t
from spd_engine.kernels.int8_linear import Int8Linear

PDM_FORMAT = "spd-pdm-v1"
PDM_FILES = HeadFormat("pdm", PDM_FORMAT, name="PDM", head_name="PDM head", dir_name="PDM checkpoint")


@dataclass(frozen=True)
class PDMConfig:
    stage_layers: tuple[int, ...]
    anchors: tuple[int, ...]
    num_layers: int = 1  # K
    draft_vocab: tuple[int, ...] | None = None  # sorted target ids; None = full vocabulary
    target_fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"PDM needs at least one decoder layer, got K={self.num_layers}")
        check_draft_vocab(self.draft_vocab)

    @property
    def n(self) -> int:
        return len(self.stage_layers)

    def plan(self) -> AnchorPlan:
        bounds = [0]
        for c in self.stage_layers:
            bounds.append(bounds[-1] + c)
        return AnchorPlan(tuple(bounds), self.anchors)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["draft_vocab"] = list(self.draft_vocab) if self.draft_vocab is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PDMConfig":
        dv = d.get("draft_vocab")
        return cls(tuple(d["stage_layers"]), tuple(d["anchors"]), int(d.get("num_layers", 1)),
                   tuple(dv) if dv is not None else None, d.get("target_fingerprint", ""))


class PDM(DraftStack):
    def __init__(self, target: ModelConfig, pcfg: PDMConfig, device=None, dtype=torch.float32) -> None:
        super().__init__()
        plan = pcfg.plan()
        if plan.num_layers != target.num_layers:
            raise ValueError(f"PDM stage layers {list(pcfg.stage_layers)} sum to {plan.num_layers}, "
                             f"but the target has {target.num_layers} layers")
        self.target_cfg, self.pcfg, self.plan = target, pcfg, plan
        H = target.hidden_size
        self.proj = nn.ModuleList(nn.Linear((a + 1) * H, H, bias=False, device=device, dtype=dtype)
                                  for a in range(plan.num_types))
        self.build_stack(target, pcfg.num_layers, pcfg.draft_vocab, device=device, dtype=dtype)
        self._packed: torch.Tensor | None = None
        self.rows_floor = 1  # anchor rows computed at least this many at a time (make_row_invariant)
        self.row_invariance = Invariance()

    # ---- rows ----
    def packed_projection(self) -> torch.Tensor:
        """Projection weights in the anchor-gather kernel's layout; cached (inference weights are fixed)."""
        assert not isinstance(self.proj[0], Int8Linear), "int8 projections run per type (_rows_by_type), unpacked"
        if self._packed is None or self.training:
            self._packed = pack_projection_weights([p.weight.detach() for p in self.proj])
        return self._packed

    def rows_from_ring(self, ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """ring [S, m, H], slots/types [R] -> rows [R, H] (the driver's per-tick path)."""
        if isinstance(self.proj[0], Int8Linear):
            return self._rows_by_type(ring, slots, types)
        R = slots.shape[0]
        if R < self.rows_floor:  # padded with copies of the first row's indices; their rows are dropped
            slots = torch.cat([slots, slots[:1].expand(self.rows_floor - R)])
            types = torch.cat([types, types[:1].expand(self.rows_floor - R)])
        # check_indices=False: the driver builds slots/types itself, and the check would sync the host
        return anchor_rows(ring, slots, types, self.packed_projection(), check_indices=False)[:R]

    @torch.no_grad()
    def make_row_invariant(self) -> Invariance:
        """Inference, once the weights' layout is set: each row's result the same whatever the
        other rows of a pass (engine/model/row_invariance.py): the decoder layers and draft head
        (and int8 projections) as linears, the packed projections by probing their product."""
        int8 = isinstance(self.proj[0], Int8Linear)
        # fp32 projections run packed (anchor_rows), probed below; their nn.Linear forms serve training only
        self.row_invariance = make_row_invariant_(self, skip=() if int8 else tuple(self.proj))
        if not int8:
            packed, H = self.packed_projection(), self.target_cfg.hidden_size
            for a in range(len(self.proj)):
                rows = probe_rows(lambda x: x @ type_weight_t(packed, a).float(), (a + 1) * H, torch.float32,
                                  packed.device)
                self.row_invariance.add(f"proj.{a}", rows)
                self.rows_floor = max(self.rows_floor, rows[0])
        return self.row_invariance

    def _rows_by_type(self, ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """rows_from_ring over int8 projections (a CPU: the indices are read on the host for free):
        each type's rows through its own projection, so each weight is read once."""
        kinds = types.tolist()
        out = torch.empty(len(kinds), ring.shape[-1], device=ring.device, dtype=self.compute_dtype)  # [R, H]
        for a in sorted(set(kinds)):
            idx = [r for r, t in enumerate(kinds) if t == a]
            x = ring.index_select(0, slots[idx])[:, :a + 1].flatten(1)  # [R_a, (a+1) H]
            out[idx] = self.proj[a](x)
        return out

    def use_int8_matmuls(self) -> int:
        """DraftStack's, and the anchor projections over int8 rows too (read every tick like the layers)."""
        swapped = super().use_int8_matmuls()
        self.proj = nn.ModuleList(Int8Linear.from_linear(p) for p in self.proj)
        self._packed = None
        return swapped + len(self.proj)

    def rows_of_type(self, anchors: torch.Tensor, a: int) -> torch.Tensor:
        """anchors [..., >= a+1, H] (anchor states 0..) -> rows [..., H] of type a (differentiable)."""
        x = anchors[..., : a + 1, :].flatten(-2)
        return self.proj[a](x)

    # decoder + head: new_cache, forward_rows, draft_logits (engine/model/draft_stack.py)

    # ---- initialisation ----
    @torch.no_grad()
    def init_from_target(self, target_layer: nn.Module | None, final_norm: torch.Tensor,
                         output_weight: torch.Tensor, final_norm_bias: torch.Tensor | None = None) -> "PDM":
        """Projections = identity on the deepest anchor of each type; layer(s) copied from a target
        layer when given; final norm (with its bias, a LayerNorm target's) and head rows from the target."""
        H = self.target_cfg.hidden_size
        for a, p in enumerate(self.proj):
            p.weight.zero_()
            p.weight[:, a * H:(a + 1) * H] = torch.eye(H)
        if target_layer is not None:
            for i in range(self.pcfg.num_layers):
                self.stack.decoder.layers[str(i)].load_state_dict(target_layer.state_dict())
        self.copy_target_head(final_norm, output_weight, final_norm_bias)
        self._packed = None
        return self


def save_pdm(pdm: PDM, out_dir: str | Path, extra: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write pdm.safetensors (optionally cast, e.g. float16 to halve a shipped head, or int8 rows
    with scales, engine/model/pdm_quant.py) + pdm.json."""
    return save_head(pdm, out_dir, PDM_FILES, pdm.pcfg.to_dict(), extra, dtype)


def read_pdm_config(path: str | Path) -> tuple[PDMConfig, dict]:
    meta = read_head_meta(path, PDM_FILES)
    return PDMConfig.from_dict(meta["config"]), meta


def check_pdm_matches(pcfg: PDMConfig, target: ModelConfig, stage_layers: tuple[int, ...]) -> PDMConfig:
    """The head's config for this run's split, or clear errors for a head trained for another model
    or a split it cannot serve. A head serves another split of the same n when each depth selects
    the same aggregation type there (its anchors, fixed layers, fall in the same stages): its rows,
    and so its drafts, are then the same (e.g. anchors 0, 12, 23 at 12/12 or at 14/10)."""
    check_fingerprint(pcfg.target_fingerprint, target, PDM_FILES)
    if tuple(pcfg.stage_layers) == tuple(stage_layers):
        return pcfg
    trained = f"PDM head was trained for n={pcfg.n} stages with layers {list(pcfg.stage_layers)}"
    here = f"this run uses n={len(stage_layers)} with layers {list(stage_layers)}"
    if len(stage_layers) != pcfg.n or sum(stage_layers) != sum(pcfg.stage_layers):
        raise ValueError(f"{trained}; {here}")
    moved = dataclasses.replace(pcfg, stage_layers=tuple(stage_layers))
    try:
        same = moved.plan().depth_types == pcfg.plan().depth_types
    except ValueError:  # an anchor no depth selects under the new split
        same = False
    if not same:
        raise ValueError(f"{trained}; {here}, where its anchors {list(pcfg.anchors)} fall in other stages")
    return moved


def load_pdm(path: str | Path, target: ModelConfig, stage_layers: tuple[int, ...], device=None,
             dtype=torch.float32) -> PDM:
    pcfg, _ = read_pdm_config(path)
    pcfg = check_pdm_matches(pcfg, target, stage_layers)
    pdm = PDM(target, pcfg, device=device, dtype=dtype)
    state, wpath = read_head_state(path, PDM_FILES, dtype)
    expected = pdm.state_dict()
    for k, v in expected.items():
        if k not in state:
            raise ValueError(f"PDM weights {wpath} lack tensor {k}")
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(f"PDM tensor {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    pdm.load_state_dict({k: state[k] for k in expected}, strict=True)
    return pdm.eval()


def random_pdm(target: ModelConfig, stage_layers: tuple[int, ...], num_layers: int = 1, seed: int = 0,
               anchors: tuple[int, ...] | None = None, draft_vocab: tuple[int, ...] | None = None,
               device=None, dtype=torch.float32) -> PDM:
    """An untrained head (random weights): SPD output must still be lossless with it."""
    bounds = [0]
    for c in stage_layers:
        bounds.append(bounds[-1] + c)
    plan = AnchorPlan.build(bounds, anchors)
    pcfg = PDMConfig(tuple(stage_layers), plan.anchors, num_layers, draft_vocab, target.fingerprint())
    pdm = PDM(target, pcfg, device=device, dtype=dtype)
    pdm.randomize_(seed)
    return pdm.eval()


def greedy_draft(pdm: PDM, h_last: torch.Tensor) -> int:
    """Target id of the PDM's greedy draft from its last hidden state [H]."""
    return int(pdm.draft_ids[pdm.draft_logits(h_last).argmax()])  # host sync: the id goes on the wire


def draft_probs_full(pdm: PDM, q_draft: torch.Tensor) -> torch.Tensor:
    """Scatter draft-vocabulary probabilities [Vd] into the target vocabulary [V] (zeros elsewhere)."""
    out = torch.zeros(pdm.target_cfg.vocab_size, dtype=q_draft.dtype, device=q_draft.device)
    return out.index_copy_(0, pdm.draft_ids, q_draft)

