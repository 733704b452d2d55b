"""Llama-family decoder blocks with Megatron-core parameter names and tensor layouts.

Parameter names are the checkpoint keys (`StageModel.state_dict()` == engine checkpoint keys):
  embedding.word_embeddings.weight                              [V, H]
  decoder.layers.{i}.input_layernorm.weight                     [H]
  decoder.layers.{i}.self_attention.linear_qkv.weight           [(nh + 2 nkv) hd, H], fused per
      query group: for each KV head g, its q heads, then k_g, then v_g  (.bias for Qwen2)
  decoder.layers.{i}.self_attention.q_layernorm.weight / k_layernorm.weight   [hd] (Qwen3)
  decoder.layers.{i}.self_attention.linear_proj.weight          [H, nh hd]
  decoder.layers.{i}.pre_mlp_layernorm.weight                   [H]
  decoder.layers.{i}.mlp.linear_fc1.weight                      [2 I, H] gate stacked on up (SwiGLU);
                                                                [I, H] for a GeLU MLP
  decoder.layers.{i}.mlp.linear_fc2.weight                      [H, I]
  with `linear_bias` (Megatron's add_bias_linear) also linear_proj / linear_fc1 / linear_fc2 .bias
      [H], [2 I] (gate on up) or [I], [H]
  decoder.final_layernorm.weight, output_layer.weight           [H], [V, H]
  with norm="layernorm" every norm (...layernorm) has a .bias as well; with norm_1p its weight is
      stored as gamma - 1 (Megatron's apply_layernorm_1p)
Layer indices are global. A `StageModel` builds only the layers it owns (plus the embedding
and/or final norm + head where asked), so no process materialises layers it does not run.
Every code path (reference decoder, stages, baselines, PDM) runs the same `DecoderLayer`
with the same shapes, so hidden states agree bit for bit between them on one device, given
weights at the same addresses modulo 64 bytes, the same thread count (a BLAS library may
pick its kernel by either; docs/testing.md) and the same weight layout (engine/model/linear.py).
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from spd_engine.engine.model.kv_cache import KVCache, RowCaches
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.kernels.screened_argmax import ScreenedHead


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [rd/2] of the rotated dims rd (the head's, or its first part with
    rotary_percent < 1, as megatron-core's RotaryEmbedding), with llama3 frequency scaling when configured."""
    hd = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_position, rd] in fp32 (HF convention: halves, rotate_half); rd = cfg.rotary_dim."""
    inv_freq = rope_inv_freq(cfg).to(device)
    pos = torch.arange(cfg.max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd]; cos/sin [B, T, rd] gathered at the token positions. With rd < hd (partial
    RoPE) the first rd dims are rotated (over their own halves) and the rest pass unchanged."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm; `one_p`: the weight is stored as gamma - 1 (Megatron's apply_layernorm_1p)."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None, one_p: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 0.0 if one_p else 1.0, device=device, dtype=dtype))
        self.eps, self.one_p = eps, one_p

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.one_p else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.gamma(), self.eps)


class LayerNorm(RMSNorm):
    """LayerNorm with a bias (Megatron's normalization=LayerNorm); `one_p` as RMSNorm's."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None, one_p: bool = False) -> None:
        super().__init__(dim, eps, device, dtype, one_p)
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.gamma(), self.bias, self.eps)


