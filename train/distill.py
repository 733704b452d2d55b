"""PDM training: knowledge distillation from the frozen target over the exact pipeline simulation.

Each step: a batch of token sequences goes through the frozen target once (anchors + teacher
logits); a fill `f` is drawn (train/lr_schedule.py: by default half the batches `f = n`, the rest
`f ~ U{1..n-1}`; or by given weights per fill); the PDM runs
the simulation of train/pipeline_sim.py and the loss is KL(target || PDM) on next-token
distributions restricted to the draft vocabulary. Logged: loss and top-1 agreement with the
target's argmax per fill. Checkpoints (`state.pt` + an exported PDM dir) make runs resumable;
under the wsd schedule `stable.pt` (the state where the decay starts) lets a run be extended.
"""
from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.pdm import PDM, PDMConfig, load_pdm, read_pdm_config, save_pdm
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.train.data_parallel import DataParallel
from spd_engine.train.head_training import (
    HeadTrainer,
    check_loop_config,
    load_state,
    lr_at,  # noqa: F401  (part of this module's API)
)
from spd_engine.train.head_transplant import transplant
from spd_engine.train.lr_schedule import SCHEDULES, check_fill_weights, decay_start, draw_fill
from spd_engine.train.pipeline_sim import simulated_hidden, target_anchors


