"""EAGLE head training (`spd train --method eagle`, docs/design.md 3.10): distillation from the frozen
target with EAGLE-3's training-time test.

Each step: a batch [B, S] goes through the frozen target once (the low/mid/high layer outputs and
the teacher logits). The head is unrolled `ttt_steps` draft steps: block 0 holds the rows of
positions p = 0..S-2 made from true fused features, `[emb(x_{p+1}); fuse(features_p)]`; block i >= 1
holds the rows `[emb(x_{p+1}); out_{i-1}(p-1)]` made from the head's own outputs one position back,
as the runtime's i-th chained draft step is. Row (i, p) attends to what that draft step sees at
inference: the true rows at positions <= p - i and the chain rows (i', p - i + i') for 1 <= i' <= i.
Row (i, p) drafts x_{p+2}; its loss is KL(target || head) over the draft vocabulary against the
teacher's distribution at position p+1, for p >= i (a chain cannot start before position 0).
Checkpoints (`state.pt` + an exported head directory) make runs resumable, as the PDM trainer's.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spd_engine.engine.eagle_head import EagleConfig, EagleHead, default_feature_layers, save_eagle
from spd_engine.engine.model import StageModel
from spd_engine.train.data_parallel import DataParallel
from spd_engine.train.distill import lr_at


@dataclass
class EagleTrainConfig:
    out: str
    feature_layers: tuple[int, int, int] | None = None  # None: default_feature_layers(L)
    ttt_steps: int = 3  # draft steps unrolled per position (the training-time test)
    seq_len: int = 256
    batch: int = 4
    steps: int = 1000
    lr: float = 5e-4
    warmup: int = 30
    grad_clip: float = 1.0
    target_dtype: str = "bfloat16"
    device: str = "cpu"
    seed: int = 0
    save_every: int = 50
    keep_every: int = 0
    init_layer: int = -1  # target layer copied into the head's decoder layer (-1: the last)
    export_dtype: str = "float16"
    autocast: str = "bfloat16"  # head compute dtype under torch.autocast ("float32": off)

    def __post_init__(self) -> None:
        if self.seq_len < 3 or self.batch < 1 or self.steps < 1 or self.lr <= 0:
            raise ValueError("seq_len >= 3, batch >= 1, steps >= 1 and lr > 0 are required")
        if not 1 <= self.ttt_steps < self.seq_len - 1:
            raise ValueError(f"ttt_steps must be in [1, seq_len - 1), got {self.ttt_steps}")
        if self.autocast not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"autocast must be bfloat16, float16 or float32, got {self.autocast!r}")
        if self.keep_every < 0 or self.save_every < 1:
            raise ValueError("save_every >= 1 and keep_every >= 0 are required")


def ttt_mask(S1: int, steps: int, device=None) -> torch.Tensor:
    """Bool mask [steps*S1, steps*S1] over rows (block i, position p), block by block: query (i, p)
    sees key (0, p') iff p' <= p - i, and key (i', p') with i' >= 1 iff i - i' == p - p' >= 0."""
    blk = torch.arange(steps, device=device).repeat_interleave(S1)  # [steps*S1]
    pos = torch.arange(S1, device=device).repeat(steps)
    back = pos[:, None] - pos[None, :]  # p - p'
    true_rows = (blk[None, :] == 0) & (back >= blk[:, None])
    chain = (blk[None, :] >= 1) & (back >= 0) & (blk[:, None] - blk[None, :] == back)
    return true_rows | chain


def unrolled_hidden(head: EagleHead, emb_next: torch.Tensor, fused: torch.Tensor, steps: int) -> torch.Tensor:
    """emb_next [B, S1, H] (embeddings of x_1..x_{S1}), fused [B, S1, H] (features of 0..S1-1) ->
    head outputs [B, steps, S1, H] of every block. Block i's rows need block i-1's outputs, so the
    stack runs `steps` times over the blocks so far (blocks only see blocks <= their own)."""
    B, S1, H = fused.shape
    full_mask = ttt_mask(S1, steps, fused.device)
    blocks = [head.rows(emb_next, fused)]  # [B, S1, H] each
    for i in range(1, steps + 1):
        T = i * S1
        rows = torch.cat(blocks, dim=1)  # [B, T, H]
        positions = torch.arange(S1, device=fused.device).repeat(i).expand(B, T)
        out = head.forward_rows(rows, head.new_cache(T, batch=B), 0, positions=positions,
                                mask=full_mask[None, None, :T, :T])  # [B, T, H]
        if i == steps:
            return out.view(B, steps, S1, H)
        prev = out[:, -S1:]  # block i-1's outputs; row p takes the output at p-1 (row 0: unused)
        shifted = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        blocks.append(head.rows(emb_next, shifted))
    raise AssertionError("unreachable")


def eagle_loss(head: EagleHead, target: StageModel, tokens: torch.Tensor, steps: int,
               autocast: str = "float32") -> tuple[torch.Tensor, list[float]]:
    """tokens [B, S] -> (mean KL over the unrolled steps, top-1 agreement with the target per step)."""
    S1 = tokens.shape[1] - 1
    with torch.no_grad():
        h, caps = target.forward_layers(target.embed(tokens), target.new_cache(tokens.shape[0], tokens.shape[1]), 0,
                                        capture=head.feature_layers)
        t_logits = target.logits(h[:, 1:])  # [B, S1, V]: the teacher for x_{p+2}
        t_top = t_logits.argmax(-1)
        p_log = F.log_softmax(t_logits[..., head.draft_ids], dim=-1)
        emb_next = target.embed(tokens[:, 1:]).float()  # [B, S1, H]
        feats = {i: caps[i][:, :S1].float() for i in head.feature_layers}
    with torch.autocast(tokens.device.type, dtype=getattr(torch, autocast), enabled=autocast != "float32"):
        out = unrolled_hidden(head, emb_next, head.fused(feats), steps)  # [B, steps, S1, H]
        q_logits = head.draft_logits(out)
    q_log = F.log_softmax(q_logits.float(), dim=-1)  # [B, steps, S1, Vd]
    kl = F.kl_div(q_log, p_log[:, None].expand_as(q_log), log_target=True, reduction="none").sum(-1)
    hit = (head.draft_ids[q_log.argmax(-1)] == t_top[:, None]).float()  # [B, steps, S1]
    losses, agree = [], []
    for i in range(steps):  # row p of block i is a draft step only for p >= i
        losses.append(kl[:, i, i:].mean())
        agree.append(float(hit[:, i, i:].mean()))
    return torch.stack(losses).mean(), agree


def new_head(target: StageModel, cfg: EagleTrainConfig, draft_vocab: tuple[int, ...] | None) -> EagleHead:
    layers = cfg.feature_layers or default_feature_layers(target.cfg.num_layers)
    head = EagleHead(target.cfg, EagleConfig(tuple(layers), draft_vocab, target.cfg.fingerprint()))
    return head.init_from_target(target, cfg.init_layer)


class EagleTrainer:
    def __init__(self, target: StageModel, cfg: EagleTrainConfig, batches: Iterator[torch.Tensor],
                 draft_vocab: tuple[int, ...] | None = None, log=print, dp: DataParallel = DataParallel()) -> None:
        self.target, self.cfg, self.batches, self.dp = target, cfg, batches, dp
        self.log = log if dp.is_main else (lambda msg: None)
        self.out = Path(cfg.out)
        if dp.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.head = new_head(target, cfg, draft_vocab).float().to(cfg.device).train()
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step, self.history = 0, []
        self._resume()

    def _resume(self) -> None:
        path = self.out / "state.pt"
        if not path.is_file():
            return
        st = torch.load(path, weights_only=False)
        if st.get("method") != "eagle":
            raise ValueError(f"{path} belongs to a PDM training run, not an EAGLE head's")
        self.head.load_state_dict(st["head"])
        self.opt.load_state_dict(st["opt"])
        self.step, self.history = st["step"], st["history"]
        for _ in range(self.step):  # replay the data stream to where the run stopped
            next(self.batches)
        self.log(f"resumed from step {self.step}")

    def save(self) -> None:
        cfg = asdict(self.cfg)
        st = {"method": "eagle", "head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
              "history": self.history, "config": cfg}
        tmp = self.out / "state.pt.tmp"
        torch.save(st, tmp)
        tmp.replace(self.out / "state.pt")
        extra = {"train": {"step": self.step, "tokens": self.tokens_seen(), "config": cfg}}
        dtype = getattr(torch, self.cfg.export_dtype)
        save_eagle(self.head, self.out / "eagle", extra=extra, dtype=dtype)
        if self.cfg.keep_every and self.step % self.cfg.keep_every == 0:
            save_eagle(self.head, self.out / "snapshots" / f"step-{self.step:06d}", extra=extra, dtype=dtype)
        (self.out / "history.json").write_text(json.dumps(self.history, indent=1))

    def tokens_seen(self) -> int:
        return self.history[-1]["tokens"] if self.history else 0

    def run(self) -> EagleHead:
        cfg, t0, tokens_seen = self.cfg, time.time(), self.tokens_seen()
        while self.step < cfg.steps:
            tokens = next(self.batches).to(cfg.device)
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.step, cfg)
            loss, agree = eagle_loss(self.head, self.target, tokens, cfg.ttt_steps, cfg.autocast)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.dp.average_gradients(self.head.parameters())
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
            self.opt.step()
            self.step += 1
            tokens_seen += tokens.numel() * self.dp.world
            agree = [self.dp.mean(a) for a in agree]
            self.history.append({"step": self.step, "loss": self.dp.mean(float(loss.detach())), "agree": agree,
                                 "tokens": tokens_seen})
            if self.step % 10 == 0 or self.step == cfg.steps:
                steps = " ".join(f"s{i}={a:.3f}" for i, a in enumerate(agree))
                self.log(f"step {self.step}/{cfg.steps} loss {self.history[-1]['loss']:.3f} top1 {steps} "
                         f"tokens {tokens_seen / 1e6:.3f}M {time.time() - t0:.0f}s")
            if self.dp.is_main and (self.step % cfg.save_every == 0 or self.step == cfg.steps or
                                    (cfg.keep_every and self.step % cfg.keep_every == 0)):
                self.save()
        return self.head.eval()
