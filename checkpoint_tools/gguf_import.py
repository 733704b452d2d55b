"""GGUF import: a llama.cpp GGUF file -> an HF-layout model directory.

Writes `config.json` (through `engine.model_config.ModelConfig`, so our own config class round-trips),
`model.safetensors` (float32, HF tensor names, dequantised with the `gguf` package),
`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and
`generation_config.json`. Supported: Llama- and Qwen2-architecture GGUFs with a byte-level BPE
("gpt2") vocabulary, e.g. SmolLM2 and Qwen2.5-Coder.

Three conversions are not a plain copy:
- llama.cpp stores the rows of a Llama's `attn_q` / `attn_k` permuted for its interleaved RoPE;
  `rope_unpermute` restores HF's rotate-half row order. (Its Qwen2 converter does not permute.)
- The GGUF names its pre-tokenizer (`tokenizer.ggml.pre`) instead of storing it; SmolLM2's
  ("smollm") splits every digit before the byte-level regex, Qwen2's ("qwen2") is NFC then its
  own split regex (single digits, letter runs, ...) before the byte-level step, and
  `tokenizer.json` must say so.
- Qwen2's Q, K and V biases (`attn_q.bias`, ...) become the projections' `bias` tensors.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from spd_engine.engine.model.model_config import ModelConfig

# GGUF per-layer tensor name -> HF name under `model.layers.{i}.`
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",  # absent when the embeddings are tied
}
# End-of-turn / end-of-text tokens that stop generation when the vocabulary has them.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
SUPPORTED_PRE_TOKENIZERS = ("smollm", "qwen2", "gpt2", "gpt-2", "default")
ARCHITECTURES = ("llama", "qwen2")
BIASED = ("attn_q", "attn_k", "attn_v")  # Qwen2: these projections have biases
# Qwen2's split regex, as its HF tokenizer.json states it (llama.cpp's "qwen2" pre-tokenizer)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


# ---- RoPE row permutation (pure) ----
def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved order (what llama.cpp's converter does).

    w: [n_heads * head_dim, in]. Within each head, HF rows are [x_0..x_{d/2-1}, y_0..y_{d/2-1}]
    (the two halves RoPE rotates together); llama.cpp wants them interleaved [x_0, y_0, x_1, y_1, ..].
    """
    rows = w.shape[0]
    assert rows % (2 * n_heads) == 0, f"{rows} rows do not split into {n_heads} heads of even size"
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `rope_permute`: llama.cpp interleaved rows -> HF rotate-half rows."""
    rows = w.shape[0]
    assert rows % (2 * n_heads) == 0, f"{rows} rows do not split into {n_heads} heads of even size"
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- reading ----
@dataclass
class GGUFFile:
    """An opened GGUF file: its path, metadata values and tensors by name."""

    path: Path
    reader: GGUFReader

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        if key not in self.reader.fields:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.reader.fields[key].contents()

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def tensor(self, name: str) -> np.ndarray:
        """Dequantised float32 tensor in PyTorch order ([out, in] for a linear weight)."""
        t = next((t for t in self.reader.tensors if t.name == name), None)
        if t is None:
            raise ValueError(f"{self.path}: GGUF lacks tensor {name!r}")
        try:
            data = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        except (ValueError, NotImplementedError) as err:
            raise ValueError(f"{self.path}: cannot dequantise {name} ({t.tensor_type.name}): {err}") from err
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
        if data.size != int(np.prod(shape)):
            raise ValueError(f"{self.path}: tensor {name} holds {data.size} values, expected {shape}")
        return np.ascontiguousarray(data.reshape(shape), dtype=np.float32)


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and parse a GGUF file; a missing, truncated or corrupt file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable GGUF file (corrupt or truncated): {err}") from err
    for t in reader.tensors:  # a truncated file can parse its header but not its data
        if t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: tensor {t.name} is truncated ({t.data.nbytes} of {t.n_bytes} bytes)")
    return GGUFFile(path, reader)


# ---- config ----
def eos_token_ids(g: GGUFFile) -> tuple[int, ...]:
    """The GGUF's eos / eot ids, then every known end token the vocabulary has, without repeats."""
    tokens = g.require("tokenizer.ggml.tokens")
    ids = [int(g.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if g.has(k)]
    index = {tok: i for i, tok in enumerate(tokens)}
    ids += [index[t] for t in END_TOKENS if t in index]
    return tuple(dict.fromkeys(ids))


def f32_value(v: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747e-06 -> 1e-05), as HF configs write it."""
    return float(str(np.float32(v)))


def model_config(g: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata."""
    arch = g.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{g.path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    if "rope_freqs.weight" in g.tensor_names() or g.has(f"{arch}.rope.scaling.type"):
        raise ValueError(f"{g.path}: GGUF RoPE scaling is not supported by the importer")
    hidden = int(g.require(f"{arch}.embedding_length"))
    heads = int(g.require(f"{arch}.attention.head_count"))
    tokens = g.require("tokenizer.ggml.tokens")
    bos = g.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(g.get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(g.require(f"{arch}.feed_forward_length")),
        num_layers=int(g.require(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(g.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(g.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_eps=f32_value(g.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=f32_value(g.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(g.get(f"{arch}.context_length", 8192)),
        tie_embeddings="output.weight" not in g.tensor_names(),
        qkv_bias=arch == "qwen2",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_token_ids(g),
    )


# ---- weights ----
def hf_state_dict(g: GGUFFile, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """All weights, float32, HF names; a Llama's attn_q / attn_k rows back in HF RoPE order."""
    names = g.tensor_names()
    state: dict[str, np.ndarray] = {}
    for src, dst in GLOBAL_TENSORS.items():
        if f"{src}.weight" in names:
            state[f"{dst}.weight"] = g.tensor(f"{src}.weight")
    permuted = cfg.arch == "llama"
    for i in range(cfg.num_layers):
        for src, dst in LAYER_TENSORS.items():
            w = g.tensor(f"blk.{i}.{src}.weight")
            if permuted and src == "attn_q":
                w = rope_unpermute(w, cfg.num_heads)
            elif permuted and src == "attn_k":
                w = rope_unpermute(w, cfg.num_kv_heads)
            state[f"model.layers.{i}.{dst}.weight"] = w
            if cfg.qkv_bias and src in BIASED:
                state[f"model.layers.{i}.{dst}.bias"] = g.tensor(f"blk.{i}.{src}.bias")
    check_shapes(g.path, state, cfg)
    return state


def check_shapes(path: Path, state: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Every tensor has the shape the config implies (catches metadata / tensor mismatches)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    want = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_embeddings:
        want["lm_head.weight"] = (cfg.vocab_size, h)
    per_layer = {"self_attn.q_proj": (cfg.num_heads * d, h), "self_attn.k_proj": (cfg.num_kv_heads * d, h),
                 "self_attn.v_proj": (cfg.num_kv_heads * d, h), "self_attn.o_proj": (h, cfg.num_heads * d),
                 "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
                 "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    for i in range(cfg.num_layers):
        want.update({f"model.layers.{i}.{k}.weight": v for k, v in per_layer.items()})
        if cfg.qkv_bias:
            want.update({f"model.layers.{i}.self_attn.{k}_proj.bias": (rows,) for k, rows in
                         (("q", cfg.num_heads * d), ("k", cfg.num_kv_heads * d), ("v", cfg.num_kv_heads * d))})
    for name, shape in want.items():
        got = state[name].shape if name in state else None
        if got != shape:
            raise ValueError(f"{path}: tensor {name} has shape {got}, the metadata implies {shape}")


# ---- tokenizer ----
def pre_tokenizer(g: GGUFFile) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` name stands for."""
    pre = g.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # llama.cpp: "\p{N}" split first, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":  # its own split regex, then bytes (as Qwen2's tokenizer.json)
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                                        use_regex=False)])
    if pre in SUPPORTED_PRE_TOKENIZERS:
        return byte_level
    raise ValueError(f"{g.path}: pre-tokenizer {pre!r} is not supported (supported: {SUPPORTED_PRE_TOKENIZERS})")


def build_tokenizer(g: GGUFFile) -> Tokenizer:
    """A `tokenizers` byte-level BPE tokenizer from the GGUF vocabulary, merges and token types."""
    kind = g.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{g.path}: tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)")
    tokens = g.require("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
    merges = []
    for m in g.require("tokenizer.ggml.merges"):
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{g.path}: malformed BPE merge {m!r}")
        merges.append((parts[0], parts[1]))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer(g)
    if g.get("tokenizer.ggml.pre") == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def token_name(g: GGUFFile, key: str) -> str | None:
    """The token string for a `tokenizer.ggml.*_token_id` entry, or None."""
    if not g.has(key):
        return None
    return g.require("tokenizer.ggml.tokens")[int(g.get(key))]


def tokenizer_files(g: GGUFFile, cfg: ModelConfig) -> dict[str, dict]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json contents."""
    tokens, types = g.require("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.token_type", [])
    control = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    special = {"bos_token": token_name(g, "tokenizer.ggml.bos_token_id"),
               "eos_token": token_name(g, "tokenizer.ggml.eos_token_id"),
               "unk_token": token_name(g, "tokenizer.ggml.unknown_token_id"),
               "pad_token": token_name(g, "tokenizer.ggml.padding_token_id")}
    special = {k: v for k, v in special.items() if v is not None}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(g.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position,
        **special,
        "additional_special_tokens": control,
    }
    template = g.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    if g.has("tokenizer.ggml.padding_token_id"):
        generation["pad_token_id"] = int(g.get("tokenizer.ggml.padding_token_id"))
    return {"tokenizer_config.json": tokenizer_config,
            "special_tokens_map.json": {**special, "additional_special_tokens": control},
            "generation_config.json": generation}


# ---- entry point ----
def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> ModelConfig:
    """Convert `gguf_path` into an HF directory at `out_dir` (created); returns the model config."""
    g = open_gguf(gguf_path)
    cfg = model_config(g)
    tokenizer = build_tokenizer(g)  # before the weights: a bad vocabulary fails fast
    if tokenizer.get_vocab_size() != cfg.vocab_size:
        raise ValueError(f"{g.path}: vocabulary has {tokenizer.get_vocab_size()} tokens, "
                         f"the model {cfg.vocab_size}")
    state = hf_state_dict(g, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    files = {"config.json": cfg.to_hf(), **tokenizer_files(g, cfg)}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return cfg
