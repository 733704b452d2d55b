"""Megatron-LM's training args (the `args` namespace in a checkpoint's `common.pt`) -> the engine's `ModelConfig`.

Megatron-LM saves the argparse namespace it trained with; its field names are those of its command
line (`--num-query-groups` -> `num_query_groups`). `config_from_args` maps the fields that shape the
model (the table `FIELDS`, mirrored in docs/checkpoints.md) and refuses, by name, every setting the
engine's model does not compute (MoE, MLA, learned positions, interleaved RoPE, squared ReLU, ...),
so a checkpoint is read exactly or not at all. The values come from an allowlist unpickle
(checkpoint_tools/safe_unpickle.py); Megatron objects in them are inert records.
"""
from __future__ import annotations

from typing import Any

from spd_engine.engine.model.model_config import ModelConfig

# engine field <- Megatron-LM arg (the docs' table; see config_from_args for the derived ones)
FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_query_groups (when group_query_attention; else num_attention_heads)",
    "head_dim": "kv_channels (default hidden_size / num_attention_heads)",
    "vocab_size": "vocab_size, else padded_vocab_size (the padding rows are then kept)",
    "rms_eps": "norm_epsilon (older: layernorm_epsilon)",
    "rope_theta": "rotary_base",
    "rope_scaling": "use_rope_scaling, rope_scaling_factor (llama3 factors Megatron hard-codes)",
    "max_position": "max_position_embeddings, else seq_length",
    "tie_embeddings": "not untie_embeddings_and_output_weights",
    "qkv_bias": "add_qkv_bias or add_bias_linear",
    "linear_bias": "add_bias_linear (biases on linear_proj, linear_fc1, linear_fc2; Megatron-LM's default)",
    "qk_norm": "qk_layernorm",
    "norm": "normalization (RMSNorm -> rmsnorm, LayerNorm -> layernorm, with its bias)",
    "norm_1p": "apply_layernorm_1p",
    "activation": "swiglu -> swiglu; else gelu_tanh where Megatron-LM fuses the bias into GeLU (add_bias_linear "
                  "and bias_gelu_fusion: its tanh form), gelu (erf) otherwise",
    "rotary_percent": "rotary_percent",
}
# Megatron hard-codes these llama3 RoPE scaling factors (megatron/core/models/common/embeddings/rope_utils.py).
MEGATRON_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# (arg, Megatron-LM's default, the value the engine computes, what a different value is). A field an
# older namespace lacks takes Megatron-LM's default, which may well be refused (learned
# positions): guessing the engine's own value would read such a model wrongly.
_REQUIRED = (
    ("position_embedding_type", "learned_absolute", "rope", "position embeddings other than RoPE"),
    ("rotary_interleaved", False, False, "interleaved RoPE"),
    ("squared_relu", False, False, "a squared-ReLU MLP"),
    ("quick_geglu", False, False, "a quick-GeGLU MLP"),
    ("use_te_activation_func", False, False, "Transformer Engine's activation functions"),
    ("qk_l2_norm", False, False, "L2-normalised queries and keys"),
    ("num_experts", None, None, "a mixture of experts"),
    ("multi_latent_attention", False, False, "multi-latent attention (MLA)"),
    ("mtp_num_layers", None, None, "multi-token prediction layers"),
    ("window_size", None, None, "sliding-window attention"),
    ("hybrid_override_pattern", None, None, "a hybrid (Mamba) model"),
    ("heterogeneous_layers_config_path", None, None, "heterogeneous layers"),
)


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


NORMALIZATIONS = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}


def _refuse_unsupported(args: Any) -> None:
    problems = []
    if _get(args, "normalization", "LayerNorm") not in NORMALIZATIONS:
        problems.append(f"a norm other than RMSNorm or LayerNorm (normalization={_get(args, 'normalization')!r})")
    percent = _get(args, "rotary_percent", 1.0)
    if not isinstance(percent, (int, float)) or not 0 < percent <= 1:
        problems.append(f"a rotary_percent outside (0, 1] (rotary_percent={percent!r})")
    for name, megatron_default, want, what in _REQUIRED:
        got = _get(args, name, megatron_default)
        if got != want and not (want in (False, None) and not got):  # False, None and 0 all mean "off"
            problems.append(f"{what} ({name}={got!r})")
    if problems:
        raise ValueError("the checkpoint's Megatron-LM args describe a model the engine does not compute: "
                         + "; ".join(problems))


