"""Compare two checkpoints by their logits: any mix of HF directory, engine checkpoint, Megatron torch_dist.

Both are loaded unsharded into the engine's `StageModel` (fp32 compute), run on the same prompts
(deterministic random token ids by default), and compared position by position: max abs logit
difference and argmax agreement. `passed` says whether the difference is within tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spd_engine.checkpoint_tools import hf, key_maps, megatron_dcp, shard
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.model import StageModel


def detect_kind(path: str | Path) -> str:
    """'engine', 'megatron' or 'hf'."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"checkpoint path {p} does not exist")
    if (p / ckpt.INDEX_FILE).is_file():
        return "engine"
    if megatron_dcp.is_megatron_dir(p):
        return "megatron"
    if (p / hf.CONFIG_FILE).is_file():
        return "hf"
    raise ValueError(f"{p} is neither an engine checkpoint ({ckpt.INDEX_FILE}), a Megatron torch_dist "
                     f"checkpoint (metadata.json) nor an HF directory ({hf.CONFIG_FILE})")


def load_any(path: str | Path, hf_config: str | Path | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, unsharded engine state dict) of a checkpoint of any supported kind.

    `hf_config` (a directory with config.json) describes a Megatron checkpoint that records no config.
    """
    kind = detect_kind(path)
    if kind == "engine":
        return shard.read_engine(path)
    if kind == "megatron":
        cfg = hf.read_hf_config(hf_config)[0] if hf_config is not None else None
        return megatron_dcp.import_megatron(path, cfg)
    cfg, _ = hf.read_hf_config(path)
    return cfg, key_maps.hf_to_mcore(hf.read_hf_state(path), cfg)


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> StageModel:
    """Full-model `StageModel` in fp32 holding `state` (no second allocation for fp32 input)."""
    model = StageModel.full(cfg, device="meta")
    model.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    return model.eval()


def default_prompts(cfg: ModelConfig, count: int = 3, length: int = 16, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


@torch.no_grad()
def prompt_logits(model: StageModel, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] (fp32) of every position of one prompt."""
    tokens = torch.tensor([prompt])  # [1, T]
    cache = model.new_cache(1, len(prompt))
    h, _ = model.forward_layers(model.embed(tokens), cache, 0)
    return model.logits(h)[0]


@dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float
    argmax_agreement: float  # fraction of positions whose argmax tokens agree
    positions: int
    atol: float
    min_agreement: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.atol and self.argmax_agreement >= self.min_agreement

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: max |logit diff| {self.max_abs_diff:.3g} (atol {self.atol:g}), argmax agreement "
                f"{self.argmax_agreement:.4f} over {self.positions} positions (min {self.min_agreement:g})")


def compare_models(a: StageModel, b: StageModel, prompts: list[list[int]], atol: float,
                   min_agreement: float = 1.0) -> VerifyResult:
    if a.cfg != b.cfg:
        raise ValueError("the two checkpoints describe different models: "
                         f"{a.cfg.fingerprint()} vs {b.cfg.fingerprint()}")
    diff, agree, total = 0.0, 0, 0
    for prompt in prompts:
        la, lb = prompt_logits(a, prompt), prompt_logits(b, prompt)
        diff = max(diff, (la - lb).abs().max().item())
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        total += len(prompt)
    return VerifyResult(diff, agree / total, total, atol, min_agreement)


def verify(path_a: str | Path, path_b: str | Path, *, atol: float = 1e-4, min_agreement: float = 1.0,
           hf_config: str | Path | None = None, prompt_count: int = 3, prompt_length: int = 16,
           seed: int = 0) -> VerifyResult:
    cfg_a, state_a = load_any(path_a, hf_config)
    cfg_b, state_b = load_any(path_b, hf_config)
    a, b = build_model(cfg_a, state_a), build_model(cfg_b, state_b)
    prompts = default_prompts(cfg_a, prompt_count, min(prompt_length, cfg_a.max_position), seed)
    return compare_models(a, b, prompts, atol, min_agreement)