def make_norm(cfg: ModelConfig, dim: int, device=None, dtype=None) -> RMSNorm:
    """The norm every place of this model uses (layers, final, q/k): cfg.norm, cfg.norm_1p, eps cfg.rms_eps."""
    cls = LayerNorm if cfg.norm == "layernorm" else RMSNorm
    return cls(dim, cfg.rms_eps, device, dtype, one_p=cfg.norm_1p)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        kw = dict(device=device, dtype=dtype)
        self.linear_qkv = nn.Linear(cfg.hidden_size, cfg.qkv_rows, bias=cfg.qkv_bias, **kw)
        self.linear_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.linear_bias, **kw)
        if cfg.qk_norm:
            self.q_layernorm = make_norm(cfg, cfg.head_dim, **kw)
            self.k_layernorm = make_norm(cfg, cfg.head_dim, **kw)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache, slot0: int, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, H]; writes K/V into cache slots [slot0, slot0 + T) and attends to [0, slot0 + T)."""
        cfg = self.cfg
        B, T, _ = x.shape
        qpg, hd = cfg.q_per_group, cfg.head_dim
        qkv = self.linear_qkv(x).view(B, T, cfg.num_kv_heads, qpg + 2, hd)
        q = qkv[:, :, :, :qpg].reshape(B, T, cfg.num_heads, hd)
        k, v = qkv[:, :, :, qpg], qkv[:, :, :, qpg + 1]  # [B, T, nkv, hd]
        if cfg.qk_norm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, RowCaches):  # one token of each of several requests (kv_cache.py)
            out = cache.attend(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cfg.q_per_group > 1)
            return self.linear_proj(out.transpose(1, 2).reshape(B, T, cfg.num_heads * hd))
        keys, values = cache.write(layer, slot0, k.transpose(1, 2), v.transpose(1, 2))  # [B, nkv, S, hd]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=cfg.q_per_group > 1)  # [B, nh, T, hd]
        return self.linear_proj(out.transpose(1, 2).reshape(B, T, cfg.num_heads * hd))


class MLP(nn.Module):
    """SwiGLU (fc1 = gate stacked on up) or a plain GeLU MLP (fc1 -> gelu -> fc2; erf or tanh form)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        rows = (2 if cfg.gated else 1) * cfg.intermediate_size
        self.linear_fc1 = nn.Linear(cfg.hidden_size, rows, bias=cfg.linear_bias, **kw)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias, **kw)
        self.activation = cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = self.linear_fc1(x).chunk(2, dim=-1)
            return self.linear_fc2(F.silu(gate) * up)
        approximate = "tanh" if self.activation == "gelu_tanh" else "none"
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=approximate))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, device, dtype)
        self.self_attention = SelfAttention(cfg, device, dtype)
        self.pre_mlp_layernorm = make_norm(cfg, cfg.hidden_size, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, x, layer, cache, slot0, cos, sin, mask, out: torch.Tensor | None = None):
        """out: where the layer's output goes (the last residual add writes it), else a new tensor."""
        h = x + self.reduce(self.self_attention(self.input_layernorm(x), layer, cache, slot0, cos, sin, mask))
        m = self.reduce(self.mlp(self.pre_mlp_layernorm(h)))
        return h + m if out is None else torch.add(h, m, out=out)

    @staticmethod
    def reduce(partial: torch.Tensor) -> torch.Tensor:
        """Identity; a tensor-parallel layer sums the row-parallel partial outputs over its TP
        group here (engine/model/tp_model.py sets it per layer)."""
        return partial


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        # nn.Embedding's own init of a meta tensor goes through torch._refs, whose first call imports
        # torch._dynamo (about 2.5 s); a model built on meta is loaded by assignment, so it gets none
        weight = (torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta", dtype=dtype)
                  if device is not None and torch.device(device).type == "meta" else None)
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype,
                                            _weight=weight)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: range, head: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, device, dtype) for i in layers})
        if head:
            self.final_layernorm = make_norm(cfg, cfg.hidden_size, device, dtype)


def causal_mask(slot0: int, T: int, device: torch.device) -> torch.Tensor | None:
    """Bool mask [T, slot0 + T] letting token i see slots <= slot0 + i; None for one token."""
    if T == 1:
        return None
    cols = torch.arange(slot0 + T, device=device)
    rows = torch.arange(slot0, slot0 + T, device=device)
    return cols[None, :] <= rows[:, None]


