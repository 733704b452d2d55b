"""The decoder half that both draft heads (the PDM, engine/model/pdm.py; the EAGLE baseline head,
engine/model/eagle_head.py) run after their own input rows.

`K` decoder layers of the target's family (own RoPE and KV cache), the target's frozen final
norm, and a head over a draft vocabulary (a sorted subset of target ids; default the full
vocabulary). The pieces are attributes of the head itself (`stack`, `final_norm`, `head`,
`draft_ids`), not a submodule, so the heads' state-dict keys name them directly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from spd_engine.engine.model.kv_cache import KVCache
from spd_engine.engine.model.model import RMSNorm, StageModel, make_norm
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.kernels.int8_linear import Int8Linear, to_int8_linears_


def check_draft_vocab(draft_vocab: Sequence[int] | None) -> None:
    """A draft vocabulary is None (the full one) or a non-empty sorted list of unique target ids."""
    if draft_vocab is None:
        return
    dv = list(draft_vocab)
    if not dv or dv != sorted(set(dv)) or dv[0] < 0:
        raise ValueError("draft vocabulary must be a non-empty sorted list of unique token ids")


class DraftStack(nn.Module):
    """Base of a draft head: decoder layers + the target's final norm + a draft-vocabulary head.

    A subclass calls `nn.Module.__init__`, registers its own input layers, then `build_stack`:
    parameters are registered in that order, which fixes the state-dict order and the order in
    which `randomize_` draws its noise."""

    target_cfg: ModelConfig
    stack: StageModel
    final_norm: RMSNorm  # the target's kind (a LayerNorm subclasses RMSNorm)
    head: nn.Linear  # an Int8Linear after use_int8_matmuls
    draft_ids: torch.Tensor

    def build_stack(self, target: ModelConfig, num_layers: int, draft_vocab: tuple[int, ...] | None,
                    device=None, dtype=torch.float32) -> None:
        H = target.hidden_size
        stack_cfg = dataclasses.replace(target, num_layers=num_layers)
        self.stack = StageModel(stack_cfg, range(num_layers), device=device, dtype=dtype)
        self.final_norm = make_norm(target, H, device, dtype)
        self.final_norm.requires_grad_(False)  # the target's, frozen
        ids = torch.arange(target.vocab_size) if draft_vocab is None else torch.tensor(draft_vocab)
        if int(ids.max()) >= target.vocab_size:
            raise ValueError(f"draft vocabulary has ids >= the target vocabulary size {target.vocab_size}")
        self.head = nn.Linear(H, ids.numel(), bias=False, device=device, dtype=dtype)
        self.register_buffer("draft_ids", ids.to(device=device), persistent=False)  # [Vd] target ids

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return self.stack.new_cache(batch, capacity)

    def forward_rows(self, rows: torch.Tensor, cache: KVCache, slot0: int, positions: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """rows [B, T, H] at cache slots [slot0, slot0+T) -> hidden [B, T, H] (the stack's dtype)."""
        h, _ = self.stack.forward_layers(rows.to(self.compute_dtype), cache, slot0, positions=positions, mask=mask)
        return h

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the decoder layers and draft head (their KV cache's and hidden states' too)."""
        return self.final_norm.weight.dtype

    def use_int8_matmuls(self) -> int:
        """Inference: the decoder layers' and the draft head's matmuls over int8 weight rows with bf16
        activations (kernels/int8_linear.py); the norms run in bf16. Returns the matrices swapped."""
        self.set_compute_dtype(torch.bfloat16)
        self.head = Int8Linear.from_linear(self.head)
        return 1 + to_int8_linears_(self.stack)

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Run the decoder layers, final norm and draft head in `dtype` (inference: bfloat16 on a CPU
        with bf16 matmuls); the input rows are cast to it, the logits stay fp32."""
        for part in (self.stack, self.final_norm, self.head):
            part.to(dtype)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits over the draft vocabulary [..., Vd] (fp32)."""
        return self.head(self.final_norm(h.to(self.compute_dtype))).float()

    @torch.no_grad()
    def copy_target_head(self, final_norm: torch.Tensor, output_weight: torch.Tensor,
                         final_norm_bias: torch.Tensor | None = None) -> None:
        """The target's final norm [H] (and its bias, a LayerNorm target's) and its output rows [V, H] of
        the draft vocabulary."""
        self.final_norm.weight.copy_(final_norm)
        if final_norm_bias is not None:
            self.final_norm.bias.copy_(final_norm_bias)
        self.head.weight.copy_(output_weight[self.draft_ids.to(output_weight.device)])

    @torch.no_grad()
    def randomize_(self, seed: int) -> None:
        """Seeded random weights (norms near 1, the rest small): an untrained head, with which the
        engine's output must still be lossless."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
