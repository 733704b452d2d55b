"""The HF config forms of the config-form test matrix, and the script that records them.

Each form is a config class and its arguments. `python tests/checkpoint_tools/hf_config_forms.py`
writes the config.json that the installed transformers writes for every form (what
`save_pretrained` writes: `to_json_string(use_diff=True)`) to data/hf_config_forms-<major>.json.
The recorded files: transformers 5.24.0 (the test environment's) and 4.57.1, recorded with
    pip install --no-deps --target /tmp/tf4 transformers==4.57.1 huggingface-hub==0.36.0 tokenizers==0.22.1
    PYTHONPATH=/tmp/tf4 python tests/checkpoint_tools/hf_config_forms.py
`refused` names the field the engine's refusal must name; None: the form is read exactly.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


@dataclass(frozen=True)
class Form:
    name: str
    config_class: str  # transformers class name
    kwargs: dict = field(default_factory=dict)
    refused: str | None = None  # the field a refusal names


FORMS = [
    Form("llama-default", "LlamaConfig", dict(rope_theta=500000.0)),
    Form("llama-llama3", "LlamaConfig", dict(rope_theta=500000.0, rope_scaling=LLAMA3)),
    Form("llama-tied-head-dim", "LlamaConfig", dict(tie_word_embeddings=True, head_dim=32, rms_norm_eps=1e-5)),
    Form("mistral", "MistralConfig", dict(rope_theta=1e6, sliding_window=None)),
    Form("mistral-window-never-binds", "MistralConfig", dict(sliding_window=4096, max_position_embeddings=4096)),
    Form("qwen2", "Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True)),
    Form("qwen2-window-on-no-layer", "Qwen2Config", dict(use_sliding_window=True, sliding_window=4,
                                                         max_window_layers=2)),
    Form("qwen3", "Qwen3Config", dict(rope_theta=1e6, head_dim=16)),
    Form("qwen3-llama3-rope", "Qwen3Config", dict(head_dim=16, rope_scaling=LLAMA3)),
    Form("llama-linear", "LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
    Form("llama-dynamic", "LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    Form("llama-yarn", "LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 512}), "rope_type"),
    Form("llama-longrope", "LlamaConfig", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                             "long_factor": [2.0] * 8,
                                                             "original_max_position_embeddings": 512}), "rope_type"),
    Form("llama-partial-rotary", "LlamaConfig", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    Form("llama-gelu", "LlamaConfig", dict(hidden_act="gelu"), "hidden_act"),
    Form("llama-mlp-bias", "LlamaConfig", dict(mlp_bias=True), "mlp_bias"),
    Form("llama-attention-bias", "LlamaConfig", dict(attention_bias=True), "attention_bias"),
    Form("qwen3-attention-bias", "Qwen3Config", dict(head_dim=16, attention_bias=True), "attention_bias"),
    Form("mistral-sliding-window", "MistralConfig", dict(sliding_window=4), "sliding_window"),
    Form("qwen2-sliding-window", "Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
         "use_sliding_window|layer_types"),  # 4.x without layer_types names the switch, layer_types otherwise
]


def record() -> Path:
    import transformers

    out = {"transformers": transformers.__version__, "forms": {}}
    for form in FORMS:
        cls = getattr(transformers, form.config_class)
        out["forms"][form.name] = json.loads(cls(**SHAPE, **form.kwargs).to_json_string(use_diff=True))
    major = transformers.__version__.split(".")[0]
    path = DATA / f"hf_config_forms-{major}.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return path


if __name__ == "__main__":
    print(record(), file=sys.stderr)