class StageModel(nn.Module):
    """Layers `[layers.start, layers.stop)` of the target, plus embedding and/or final norm + head."""

    def __init__(self, cfg: ModelConfig, layers: range, embedding: bool = False, head: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if layers.step != 1 or layers.start < 0 or layers.stop > cfg.num_layers:
            raise ValueError(f"layer range {layers} is outside the model's {cfg.num_layers} layers")
        self.cfg, self.layer_range = cfg, layers
        self.has_embedding, self.has_head = embedding, head
        if embedding:
            self.embedding = Embedding(cfg, device, dtype)
        self.decoder = Decoder(cfg, layers, head, device, dtype)
        if head and not (cfg.tie_embeddings and embedding):
            self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.screen: ScreenedHead | None = None  # the T=0 argmax from an int8 screen of the head

    @classmethod
    def full(cls, cfg: ModelConfig, **kw) -> "StageModel":
        return cls(cfg, range(cfg.num_layers), embedding=True, head=True, **kw)

    def rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].device != device:
            self._rope = rope_tables(self.cfg, device)
        return self._rope

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, H]."""
        return self.embedding.word_embeddings(tokens)

    def forward_layers(self, h: torch.Tensor, cache: KVCache, slot0: int, positions: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None, capture: frozenset[int] = frozenset(),
                       into: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run owned layers on h [B, T, H] whose K/V go to cache slots [slot0, slot0 + T).

        positions [B, T] are the RoPE positions (default: the slots, i.e. unpadded batch);
        mask [B or 1, 1, T, slot0 + T] overrides the causal mask (padded batches).
        into {layer: [B, T, H]}: buffers the layers' outputs are written into (a stage's decode
        rows pinned with its transport: they leave without a copy).
        Returns the output and the raw outputs of the layers in `capture` (anchor states).
        """
        B, T, _ = h.shape
        if isinstance(cache, RowCaches):  # h [1, R, H]: one token of each of R requests, positions [1, R]
            assert B == 1 and positions is not None and mask is None, (h.shape, mask)
        elif slot0 + T > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; writing up to {slot0 + T}")
        if positions is None:
            positions = torch.arange(slot0, slot0 + T, device=h.device).expand(B, T)
        if mask is None and not isinstance(cache, RowCaches):
            mask = causal_mask(slot0, T, h.device)
        cos_t, sin_t = self.rope(h.device)
        cos, sin = cos_t[positions], sin_t[positions]  # [B, T, hd]
        captured: dict[int, torch.Tensor] = {}
        for i in self.layer_range:
            h = self.decoder.layers[str(i)](h, i, cache, slot0, cos, sin, mask, None if into is None else into.get(i))
            if i in capture:
                captured[i] = h
        return h, captured

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder.final_layernorm(h)

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: h [..., H] -> logits [..., V] (fp32)."""
        return F.linear(self.final_norm(h), self.output_weight()).float()

    def use_head_screen(self) -> bool:
        """Take T=0 argmaxes from an int8 screen of the head (kernels/screened_argmax.py) where it is
        supported; call once the weights are in place. Returns whether the screen is on."""
        assert self.has_head, "only a stage with the head computes greedy tokens"
        self.screen = ScreenedHead.build(self.output_weight().detach())
        return self.screen is not None

    def greedy_token(self, h: torch.Tensor) -> int:
        """The target's greedy token for one hidden state h [H]: argmax of `logits(h)`."""
        if self.screen is not None:
            return self.screen.argmax(self.final_norm(h))
        return int(self.logits(h).argmax())  # host sync: the caller needs the id

    def greedy_tokens(self, h: torch.Tensor) -> list[int]:
        """The greedy token of every row of h [R, H], as `greedy_token` gives it row by row (with the
        screen, one int8 product for all rows; without, row by row: a several-row product could
        round a near-tie the other way)."""
        if self.screen is not None:
            return self.screen.argmax_rows(self.final_norm(h))
        return [self.greedy_token(row) for row in h]

    def logits_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of several rows h [R, H] -> logits [R, V] (fp32), each row alone: a
        BLAS rounds one row (a matrix-vector kernel) otherwise than several, and a request's row
        gets the logits it gets in a one-row step (batch invariance, engine/model/row_invariance.py)."""
        return torch.stack([self.logits(row) for row in h])

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.cfg, self.layer_range, batch, capacity, p.device, p.dtype)


def init_random_(model: StageModel, seed: int = 0, std: float = 0.02) -> StageModel:
    """Random weights of the right shapes (tests, synthetic benchmarks); norm weights near 1.

    Each tensor is seeded by its name, so a stage gets the same weights as the same layers of
    the full model (and a tied head stage's output layer equals the embedding).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_tensor(name, p.shape, model.cfg, seed, std))
    return model


def random_tensor(name: str, shape, cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    """The fp32 random weight `init_random_` gives parameter `name` of the full model's `shape` (a norm's
    gamma near 1, so a 1p weight near 0; a norm's bias small)."""
    key = name
    if name == "output_layer.weight" and cfg.tie_embeddings:
        key = "embedding.word_embeddings.weight"
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    noise = torch.randn(tuple(shape), generator=gen)
    if "layernorm" in name and name.endswith("weight"):
        return (0.0 if cfg.norm_1p else 1.0) + 0.1 * noise
    return std * noise
