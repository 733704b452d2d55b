"""Model configuration: a validated, explicit description of a Llama-family target model.

One object describes Llama (incl. llama3 RoPE scaling), Mistral (Llama-shaped), Qwen2 (QKV bias)
and Qwen3 (q/k norm), and the Megatron-LM GPT models shaped like them (`linear_bias`: Megatron's
default biases on every linear layer; `norm`: LayerNorm with a bias as well as RMSNorm; `norm_1p`:
Megatron's apply_layernorm_1p; `activation`: a GeLU MLP as well as SwiGLU; `rotary_percent`: RoPE on
the first part of each head only). It is built from an HF `config.json` dict (read exactly or refused:
engine/model/hf_config.py) and written back to one, and it is what every
checkpoint index records, so a stage, a PDM head and a converted checkpoint can be checked
against the model they were made for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from spd_engine.engine.model.hf_config import read_hf_fields

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")
# Megatron-LM variants no HF family of the engine describes, with the value that means "not used"
MEGATRON_ONLY = {"norm": "rmsnorm", "norm_1p": False, "activation": "swiglu", "rotary_percent": 1.0}
# fields to_dict leaves out at their default (configs written before they existed hash the same)
LATER_FIELDS = {"linear_bias": False, **MEGATRON_ONLY}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    max_position: int = 8192
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    # Megatron's add_bias_linear: biases on linear_proj, linear_fc1 and linear_fc2 as well (with qkv_bias)
    linear_bias: bool = False
    # Megatron-LM GPT variants (no HF family of the engine describes them; to_hf refuses them):
    norm: str = "rmsnorm"  # every norm (layers, final, q/k): "rmsnorm" or "layernorm" (with a bias); eps = rms_eps
    norm_1p: bool = False  # apply_layernorm_1p: norm weights stored as gamma - 1, the norm scales by 1 + w
    activation: str = "swiglu"  # "swiglu" (fc1 = gate on up), "gelu" (erf) or "gelu_tanh": fc1 -> act -> fc2
    rotary_percent: float = 1.0  # RoPE on the first int(head_dim * rotary_percent) dims of each head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; supported: {sorted(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        if self.linear_bias and not self.qkv_bias:
            raise ValueError("model config: linear_bias (Megatron's add_bias_linear) biases every linear layer, "
                             "linear_qkv included: it needs qkv_bias")
        if self.norm not in NORMS:
            raise ValueError(f"model config: norm must be one of {NORMS}, got {self.norm!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model config: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not (isinstance(self.rotary_percent, (int, float)) and 0 < self.rotary_percent <= 1):
            raise ValueError(f"model config: rotary_percent must be in (0, 1], got {self.rotary_percent!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"model config: rotary_percent={self.rotary_percent} rotates {self.rotary_dim} of "
                             f"head_dim={self.head_dim} dims; RoPE needs an even, positive number")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "llama3") != "llama3":
            raise ValueError(f"model config: unsupported rope_scaling {self.rope_scaling!r} (only llama3)")

    @property
    def q_per_group(self) -> int:
        """Query heads per KV head (query group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones; megatron-core's int(kv_channels * rotary_percent))."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def gated(self) -> bool:
        """Whether linear_fc1 holds a gate and an up projection ([2 I, H]) rather than one ([I, H])."""
        return self.activation == "swiglu"

    @property
    def qkv_rows(self) -> int:
        """Output rows of the fused QKV projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    # ---- HF config.json ----
    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From an HF config.json dict, either form transformers writes (ValueError naming a field we cannot run)."""
        return cls(**read_hf_fields(cfg))

    def to_hf(self, rope_form: str = "legacy") -> dict:
        """An HF config.json dict. rope_form "legacy" writes top-level rope_theta / rope_scaling (read by
        transformers 4 and 5), "parameters" the 5.x `rope_parameters` dict."""
        assert rope_form in ("legacy", "parameters"), rope_form
        beyond = [f"{f}={getattr(self, f)!r}" for f, d in MEGATRON_ONLY.items() if getattr(self, f) != d]
        if beyond:
            raise ValueError(f"no HF family the engine writes describes {', '.join(beyond)} (a Megatron-LM GPT "
                             "variant); export it with export-megatron")
        cfg = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if rope_form == "legacy":
            cfg.update(rope_theta=self.rope_theta, rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None)
        else:
            cfg["rope_parameters"] = {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}
        if self.linear_bias and self.arch != "llama":
            raise ValueError(f"an HF {self.arch} model has no biases on o_proj and the MLP; only HF llama "
                             "(attention_bias, mlp_bias) describes linear_bias")
        if self.qkv_bias and not self.linear_bias and self.arch != "qwen2":
            raise ValueError(f"an HF {self.arch} model has no q/k/v biases without an o_proj bias")
        if self.arch in ("llama", "qwen3"):
            cfg["attention_bias"] = self.linear_bias
        if self.arch == "llama":
            cfg["mlp_bias"] = self.linear_bias
        if self.arch == "mistral":
            cfg["sliding_window"] = None  # MistralConfig's default (4096) would switch it on
        if self.arch in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
        return cfg

    # ---- our own JSON (checkpoint index, PDM config) ----
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        # fields added later are written only when they differ from their default, so the fingerprints
        # and content hashes of configs written before they existed stay what they were
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"model config: unknown fields {sorted(unknown)}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def fingerprint(self) -> str:
        """Short hash of the architecture (not the weights): identifies the model shape."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    """A small random-weight config of the given family, for tests and synthetic benchmarks."""
    base = dict(arch=arch, vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=6,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_eps=1e-6, rope_theta=10000.0,
                max_position=512, tie_embeddings=arch != "llama", qkv_bias=arch == "qwen2",
                qk_norm=arch == "qwen3", bos_token_id=1, eos_token_ids=(2,))
    if arch == "llama":
        base["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    base.update(overrides)
    return ModelConfig(**base)
