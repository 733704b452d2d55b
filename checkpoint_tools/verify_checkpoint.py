"""Compare two checkpoints by their logits: any mix of HF directory, engine checkpoint, Megatron torch_dist.

Each side's logits come from a reference that does not share the engine's reading of that format,
where one is installed (`reference="auto"`): an HF directory runs in transformers, a Megatron
checkpoint in megatron-core's own GPTModel with its own checkpoint loader
(checkpoint_tools/megatron_reference.py). So `verify MEGATRON_DIR ENGINE_DIR` checks the importer
rather than reading both sides through it. An engine checkpoint, and a side whose reference is not
installed (or, for Megatron, cannot compute the model), runs in the engine's `StageModel` (fp32),
and the summary says which reference computed each side. `reference="engine"` runs both in the
engine. Both run the same prompts (deterministic random token ids by default), compared position
by position: max abs logit difference and argmax agreement; `passed` says whether the difference
is within tolerance.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spd_engine.checkpoint_tools import hf, key_maps, megatron_dcp, megatron_reference, shard
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import ModelConfig


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


REFERENCES = ("auto", "engine")
Logits = Callable[[list[list[int]]], list[torch.Tensor]]  # prompts -> [T, >= V] logits per prompt


@dataclass(frozen=True)
class Side:
    """One checkpoint to compare: its model config, which reference computes it, and how."""

    cfg: ModelConfig
    source: str
    logits: Logits


def _engine_side(path: str | Path, hf_config: str | Path | None, note: str = "") -> Side:
    cfg, state = load_any(path, hf_config)
    model = build_model(cfg, state)
    return Side(cfg, "engine" + note, lambda prompts: [prompt_logits(model, p) for p in prompts])


def _transformers_side(path: str | Path) -> Side:
    import transformers

    cfg = hf.read_hf_config(path)[0]  # refuses what the engine cannot compute, as the other side would
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).float().eval()

    def logits(prompts: list[list[int]]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(torch.tensor([p])).logits[0].float() for p in prompts]
    return Side(cfg, "transformers", logits)


def _megatron_side(path: str | Path, hf_config: str | Path | None) -> Side | str:
    """megatron-core's own forward, or the reason it cannot compute this checkpoint."""
    mdir = megatron_dcp.checkpoint_dir(path)
    given = hf.read_hf_config(hf_config)[0] if hf_config is not None else None
    cfg = megatron_dcp.model_config(mdir, given)  # common.pt through the allowlist
    meta = megatron_dcp.SafeReader(mdir).read_metadata().state_dict_metadata  # .metadata likewise
    embedding = meta.get(ckpt.EMBEDDING_KEY)
    if embedding is None:
        return "it has no word embeddings"
    recorded = megatron_dcp.read_common(mdir).get("args")
    args = (megatron_reference.args_of_namespace(recorded) if recorded is not None
            else megatron_reference.args_of_config(cfg))
    if args is None:
        return "megatron-core hard-codes other llama3 RoPE scaling factors"
    rows = int(embedding.size[0])
    return Side(cfg, "megatron-core", lambda prompts: megatron_reference.megatron_logits(mdir, args, rows, prompts))


def _transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def load_side(path: str | Path, reference: str = "auto", hf_config: str | Path | None = None) -> Side:
    """The side of a comparison: an independent reference where one is installed and `reference` is auto."""
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
    kind = detect_kind(path)
    if reference == "engine" or kind == "engine":
        return _engine_side(path, hf_config)
    if kind == "hf":
        if _transformers_available():
            return _transformers_side(path)
        return _engine_side(path, hf_config, " (transformers is not installed)")
    if not megatron_reference.megatron_available():
        return _engine_side(path, hf_config, " (megatron-core is not installed)")
    side = _megatron_side(path, hf_config)
    return side if isinstance(side, Side) else _engine_side(path, hf_config, f" ({side})")


@dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float
    argmax_agreement: float  # fraction of positions whose argmax tokens agree
    positions: int
    atol: float
    min_agreement: float
    sources: tuple[str, str] = ("engine", "engine")

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.atol and self.argmax_agreement >= self.min_agreement

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: max |logit diff| {self.max_abs_diff:.3g} (atol {self.atol:g}), argmax agreement "
                f"{self.argmax_agreement:.4f} over {self.positions} positions (min {self.min_agreement:g}); "
                f"A by {self.sources[0]}, B by {self.sources[1]}")


def _shape(cfg: ModelConfig) -> ModelConfig:
    """The fields that make the model (token ids of BOS / EOS are the tokenizer's, not the weights')."""
    return dataclasses.replace(cfg, bos_token_id=None, eos_token_ids=())


def compare_logits(a: list[torch.Tensor], b: list[torch.Tensor], vocab: int, atol: float,
                   min_agreement: float = 1.0, sources: tuple[str, str] = ("engine", "engine")) -> VerifyResult:
    """Compare per-prompt logits over the first `vocab` ids (Megatron-LM's padding rows are not the model's)."""
    diff, agree, total = 0.0, 0, 0
    for la, lb in zip(a, b):
        la, lb = la[..., :vocab].float(), lb[..., :vocab].float()
        diff = max(diff, (la - lb).abs().max().item())
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        total += la.shape[0]
    return VerifyResult(diff, agree / total, total, atol, min_agreement, sources)


def compare_models(a: StageModel, b: StageModel, prompts: list[list[int]], atol: float,
                   min_agreement: float = 1.0) -> VerifyResult:
    if a.cfg != b.cfg:
        raise ValueError("the two checkpoints describe different models: "
                         f"{a.cfg.fingerprint()} vs {b.cfg.fingerprint()}")
    return compare_logits([prompt_logits(a, p) for p in prompts], [prompt_logits(b, p) for p in prompts],
                          a.cfg.vocab_size, atol, min_agreement)


def verify(path_a: str | Path, path_b: str | Path, *, atol: float = 1e-4, min_agreement: float = 1.0,
           hf_config: str | Path | None = None, prompt_count: int = 3, prompt_length: int = 16,
           seed: int = 0, reference: str = "auto") -> VerifyResult:
    a, b = load_side(path_a, reference, hf_config), load_side(path_b, reference, hf_config)
    if _shape(a.cfg) != _shape(b.cfg):
        raise ValueError("the two checkpoints describe different models: "
                         f"{a.cfg.fingerprint()} vs {b.cfg.fingerprint()}")
    prompts = default_prompts(a.cfg, prompt_count, min(prompt_length, a.cfg.max_position), seed)
    return compare_logits(a.logits(prompts), b.logits(prompts), a.cfg.vocab_size, atol, min_agreement,
                          (a.source, b.source))
