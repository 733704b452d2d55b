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

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spd_engine.engine.model.eagle_head import EagleConfig, EagleHead, default_feature_layers, save_eagle
from spd_engine.engine.model.model import StageModel
from spd_engine.train.data_parallel import DataParallel
from spd_engine.train.head_training import HeadTrainer, check_loop_config


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
        check_loop_config(self, min_seq_len=3)
        if not 1 <= self.ttt_steps < self.seq_len - 1:
            raise ValueError(f"ttt_steps must be in [1, seq_len - 1), got {self.ttt_steps}")


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


class EagleTrainer(HeadTrainer):
    STATE_KEY = "head"

    def __init__(self, target: StageModel, cfg: EagleTrainConfig, batches: Iterator[torch.Tensor],
                 draft_vocab: tuple[int, ...] | None = None, log=print, dp: DataParallel = DataParallel()) -> None:
        super().__init__(target, cfg, batches, log, dp)
        self.head = new_head(target, cfg, draft_vocab).float().to(cfg.device).train()
        self.opt = self._optimizer(self.head)
        self._resume()

    @property
    def model(self) -> EagleHead:
        return self.head

    def _resume_state(self, st: dict, path: Path) -> dict:
        if st.get("method") != "eagle":
            raise ValueError(f"{path} belongs to a PDM training run, not an EAGLE head's")
        return st

    def save(self) -> None:
        cfg = asdict(self.cfg)
        st = {"method": "eagle", "head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
              "history": self.history, "config": cfg}
        self._write_state(st)
        self._export(save_eagle, "eagle", cfg)

    def run(self) -> EagleHead:
        t0, tokens_seen = time.time(), self.tokens_seen()
        self._progress()
        try:
            self._steps(t0, tokens_seen)
        finally:
            self._end_progress()
        return self.head.eval()

    def _steps(self, t0: float, tokens_seen: int) -> None:
        cfg = self.cfg
        while self.step < cfg.steps:
            tokens = next(self.batches).to(cfg.device)
            self._set_lr()
            loss, agree = eagle_loss(self.head, self.target, tokens, cfg.ttt_steps, cfg.autocast)
            self._apply(loss)
            tokens_seen += tokens.numel() * self.dp.world
            agree = [self.dp.mean(a) for a in agree]
            self.history.append({"step": self.step, "loss": self.dp.mean(float(loss.detach())), "agree": agree,
                                 "tokens": tokens_seen})
            self._advance(self.history[-1]["loss"], tokens_seen)
            if self._log_due():
                steps = " ".join(f"s{i}={a:.3f}" for i, a in enumerate(agree))
                self._log_step(self.history[-1]["loss"], steps, tokens_seen, t0)
            if self._save_due():
                self.save()