def _need_int(args: Any, name: str) -> int:
    value = _get(args, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"the checkpoint's Megatron-LM args lack a positive integer {name} (got {value!r})")
    return value


def activation(args: Any) -> str:
    """The MLP's activation as Megatron-LM computes it: SwiGLU, or GeLU whose bias fusion (Megatron-LM's
    default wherever linear layers have biases; validate_args turns it off without them) is the tanh
    form (megatron/core/fusions/fused_bias_gelu.py), while the unfused F.gelu is the erf form."""
    if _get(args, "swiglu", False):
        return "swiglu"
    biased = bool(_get(args, "add_bias_linear", True))
    return "gelu_tanh" if biased and _get(args, "bias_gelu_fusion", True) else "gelu"


def config_from_args(args: Any) -> ModelConfig:
    """The engine config of the model Megatron-LM's `args` describe (ValueError naming what it cannot run)."""
    _refuse_unsupported(args)
    heads, hidden = _need_int(args, "num_attention_heads"), _need_int(args, "hidden_size")
    kv_heads = _need_int(args, "num_query_groups") if _get(args, "group_query_attention") else heads
    vocab = _get(args, "vocab_size") or _need_int(args, "padded_vocab_size")
    eps = _get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))
    linear_bias = bool(_get(args, "add_bias_linear", True))  # Megatron-LM's default: on
    qkv_bias, qk_norm = bool(_get(args, "add_qkv_bias")) or linear_bias, bool(_get(args, "qk_layernorm"))
    rope_scaling = None
    if _get(args, "use_rope_scaling"):
        rope_scaling = {**MEGATRON_LLAMA3, "factor": float(_get(args, "rope_scaling_factor", 8.0))}
    return ModelConfig(
        # the HF family whose layout it is (HF llama's attention_bias + mlp_bias are Megatron's linear biases)
        arch="qwen3" if qk_norm else "qwen2" if qkv_bias and not linear_bias else "llama",
        vocab_size=vocab, hidden_size=hidden, intermediate_size=_need_int(args, "ffn_hidden_size"),
        num_layers=_need_int(args, "num_layers"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=_get(args, "kv_channels") or hidden // heads, rms_eps=float(eps),
        rope_theta=float(_get(args, "rotary_base", 10000)), rope_scaling=rope_scaling,
        max_position=_get(args, "max_position_embeddings") or _need_int(args, "seq_length"),
        tie_embeddings=not _get(args, "untie_embeddings_and_output_weights", False),
        qkv_bias=qkv_bias, linear_bias=linear_bias, qk_norm=qk_norm,
        norm=NORMALIZATIONS[_get(args, "normalization", "LayerNorm")],
        norm_1p=bool(_get(args, "apply_layernorm_1p", False)), activation=activation(args),
        rotary_percent=float(_get(args, "rotary_percent", 1.0)))


# Fields the weights cannot show (a wrong value still loads): checked when both args and a config exist.
_CROSS_CHECKED = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "rms_eps", "rope_theta", "rope_scaling", "tie_embeddings", "qkv_bias", "linear_bias", "qk_norm",
                  "norm", "norm_1p", "activation", "rotary_percent")


def check_config_against_args(cfg: ModelConfig, args: Any) -> None:
    """ValueError naming each field where `cfg` (an --hf-config) disagrees with the checkpoint's own args."""
    recorded = config_from_args(args)
    diffs = [f"{f}: config {getattr(cfg, f)!r}, args {getattr(recorded, f)!r}" for f in _CROSS_CHECKED
             if getattr(cfg, f) != getattr(recorded, f)]
    if diffs:
        raise ValueError("the given model config disagrees with the checkpoint's Megatron-LM args ("
                         + "; ".join(diffs) + "); leave out --hf-config to use the args")
