"""The config-form matrix: every config.json form transformers 4.57 and 5.x write for our families is
read exactly (our converted stages give transformers' logits) or refused with a message naming the field.

For each recorded form (data/hf_config_forms-{4,5}.json, see hf_config_forms.py) transformers builds a
small model from that very file, its weights are randomised with a scale that makes attention sharp
(so RoPE matters), it is saved, the recorded config.json is put back byte for byte, and
`spd convert hf2mcore` (checkpoint_tools.shard.hf2mcore) converts the directory.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hf_config_forms import DATA, FORMS, SHAPE

from spd_engine.checkpoint_tools import shard
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.hf_config import FAMILY_DEFAULTS, REQUIRED
from spd_engine.engine.model.model import rope_tables
from spd_engine.engine.model.model_config import ModelConfig

transformers = pytest.importorskip("transformers")
RECORDED = {v: json.loads((DATA / f"hf_config_forms-{v}.json").read_text()) for v in (4, 5)}
CASES = [(v, f) for v in (4, 5) for f in FORMS]
CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def hf_model_dir(path: Path, config: dict, seed: int = 0):
    """An HF directory whose config.json is `config` verbatim and whose weights transformers wrote."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # 0.02-std init leaves attention near uniform: RoPE would not show
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    0.25 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))  # the recorded form, not the one save_pretrained wrote


def engine_logits(engine_dir: Path, tokens: torch.Tensor, wrong: ModelConfig | None = None) -> torch.Tensor:
    """Logits [1, T, V] of the converted stages; `wrong` swaps in the RoPE tables of another config."""
    stages = [ckpt.load_stage_model(engine_dir, p) for p in range(2)]
    with torch.no_grad():
        h = stages[0].embed(tokens)
        for s in stages:
            if wrong is not None:
                s._rope = rope_tables(wrong, h.device)
            h = s.forward_layers(h, s.new_cache(1, tokens.shape[1]), 0)[0]
        return stages[-1].logits(h)


@pytest.mark.parametrize("version,form", CASES, ids=[f"t{v}-{f.name}" for v, f in CASES])
def test_config_form_read_exactly_or_refused(tmp_path, version, form):
    config = RECORDED[version]["forms"][form.name]
    hf_model_dir(tmp_path / "hf", config)
    if form.refused is not None:
        with pytest.raises(ValueError, match=form.refused):
            shard.hf2mcore(tmp_path / "hf", tmp_path / "e", pp=2)
        assert not (tmp_path / "e").exists()
        return
    index = shard.hf2mcore(tmp_path / "hf", tmp_path / "e", pp=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    got = engine_logits(tmp_path / "e", tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # The matrix can fail: a misread RoPE base or a dropped scaling changes these logits by far more.
    cfg = index.cfg
    wrong = (dataclasses.replace(cfg, rope_scaling=None) if cfg.rope_scaling else
             dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 50))
    assert (engine_logits(tmp_path / "e", tokens, wrong) - want).abs().max() > 100 * 1e-4 * want.abs().max()


def test_transformers_5_rope_parameters_base_is_read():
    """The reported bug: a 5.x file has no top-level rope_theta; its base is rope_parameters.rope_theta."""
    config = RECORDED[5]["forms"]["llama-llama3"]
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 500000.0
    cfg = ModelConfig.from_hf(config)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0
    assert ModelConfig.from_hf(RECORDED[4]["forms"]["llama-llama3"]) == cfg  # both forms, one model


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_family_defaults_are_transformers_defaults(family):
    """A config.json that omits optional fields means what transformers' config class fills in."""
    minimal = {"model_type": family, **{k: SHAPE[k] for k in REQUIRED}, "num_attention_heads": 32}  # 32 KV heads: Qwen
    full = getattr(transformers, CLASSES[family])(**minimal).to_dict()
    for key, value in FAMILY_DEFAULTS[family].items():
        unused = key == "sliding_window" and full.get("use_sliding_window") is False  # Qwen then stores None
        if key in full and key != "rope_theta" and value is not None and not unused:
            assert full[key] == value, key
    assert full["rope_parameters"]["rope_theta"] == FAMILY_DEFAULTS[family]["rope_theta"]
    if family == "mistral":  # its default sliding window (4096) binds below its default max positions
        minimal["sliding_window"] = full["sliding_window"] = None
    assert ModelConfig.from_hf(minimal) == ModelConfig.from_hf(full)


def test_both_rope_forms_must_agree():
    base = dict(RECORDED[5]["forms"]["llama-default"])
    assert ModelConfig.from_hf({**base, "rope_theta": 500000.0}).rope_theta == 500000.0  # agreeing copy
    with pytest.raises(ValueError, match="rope_parameters.*disagrees with rope_theta"):
        ModelConfig.from_hf({**base, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="disagrees"):  # transformers would take rope_scaling's llama3, theta 1e4
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0}})


def test_other_refusals_name_the_field():
    base = RECORDED[5]["forms"]["llama-default"]
    with pytest.raises(ValueError, match="quantization_config='gptq'"):
        ModelConfig.from_hf({**base, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="lacks the field.*hidden_size"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="model_type='gemma'"):
        ModelConfig.from_hf({**base, "model_type": "gemma"})


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("rope_form", ["legacy", "parameters"])
def test_to_hf_is_read_back_by_us_and_by_transformers(arch, rope_form):
    from spd_engine.engine.model.model_config import tiny_config

    cfg = tiny_config(arch if arch != "mistral" else "llama", rope_theta=123456.0)
    cfg = dataclasses.replace(cfg, arch=arch)
    written = cfg.to_hf(rope_form)
    assert ModelConfig.from_hf(written) == cfg
    theirs = transformers.AutoConfig.for_model(arch, **{k: v for k, v in written.items() if k != "model_type"})
    assert theirs.rope_parameters["rope_theta"] == 123456.0
    assert ModelConfig.from_hf(theirs.to_dict()) == cfg
