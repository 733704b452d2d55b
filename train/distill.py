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

import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spd_engine.engine.anchors import AnchorPlan
from spd_engine.engine.model import StageModel
from spd_engine.engine.pdm import PDM, PDMConfig, save_pdm
from spd_engine.train.data_parallel import DataParallel
from spd_engine.train.pipeline_sim import simulated_hidden, target_anchors
from spd_engine.train.lr_schedule import SCHEDULES, check_fill_weights, decay_start, draw_fill, schedule_lr


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

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch < 1 or self.steps < 1 or self.lr <= 0:
            raise ValueError("seq_len >= 2, batch >= 1, steps >= 1 and lr > 0 are required")
        if not 0 <= self.full_fill_frac <= 1:
            raise ValueError(f"full_fill_frac must be in [0, 1], got {self.full_fill_frac}")
        if self.autocast not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"autocast must be bfloat16, float16 or float32, got {self.autocast!r}")
        if self.keep_every < 0 or self.save_every < 1:
            raise ValueError("save_every >= 1 and keep_every >= 0 are required")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 < self.decay_frac < 1:
            raise ValueError(f"decay_frac must be in (0, 1), got {self.decay_frac}")
        check_fill_weights(self.fill_weights, len(self.stage_layers))


def lr_at(step: int, cfg) -> float:
    """Linear warmup, then the run's schedule (train/lr_schedule.py; cosine unless the config says)."""
    return schedule_lr(step, cfg.lr, cfg.steps, cfg.warmup, getattr(cfg, "schedule", "cosine"),
                       getattr(cfg, "decay_frac", 0.2))


def new_pdm(target: StageModel, cfg: TrainConfig, draft_vocab: tuple[int, ...] | None) -> PDM:
    """Projections = identity on the deepest anchor, layers from a target layer, head from the target."""
    bounds = [0]
    for c in cfg.stage_layers:
        bounds.append(bounds[-1] + c)
    plan = AnchorPlan.build(bounds, cfg.anchors)
    pcfg = PDMConfig(tuple(cfg.stage_layers), plan.anchors, cfg.pdm_layers, draft_vocab, target.cfg.fingerprint())
    pdm = PDM(target.cfg, pcfg)
    layer = target.decoder.layers[str(cfg.init_layer % target.cfg.num_layers)]
    return pdm.init_from_target(layer, target.decoder.final_layernorm.weight.float(), target.output_weight().float())


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


class Trainer:
    def __init__(self, target: StageModel, cfg: TrainConfig, batches: Iterator[torch.Tensor],
                 draft_vocab: tuple[int, ...] | None = None, log=print, dp: DataParallel = DataParallel()) -> None:
        """`batches` is this rank's own stream (DataParallel.shard); only the main rank logs and saves."""
        self.target, self.cfg, self.batches, self.dp = target, cfg, batches, dp
        self.log = log if dp.is_main else (lambda msg: None)
        self.out = Path(cfg.out)
        if dp.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.pdm = new_pdm(target, cfg, draft_vocab).to(cfg.device).train()
        params = [p for p in self.pdm.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.rng = random.Random(cfg.seed)
        self.step = 0
        self.history: list[dict] = []
        self._resume()

    def _resume(self) -> None:
        state_path = self.out / "state.pt"
        if not state_path.is_file():
            return
        st = torch.load(state_path, weights_only=False)
        if st["config"]["stage_layers"] != list(self.cfg.stage_layers):
            raise ValueError(f"{state_path} belongs to a run with stage layers {st['config']['stage_layers']}")
        st = self._extension_start(st, state_path)
        self.pdm.load_state_dict(st["pdm"])
        self.opt.load_state_dict(st["opt"])
        self.rng.setstate(st["rng"])
        self.step, self.history = st["step"], st["history"]
        for _ in range(self.step):  # replay the data stream to where the run stopped
            next(self.batches)
        self.log(f"resumed from step {self.step}")

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
            st = torch.load(stable_path, weights_only=False)
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
        tmp = self.out / "state.pt.tmp"
        torch.save(st, tmp)
        tmp.replace(self.out / "state.pt")
        if self.step == self._stable_step():
            torch.save(st, self.out / "stable.pt.tmp")
            (self.out / "stable.pt.tmp").replace(self.out / "stable.pt")
        extra = {"train": {"step": self.step, "tokens": self.tokens_seen(), "config": cfg}}
        save_pdm(self.pdm, self.out / "pdm", extra=extra, dtype=getattr(torch, self.cfg.export_dtype))
        if self.cfg.keep_every and self.step % self.cfg.keep_every == 0:  # for acceptance-vs-tokens curves
            save_pdm(self.pdm, self.out / "snapshots" / f"step-{self.step:06d}", extra=extra,
                     dtype=getattr(torch, self.cfg.export_dtype))
        (self.out / "history.json").write_text(json.dumps(self.history, indent=1))

    def tokens_seen(self) -> int:
        return self.history[-1]["tokens"] if self.history else 0

    def run(self) -> PDM:
        n = len(self.cfg.stage_layers)
        window: dict[int, list[float]] = {}
        t0 = time.time()
        tokens_seen = self.tokens_seen()
        while self.step < self.cfg.steps:
            tokens = next(self.batches).to(self.cfg.device)
            f = draw_fill(n, self.cfg.full_fill_frac, self.rng, self.cfg.fill_weights)
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.step, self.cfg)
            loss, agree = distill_loss(self.pdm, self.target, tokens, f, self.cfg.autocast)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.dp.average_gradients(self.pdm.parameters())
            torch.nn.utils.clip_grad_norm_(self.pdm.parameters(), self.cfg.grad_clip)
            self.opt.step()
            self.step += 1
            tokens_seen += tokens.numel() * self.dp.world
            loss_v, agree_v = self.dp.mean(float(loss.detach())), self.dp.mean(float(agree))
            window.setdefault(f, []).append(agree_v)
            self.history.append({"step": self.step, "fill": f, "loss": loss_v, "agree": agree_v, "tokens": tokens_seen})
            if self.step % 10 == 0 or self.step == self.cfg.steps:
                per_fill = " ".join(f"f{k}={sum(v) / len(v):.3f}" for k, v in sorted(window.items()))
                self.log(f"step {self.step}/{self.cfg.steps} loss {loss_v:.3f} top1 {per_fill} "
                         f"tokens {tokens_seen / 1e6:.3f}M {time.time() - t0:.0f}s")
                window.clear()
            if self.dp.is_main and (self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps or
                                    self.step == self._stable_step() or
                                    (self.cfg.keep_every and self.step % self.cfg.keep_every == 0)):
                self.save()
        return self.pdm.eval()