@dataclass
class TrainConfig:
    out: str
    stage_layers: tuple[int, ...]
    anchors: tuple[int, ...] | None = None
    pdm_layers: int = 1
    seq_len: int = 256
    batch: int = 4
    steps: int = 1000
    lr: float = 5e-4
    warmup: int = 30
    grad_clip: float = 1.0
    full_fill_frac: float = 0.5
    target_dtype: str = "bfloat16"
    device: str = "cpu"
    seed: int = 0
    save_every: int = 50
    init_layer: int = -1  # target layer copied into each PDM layer (-1: the last)
    export_dtype: str = "float16"  # dtype of the exported pdm/ directory (training state stays fp32)
    autocast: str = "bfloat16"  # PDM compute dtype under torch.autocast ("float32": off); weights stay fp32
    keep_every: int = 0  # also keep the exported head of every keep_every-th step (0: off)
    fill_weights: tuple[float, ...] | None = None  # weights of fills 1..n (None: full_fill_frac, then uniform)
    schedule: str = "cosine"  # learning-rate schedule after the warmup: cosine | wsd (train/lr_schedule.py)
    decay_frac: float = 0.2  # wsd: the last fraction of the steps decays
    init_head: str | None = None  # start from this exported PDM (fine-tuning) instead of the target's layers

    def __post_init__(self) -> None:
        check_loop_config(self, min_seq_len=2)
        if not 0 <= self.full_fill_frac <= 1:
            raise ValueError(f"full_fill_frac must be in [0, 1], got {self.full_fill_frac}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 < self.decay_frac < 1:
            raise ValueError(f"decay_frac must be in (0, 1), got {self.decay_frac}")
        check_fill_weights(self.fill_weights, len(self.stage_layers))


def new_pdm(target: StageModel, cfg: TrainConfig, draft_vocab: tuple[int, ...] | None) -> PDM:
    """Projections = identity on the deepest anchor, layers from a target layer, head from the target;
    or, with `cfg.init_head`, that head's weights (its config must be the run's)."""
    bounds = [0]
    for c in cfg.stage_layers:
        bounds.append(bounds[-1] + c)
    plan = AnchorPlan.build(bounds, cfg.anchors)
    pcfg = PDMConfig(tuple(cfg.stage_layers), plan.anchors, cfg.pdm_layers, draft_vocab, target.cfg.fingerprint())
    if cfg.init_head is not None:
        return _init_head(target, cfg.init_head, pcfg)
    pdm = PDM(target.cfg, pcfg)
    layer = target.decoder.layers[str(cfg.init_layer % target.cfg.num_layers)]
    norm = target.decoder.final_layernorm
    bias = norm.bias.float() if hasattr(norm, "bias") else None  # a LayerNorm target's
    return pdm.init_from_target(layer, norm.weight.float(), target.output_weight().float(), bias)


def _init_head(target: StageModel, path: str, pcfg: PDMConfig) -> PDM:
    """The exported head at `path` as fp32 trainable weights (int8 heads dequantized), checked to
    have the run's K and draft vocabulary; a head of another stage split (or anchors) warm-starts
    this one (train/head_transplant.py)."""
    head_cfg, _ = read_pdm_config(path)
    for field in ("num_layers", "draft_vocab"):
        mine, theirs = getattr(pcfg, field), getattr(head_cfg, field)
        if mine != theirs:
            shown = (lambda v: f"{len(v)} ids" if v is not None else "the full vocabulary") if field == "draft_vocab" \
                else (lambda v: v)
            raise ValueError(f"--init-head {path} has {field} {shown(theirs)}, this run has {shown(mine)}")
    src = load_pdm(path, target.cfg, head_cfg.stage_layers)  # trainable as built (the final norm stays frozen)
    if (head_cfg.stage_layers, head_cfg.anchors) == (pcfg.stage_layers, pcfg.anchors):
        return src
    return transplant(src, PDM(target.cfg, pcfg))


def distill_loss(pdm: PDM, target: StageModel, tokens: torch.Tensor, f: int,
                 autocast: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, S] -> (KL loss, top-1 agreement with the target's full-vocabulary argmax).

    `autocast` is the PDM's compute dtype (bf16 halves the CPU time of its forward and backward;
    the weights, the softmaxes and the loss stay fp32)."""
    anchors, h = target_anchors(target, pdm.plan, tokens)  # [B, S, m, H], [B, S, H]
    with torch.no_grad():
        t_logits = target.logits(h)  # [B, S, V] fp32
        t_top = t_logits.argmax(-1)
        p_log = F.log_softmax(t_logits[..., pdm.draft_ids], dim=-1)  # restricted to the draft vocabulary
    with torch.autocast(tokens.device.type, dtype=getattr(torch, autocast), enabled=autocast != "float32"):
        q_logits = pdm.draft_logits(simulated_hidden(pdm, anchors.float(), f))  # [B, S, Vd]
    q_log = F.log_softmax(q_logits.float(), dim=-1)
    loss = F.kl_div(q_log, p_log, log_target=True, reduction="none").sum(-1).mean()
    agree = (pdm.draft_ids[q_log.argmax(-1)] == t_top).float().mean()
    return loss, agree


class Trainer(HeadTrainer):
    STATE_KEY = "pdm"

    def __init__(self, target: StageModel, cfg: TrainConfig, batches: Iterator[torch.Tensor],
                 draft_vocab: tuple[int, ...] | None = None, log=print, dp: DataParallel = DataParallel()) -> None:
        """`batches` is this rank's own stream (DataParallel.shard); only the main rank logs and saves."""
        super().__init__(target, cfg, batches, log, dp)
        self.pdm = new_pdm(target, cfg, draft_vocab).to(cfg.device).train()
        self.opt = self._optimizer(self.pdm)
        self.rng = random.Random(cfg.seed)
        self._resume()

    @property
    def model(self) -> PDM:
        return self.pdm

    def _resume_state(self, st: dict, state_path: Path) -> dict:
        if st["config"]["stage_layers"] != list(self.cfg.stage_layers):
            raise ValueError(f"{state_path} belongs to a run with stage layers {st['config']['stage_layers']}")
        return self._extension_start(st, state_path)

    def _restore(self, st: dict) -> None:
        self.rng.setstate(st["rng"])

    def _extension_start(self, st: dict, state_path: Path) -> dict:
        """The state to resume from: `st`, or under wsd, when --steps grew past a run that had
        begun its decay, the state saved where that decay began (stable.pt)."""
        old = st["config"]
        schedule, steps = old.get("schedule", "cosine"), old["steps"]
        if schedule != self.cfg.schedule:
            raise ValueError(f"{state_path} was trained with the {schedule} schedule: resume it with --schedule {schedule}")
        if steps == self.cfg.steps:
            return st
        if schedule == "cosine":
            raise ValueError(f"{state_path}: a cosine run of {steps} steps cannot continue to --steps {self.cfg.steps} "
                             f"(its decay depends on the total); train with --schedule wsd to extend runs")
        if st["step"] > decay_start(steps, old["warmup"], old["decay_frac"]):
            stable_path = self.out / "stable.pt"
            if not stable_path.is_file():
                raise ValueError(f"{state_path} is past the start of its decay and {stable_path} is missing")
            st = load_state(stable_path)
            self.log(f"extending a {steps}-step run: back to step {st['step']}, where its decay began")
        if st["step"] > decay_start(self.cfg.steps, self.cfg.warmup, self.cfg.decay_frac):
            raise ValueError(f"{state_path}: step {st['step']} is past the start of the decay of a "
                             f"{self.cfg.steps}-step run; give more --steps")
        return st

    def _stable_step(self) -> int | None:
        """wsd: the step whose state is kept as stable.pt (the decay starts right after it)."""
        if self.cfg.schedule != "wsd":
            return None
        return decay_start(self.cfg.steps, self.cfg.warmup, self.cfg.decay_frac)

    def save(self) -> None:
        cfg = asdict(self.cfg)
        cfg["stage_layers"] = list(self.cfg.stage_layers)
        st = {"pdm": self.pdm.state_dict(), "opt": self.opt.state_dict(), "rng": self.rng.getstate(),
              "step": self.step, "history": self.history, "config": cfg}
        self._write_state(st)
        if self.step == self._stable_step():
            self._write_state(st, "stable.pt")
        self._export(save_pdm, "pdm", cfg)

    def run(self) -> PDM:
        n = len(self.cfg.stage_layers)
        window: dict[int, list[float]] = {}
        t0 = time.time()
        tokens_seen = self.tokens_seen()
        self._progress()
        try:
            self._steps(n, window, t0, tokens_seen)
        finally:
            self._end_progress()
        return self.pdm.eval()

    def _steps(self, n: int, window: dict[int, list[float]], t0: float, tokens_seen: int) -> None:
        while self.step < self.cfg.steps:
            tokens = next(self.batches).to(self.cfg.device)
            f = draw_fill(n, self.cfg.full_fill_frac, self.rng, self.cfg.fill_weights)
            self._set_lr()
            loss, agree = distill_loss(self.pdm, self.target, tokens, f, self.cfg.autocast)
            self._apply(loss)
            tokens_seen += tokens.numel() * self.dp.world
            loss_v, agree_v = self.dp.mean(float(loss.detach())), self.dp.mean(float(agree))
            window.setdefault(f, []).append(agree_v)
            self.history.append({"step": self.step, "fill": f, "loss": loss_v, "agree": agree_v, "tokens": tokens_seen})
            self._advance(loss_v, tokens_seen)
            if self._log_due():
                per_fill = " ".join(f"f{k}={sum(v) / len(v):.3f}" for k, v in sorted(window.items()))
                self._log_step(loss_v, per_fill, tokens_seen, t0)
                window.clear()
            if self._save_due():
                self.save()
