"""The run configuration: one explicit, validated object every rank builds its part from, nested by
concern (engine/runtime/run_groups.py): `model` (ModelSpec), `parallel` (ParallelLayout), `drafting`
(Drafting), `runtime` (Runtime), beside the `mode`. Read a setting where it lives:
`config.drafting.suffix_run`, `config.parallel.topology`, `config.model.cfg`.

PDM sources: a PDM checkpoint directory, or `random` (an untrained head; output stays lossless); the
same for the eagle baseline's head (`--mode eagle`, engine/model/eagle_head.py).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spd_engine.engine.model.linear import resolve_layout
from spd_engine.engine.model.tp_shard import check_tp
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.drafting import DraftChooser
from spd_engine.engine.protocol.suffix import SuffixSettings
from spd_engine.engine.protocol.topology import VERIFY_AT, verifies_on_last  # noqa: F401 (VERIFY_AT: re-exported)
from spd_engine.engine.runtime.run_groups import (  # noqa: F401 (PRESETS, STEP_MODES, TRANSPORTS, random_preset: re-exported)
    DTYPES,
    PRESETS,
    STEP_MODES,
    TRANSPORTS,
    Drafting,
    ModelSpec,
    ParallelLayout,
    Runtime,
    StepMode,
    random_preset,
)
from spd_engine.kernels.int8_linear import int8_kernel_available


class Mode(str, enum.Enum):
    """What a run decodes with: SPD or one of its baselines. A str, so `mode == "spd"` still holds."""

    SPD = "spd"  # speculative pipeline decoding
    PP = "pp"  # pipeline-parallel autoregressive
    AR = "ar"  # autoregressive on one rank
    TP = "tp"  # one stage over the TP ranks, autoregressive
    EAGLE = "eagle"  # serial draft-then-verify with an EAGLE-3-style head, one rank

    __str__ = str.__str__  # "spd", not "Mode.SPD", in messages and f-strings
    __format__ = str.__format__

    @classmethod
    def parse(cls, value: "str | Mode") -> "Mode":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"mode must be one of {MODES}, got {value!r}") from None

    @property
    def one_rank(self) -> bool:
        """The whole model on one rank (ar, eagle)."""
        return self in (Mode.AR, Mode.EAGLE)

    @property
    def one_stage(self) -> bool:
        """One stage (n = 1): ar, eagle, and tp (one stage over the TP ranks)."""
        return self in (Mode.AR, Mode.EAGLE, Mode.TP)


MODES = tuple(m.value for m in Mode)
# branch width of an SPD run that names none. W = 2 at refill lifts the shipped n=4 head's pooled
# EAL from 2.03 to 2.16 on the dev prompts, but on the 2-core CPU host, where the ranks share the
# cores, a tick then costs more than that buys (docs/benchmarks.md), and the H200 profiles
# predict a few percent at best: W = 2 stays opt-in until a GPU run measures it.
DEFAULT_BRANCHES = 1
# tokens a suffix draft may carry as one entry where runs can travel (SPD, suffix drafts, n >= 2, one
# chain, one TP rank): at n=2 on all 120 dev prompts pooled EAL is 1.51 / 2.06 / 2.18 / 2.24 at K = 1 / 4 /
# 8 / 16 for 1 / 1.73 / 2.26 / 3.14 tokens per stage step (docs/results/heads-smollm2-n2-n8.md); timed at 8
# (docs/results/speed-2core-epyc.md)
DEFAULT_SUFFIX_RUN = 8


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this host's CPU has bf16 matrix instructions (Linux: AVX512-BF16 or AMX-BF16 in
    /proc/cpuinfo), where torch's bf16 matmuls beat fp32 ones (docs/design.md 3.5)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class RunConfig:
    """A run: its target model, parallel layout, drafting and runtime settings, and the mode. Per-request
    sampling (temperature, top-p, penalties, sampling seed) is no part of it: each request carries its own
    (api/params.py SamplingParams, engine/protocol/sampling.py), so there is no sampling group. Checks that
    need two groups are here."""

    model: ModelSpec
    parallel: ParallelLayout
    mode: Mode = Mode.SPD  # a string is parsed once, here
    drafting: Drafting = dataclasses.field(default_factory=Drafting)
    runtime: Runtime = dataclasses.field(default_factory=Runtime)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        topo, cfg, run, draft = self.parallel.topology, self.model.cfg, self.runtime, self.drafting
        if run.stage_ms is not None and (len(run.stage_ms) != topo.n or min(run.stage_ms) < 0):
            raise ValueError(f"stage_ms needs {topo.n} non-negative values, got {run.stage_ms}")
        self.resolved_weight_layout  # names a bad layout
        if draft.branches is None:
            auto = DEFAULT_BRANCHES if self.mode is Mode.SPD else 1
            object.__setattr__(self, "drafting", dataclasses.replace(draft, branches=auto))
        draft = self.drafting
        self.branch_policy()  # BranchPolicy names a bad width or policy, the default width resolved
        if draft.branches > 1 and self.mode is not Mode.SPD:
            raise ValueError(f"--branches {draft.branches} needs --mode spd (branch chains are SPD drafts)")
        if draft.suffix_run is not None and draft.suffix_run > 1:
            self._check_suffix_runs()
        if topo.num_layers != cfg.num_layers:
            raise ValueError(f"stage layers {list(topo.stage_layers)} sum to {topo.num_layers}, "
                             f"the model has {cfg.num_layers} layers")
        self._check_mode_layout()
        if run.capacity < 2 or run.capacity > cfg.max_position:
            raise ValueError(f"KV capacity {run.capacity} must be in [2, max_position={cfg.max_position}]")

    def _check_mode_layout(self) -> None:
        topo = self.parallel.topology
        if self.mode.one_rank and topo.n != 1:
            raise ValueError(f"--mode {self.mode} runs the whole model on one rank: use --stages 1")
        if self.mode.one_rank and topo.tp != 1:
            raise ValueError(f"--mode {self.mode} runs the whole model on one rank: use --mode tp for --tp > 1")
        if self.mode is Mode.TP and topo.n != 1:
            raise ValueError("--mode tp runs the whole model as one stage over the TP ranks: use --stages 1")
        if topo.tp > 1:
            check_tp(self.model.cfg, topo.tp)

    @property
    def pdm_int8(self) -> bool:
        """Whether the PDM's matmuls run over int8 weight rows (kernels/int8_linear.py), bf16 activations:
        asked, or auto for an fp32 run on a CPU where torch has the int8 kernel (docs/design.md 3.5)."""
        if self.drafting.pdm_dtype == "auto":
            return self._cpu_fp32() and int8_kernel_available()
        return self.drafting.pdm_dtype == "int8"

    @property
    def pdm_torch_dtype(self) -> torch.dtype:
        """The PDM's activation dtype (`drafting.pdm_dtype` resolved for this run's device)."""
        if self.pdm_int8:
            return torch.bfloat16
        if self.drafting.pdm_dtype != "auto":
            return DTYPES[self.drafting.pdm_dtype]
        if self._cpu_fp32() and cpu_has_bf16_matmul():
            return torch.bfloat16
        return self.model.torch_dtype

    def _cpu_fp32(self) -> bool:
        return self.parallel.device.startswith("cpu") and self.model.dtype == "float32"

    @property
    def resolved_weight_layout(self) -> str:
        """This run's linear weights' layout (engine/model/linear.py), resolved for its device and
        its ranks' intra-op threads."""
        threads = self.threads_per_rank()
        measured = dict(self.model.measured_layouts).get(threads)
        return resolve_layout(self.model.weight_layout, self.parallel.device, threads, measured)

    @property
    def world_size(self) -> int:
        topo = self.parallel.topology
        if self.mode is Mode.SPD:
            return topo.world_size
        if self.mode is Mode.EAGLE:
            return 1  # one rank: the target and the draft head
        return dataclasses.replace(topo, colocate=True).world_size  # pp/tp/ar: n T stage ranks

    @property
    def verifies_on_last(self) -> bool:
        """Whether the last stage holds the head and computes T=0 verification's argmax (SPD, n >= 2;
        with n = 1 the last stage is the driver's own stage 0)."""
        topo = self.parallel.topology
        return self.mode is Mode.SPD and topo.n >= 2 and verifies_on_last(self.parallel.verify_at, topo.colocate)

    def resolved_step_mode(self) -> StepMode:
        """eager, static or graph: auto is graph on CUDA and eager elsewhere."""
        if self.runtime.step_mode != StepMode.AUTO:
            return self.runtime.step_mode
        return StepMode.GRAPH if self.parallel.device.startswith("cuda") else StepMode.EAGER

    def rank_options(self, stage: int | None = None) -> "RankOptions":
        """What a driver or stage worker needs of this run (stage None: the driver)."""
        run = self.runtime
        min_step = run.stage_ms[stage] / 1e3 if run.stage_ms and stage is not None else 0.0
        step_mode = self.resolved_step_mode()
        if stage is not None and self.parallel.topology.tp > 1:
            step_mode = StepMode.EAGER  # TP shards run eager steps: their collectives are not captured in graphs
        return RankOptions(run.capacity, run.prefill_chunk, run.timeout_s, run.trace, step_mode, min_step,
                           self.chooser(), self.parallel.overlap_stage0, self.branch_policy(), self.verifies_on_last)

    def chooser(self) -> DraftChooser:
        """The draft sources of this run (engine/protocol/drafting.py)."""
        d = self.drafting
        if not d.suffix_drafts:
            return DraftChooser()
        return DraftChooser(SuffixSettings(d.suffix_max_len, d.suffix_min_match, self.max_run),
                            d.suffix_pdm_margin, d.suffix_cross_request)

    @property
    def max_run(self) -> int:
        """Tokens a suffix draft may carry (--suffix-run, or DEFAULT_SUFFIX_RUN where runs can travel)."""
        if self.drafting.suffix_run is not None:
            return self.drafting.suffix_run
        return DEFAULT_SUFFIX_RUN if self._runs_can_travel() else 1

    def _runs_can_travel(self) -> bool:
        topo = self.parallel.topology
        return (self.mode is Mode.SPD and self.drafting.suffix_drafts and topo.n >= 2 and self.drafting.branches == 1
                and topo.tp == 1 and self.model.dtype == "float32")

    def _check_suffix_runs(self) -> None:
        """Where suffix runs (--suffix-run K > 1) can travel: SPD with suffix drafts, n >= 2, one chain, one TP
        rank, an fp32 target."""
        d, topo = self.drafting, self.parallel.topology
        k = f"--suffix-run {d.suffix_run}"
        if self.mode is not Mode.SPD or not d.suffix_drafts:
            raise ValueError(f"{k} carries suffix drafts' runs: it needs --mode spd and --suffix-drafts on")
        if topo.n < 2:
            raise ValueError(f"{k} needs n >= 2 stages (at n = 1 a tick verifies its own draft)")
        if d.branches > 1:
            raise ValueError(f"{k} and --branches {d.branches} do not combine: a run is one chain")
        if topo.tp > 1:
            raise ValueError(f"{k} runs with --tp 1 only")
        if self.model.dtype != "float32":  # docs/design.md 3.13: an L-row step rounds otherwise than one-row steps
            raise ValueError(f"{k} needs --dtype float32: in {self.model.dtype} a run's rows round differently from "
                             f"greedy decoding's one-row steps, and the output could differ from greedy's")
        if d.suffix_run > self.runtime.prefill_chunk:
            raise ValueError(f"{k} exceeds the prefill chunk {self.runtime.prefill_chunk} (the stages' buffers)")

    def branch_policy(self) -> BranchPolicy:
        """Branch width and policy; here, not on Drafting, because the width's default depends on the mode."""
        return BranchPolicy(self.drafting.branches, self.drafting.branch_when)

    def plan(self) -> AnchorPlan:
        """The anchor plan: `drafting.anchors` when given, else a trained head's own (an SPD run's head reads
        the states its projections were trained on, whatever the split), else the defaults."""
        anchors, pdm = self.drafting.anchors, self.drafting.pdm
        if anchors is None and self.mode is Mode.SPD and pdm != "random":
            from spd_engine.engine.model.pdm import read_pdm_config

            anchors = read_pdm_config(pdm)[0].anchors
        return AnchorPlan.build(self.parallel.topology.bounds, anchors)

    def threads_per_rank(self, ranks_on_host: int | None = None) -> int:
        if self.parallel.threads is not None:
            return self.parallel.threads
        ranks = ranks_on_host or self.world_size
        return max(1, (os.cpu_count() or 1) // ranks)

    def replace(self, **kw) -> "RunConfig":
        """A copy with settings changed: whole groups (`drafting=Drafting(...)`), `mode`, or any group's field
        by its own name (`suffix_run=4`, `capacity=64`), routed to its group: field names are unique across
        the groups (GROUP_OF). A copy that cannot branch or carry suffix runs (not SPD) gets W = 1 and runs
        of 1 unless given."""
        if kw.get("mode", self.mode) != "spd":
            kw.setdefault("branches", 1)
            kw.setdefault("suffix_run", None)  # auto: 1 outside SPD
        top = {k: kw.pop(k) for k in list(kw) if k in RUN_FIELDS}
        for name in kw:
            if name not in GROUP_OF:
                raise TypeError(f"RunConfig has no setting {name!r}")
        for group in {GROUP_OF[name] for name in kw}:
            changed = {k: v for k, v in kw.items() if GROUP_OF[k] == group}
            top[group] = dataclasses.replace(top.get(group, getattr(self, group)), **changed)
        return dataclasses.replace(self, **top)


GROUPS = {"model": ModelSpec, "parallel": ParallelLayout, "drafting": Drafting, "runtime": Runtime}
RUN_FIELDS = ("mode", *GROUPS)
# a group field's name -> its group (RunConfig.replace, the flags' dotted names); names never repeat across groups
GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
assert len(GROUP_OF) == sum(len(dataclasses.fields(cls)) for cls in GROUPS.values()), "a field name repeats"


def run_fields() -> dict[str, dataclasses.Field]:
    """Every setting by its dotted name (`drafting.suffix_run`; `mode` alone): the flags' fields."""
    fields = {f"{group}.{f.name}": f for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    return {"mode": next(f for f in dataclasses.fields(RunConfig) if f.name == "mode"), **fields}


@dataclass(frozen=True)
class RankOptions:
    """The run settings a driver or a stage worker uses (RunConfig.rank_options)."""

    capacity: int = 2048  # KV slots per sequence
    prefill_chunk: int = 128  # prompt tokens per prefill message
    timeout_s: float = 60.0  # receive timeout inside a request
    trace: bool = False  # per-tick timestamps (timelines)
    step_mode: StepMode = StepMode.EAGER  # resolved: never AUTO
    min_step_s: float = 0.0  # synthetic stage step time: compute is padded to this (benchmarks, bubble tests)
    drafting: DraftChooser = DraftChooser()  # the driver's draft sources (PDM only by default)
    overlap_stage0: bool = False  # co-located: stage 0 steps on its own thread (engine/runtime/stage0_overlap.py)
    branches: BranchPolicy = BranchPolicy()  # branch width W and where branch points start
    verify_on_last: bool = False  # SPD: the last stage computes T=0 verification's argmax (RunConfig.parallel.verify_at)

    def __post_init__(self) -> None:
        assert self.step_mode != StepMode.AUTO, "resolve the step mode before building a rank"
