"""An HF `config.json` read into the fields of a ModelConfig: exactly as transformers builds the model, or refused.

Families: llama, mistral (Llama-shaped), qwen2, qwen3. Both forms transformers writes are read:
4.x puts the RoPE base top-level (`rope_theta`) and scaling under `rope_scaling`; 5.x writes
one `rope_parameters` dict (`rope_theta`, `rope_type`, ...). A field the config omits takes
the default of that family's transformers config class (`FAMILY_DEFAULTS`; a test compares
them with transformers' own). Anything that changes the maths and the engine does not
implement is a `ValueError` naming the field: a RoPE type other than default / llama3, partial
rotary, an activation other than SiLU, biases the engine has no parameter for, sliding-window
attention that can bind, quantised weights. Fields the modeling code of these families never
reads (dropout, initializer range, use_cache, ...) do not matter and are not looked at.
docs/models.md has the table.
"""
from __future__ import annotations

import math

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# transformers' config-class defaults (identical in 4.4x and 5.x) of the fields read below.
# None for num_key_value_heads / head_dim means "derived": the head count / hidden_size // heads.
_COMMON = dict(num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
               hidden_act="silu", rope_theta=10000.0)
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**_COMMON, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {**_COMMON, "num_key_value_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28, "bos_token_id": None, "eos_token_id": None},
    "qwen3": {**_COMMON, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "bos_token_id": None, "eos_token_id": None},
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
SILU_NAMES = ("silu", "swish")  # the same function in transformers' ACT2FN


def _get(cfg: dict, family: str, key: str):
    return cfg[key] if key in cfg else FAMILY_DEFAULTS[family].get(key)


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json: {field}={value!r} {why}; the engine cannot run this model exactly")


def _rope_source(cfg: dict) -> tuple[str, dict]:
    """(field name, RoPE dict with rope_theta) as transformers reads it.

    4.x reads top-level `rope_theta` and `rope_scaling` and ignores `rope_parameters`; 5.x reads
    `rope_parameters` (a non-empty `rope_scaling` wins, a top-level `rope_theta` fills a missing base).
    A file with both forms is read only when they say the same.
    """
    legacy, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for name, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise _refuse(name, value, "is not a dict")
    default_theta = FAMILY_DEFAULTS["llama"]["rope_theta"]
    v4 = {**(legacy or {}), "rope_theta": cfg.get("rope_theta", default_theta)}
    if not params:  # the 4.x form, which 5.x reads the same way
        return "rope_scaling", v4
    v5 = {**(legacy or params), "rope_theta": (legacy or params).get("rope_theta", v4["rope_theta"])}
    # both transformers versions would then ignore rope_parameters; a file contradicting itself is refused
    self_contradictory = legacy and _normal({**legacy, "rope_theta": 0}) != _normal({**params, "rope_theta": 0})
    if self_contradictory or ((legacy or "rope_theta" in cfg) and _normal(v4) != _normal(v5)):
        raise ValueError(f"config.json: rope_parameters={params!r} disagrees with rope_theta="
                         f"{cfg.get('rope_theta')!r} / rope_scaling={legacy!r}; transformers 4 and 5 would "
                         "build different models from it")
    return "rope_parameters", v5


def _normal(rope: dict) -> dict:
    """A RoPE dict with its type under one key (4.x files may still say `type`)."""
    out = {k: v for k, v in rope.items() if k != "type"}
    out["rope_type"] = _rope_type(rope)
    return out


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def read_rope(cfg: dict, max_position: int) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling dict or None)."""
    field, rope = _rope_source(cfg)
    theta = rope["rope_theta"]
    if not isinstance(theta, (int, float)) or not theta > 0:
        raise _refuse(f"{field}.rope_theta" if field == "rope_parameters" else "rope_theta", theta,
                      "is not a positive number")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse("partial_rotary_factor", partial, "rotates only part of each head (not implemented)")
    kind = _rope_type(rope)
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise _refuse(f"{field}.rope_type", kind, "is a RoPE scaling the engine does not implement "
                      "(it implements 'default' and 'llama3')")
    missing = [k for k in LLAMA3_KEYS if k not in rope]
    if missing:
        raise _refuse(field, rope, f"lacks {missing} for llama3 RoPE")
    # transformers 5 fills a missing original length from a top-level field, else max_position_embeddings
    original = cfg.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_position))
    if rope["high_freq_factor"] == rope["low_freq_factor"] or not all(rope[k] > 0 for k in LLAMA3_KEYS):
        raise _refuse(field, rope, "has llama3 factors that are not positive and distinct")
    scaling = {"rope_type": "llama3", **{k: float(rope[k]) for k in LLAMA3_KEYS},
               "original_max_position_embeddings": int(original)}
    return float(theta), scaling


def _check_sliding_window(cfg: dict, family: str, num_layers: int, max_position: int) -> None:
    """Refuse sliding-window attention that can bind within max_position_embeddings."""
    window = _get(cfg, family, "sliding_window")
    if family == "mistral":  # every layer slides when sliding_window is set
        if window is not None and window < max_position:
            raise _refuse("sliding_window", window, f"< max_position_embeddings={max_position} switches "
                          "sliding-window attention on (not implemented)")
        return
    if family not in ("qwen2", "qwen3"):
        return  # Llama's modeling code never reads sliding_window
    layer_types = cfg.get("layer_types")
    if layer_types is not None:  # the 5.x form: one entry per layer
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise _refuse("layer_types", other, "asks for attention other than full_attention (not implemented)")
        return
    if _get(cfg, family, "use_sliding_window") and window is not None and window < max_position:
        if _get(cfg, family, "max_window_layers") < num_layers:
            raise _refuse("use_sliding_window", True, f"with sliding_window={window} and max_window_layers="
                          f"{_get(cfg, family, 'max_window_layers')} < {num_layers} layers switches "
                          "sliding-window attention on (not implemented)")


def _check_maths(cfg: dict, family: str) -> None:
    act = _get(cfg, family, "hidden_act")
    if act not in SILU_NAMES:
        raise _refuse("hidden_act", act, "is not SiLU (the engine's MLP is SwiGLU)")
    if family == "qwen3" and _get(cfg, family, "attention_bias"):
        raise _refuse("attention_bias", True, "adds q/k/v/o biases without MLP biases (not implemented)")
    if family == "llama" and bool(_get(cfg, family, "attention_bias")) != bool(_get(cfg, family, "mlp_bias")):
        # the engine's linear_bias (Megatron's add_bias_linear) is both at once
        raise _refuse("attention_bias", _get(cfg, family, "attention_bias"),
                      f"differs from mlp_bias={_get(cfg, family, 'mlp_bias')!r} (the engine biases all "
                      "linear layers or none)")
    if cfg.get("quantization_config"):
        raise _refuse("quantization_config", cfg["quantization_config"].get("quant_method", "?"),
                      "means quantised weights (the engine reads float weights)")


def _positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _refuse(key, value, "is not a positive integer")
    return value


def read_hf_fields(cfg: dict) -> dict:
    """The ModelConfig fields of an HF config.json dict (ValueError naming the field it cannot run)."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"unknown architecture: model_type={family!r} architectures={cfg.get('architectures')!r}; "
                         f"supported model types: {sorted(FAMILIES)}")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks the field(s) {missing}")
    shape = {k: _positive_int(k, cfg[k]) for k in REQUIRED}
    heads = shape["num_attention_heads"]
    kv = _get(cfg, family, "num_key_value_heads") or heads
    head_dim = _get(cfg, family, "head_dim") or shape["hidden_size"] // heads
    max_position = _positive_int("max_position_embeddings", _get(cfg, family, "max_position_embeddings"))
    _check_maths(cfg, family)
    _check_sliding_window(cfg, family, shape["num_hidden_layers"], max_position)
    theta, scaling = read_rope(cfg, max_position)
    eps = _get(cfg, family, "rms_norm_eps")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise _refuse("rms_norm_eps", eps, "is not a positive number")
    eos = _get(cfg, family, "eos_token_id")
    linear_bias = family == "llama" and bool(_get(cfg, family, "attention_bias"))
    return dict(
        arch=family, vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_layers=shape["num_hidden_layers"], num_heads=heads,
        num_kv_heads=_positive_int("num_key_value_heads", kv),
        head_dim=_positive_int("head_dim", head_dim), rms_eps=float(eps), rope_theta=theta,
        rope_scaling=scaling, max_position=max_position,
        tie_embeddings=bool(_get(cfg, family, "tie_word_embeddings")),
        qkv_bias=family == "qwen2" or linear_bias, linear_bias=linear_bias, qk_norm=family == "qwen3",
        bos_token_id=_get(cfg, family, "bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
    )
