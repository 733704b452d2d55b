"""The run configuration: one explicit, validated object every rank builds its part from.

Model sources: an engine checkpoint directory, or `random:<preset>` (seeded random weights of a
named shape; every rank builds the same tensors independently, so no weights travel). PDM
sources: a PDM checkpoint directory, or `random` (an untrained head; output stays lossless); the
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

from spd_engine.engine.model.linear import LAYOUTS, resolve_layout
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.engine.model.tp_shard import check_tp
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.drafting import DraftChooser
from spd_engine.engine.protocol.suffix import SuffixSettings
from spd_engine.engine.protocol.topology import VERIFY_AT, Topology, verifies_on_last  # noqa: F401 (VERIFY_AT: re-exported)
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
# P2P transports: gloo/NCCL (engine/comm/transport.py DistTransport) or shared-memory rings between
# the CPU ranks of one host (engine/comm/shm_transport.py); auto: shm where it can run, else the backend
TRANSPORTS = ("auto", "gloo", "shm")
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
EAGLE_K = 2  # draft chain length of --mode eagle: the shipped head accepts nothing past step 2 (docs/results/eagle-baseline.md)


class StepMode(str, enum.Enum):
    """How the stages' and the driver's one-token decode steps run (engine/model/graphs.py)."""

    AUTO = "auto"  # graph on CUDA, eager elsewhere (resolved once, in RunConfig)
    EAGER = "eager"  # plain module calls
    STATIC = "static"  # preallocated buffers, device-side position and mask: the graph path's code, run eagerly
    GRAPH = "graph"  # static steps captured as CUDA graphs

    @classmethod
    def parse(cls, value: "str | StepMode") -> "StepMode":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"step mode must be one of {STEP_MODES}, got {value!r}") from None


STEP_MODES = tuple(m.value for m in StepMode)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _shape(arch, vocab, hidden, inter, layers, heads, kv, head_dim, tie, **kw) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=head_dim, tie_embeddings=tie,
                       max_position=8192, eos_token_ids=(2,), **kw)


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": tiny_config("llama"),
    "tiny-qwen2": tiny_config("qwen2"),
    "tiny-qwen3": tiny_config("qwen3"),
    "smollm2-135m": _shape("llama", 49152, 576, 1536, 30, 9, 3, 64, True, rope_theta=100000.0),
    # SmolLM2-135M's size with 8 heads / 4 KV heads (head_dim 72): --tp 2 divides it (2-core TP checks)
    "smollm2-135m-tp2": _shape("llama", 49152, 576, 1536, 30, 8, 4, 72, True, rope_theta=100000.0),
    "llama-3.2-1b": _shape("llama", 128256, 2048, 8192, 16, 32, 8, 64, True, rope_theta=500000.0),
    "qwen3-4b": _shape("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, True, qk_norm=True, rope_theta=1e6),
    "llama-3.1-8b": _shape("llama", 128256, 4096, 14336, 32, 32, 8, 128, False, rope_theta=500000.0),
}


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


def random_preset(spec: str) -> ModelConfig | None:
    """The config of a `random:<preset>` model source, None for a checkpoint path."""
    if not spec.startswith("random:"):
        return None
    name = spec.split(":", 1)[1]
    if name not in PRESETS:
        raise ValueError(f"unknown random model preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class RunConfig:
    model: str  # engine checkpoint dir or random:<preset>
    cfg: ModelConfig
    topology: Topology
    mode: Mode = Mode.SPD  # a string is parsed once, here
    pdm: str = "random"  # PDM checkpoint dir or "random"
    pdm_layers: int = 1
    anchors: tuple[int, ...] | None = None
    backend: str = "gloo"
    device: str = "cpu"
    dtype: str = "float32"
    capacity: int = 2048
    prefill_chunk: int = 128
    timeout_s: float = 60.0
    threads: int | None = None
    seed: int = 0
    stage_ms: tuple[float, ...] | None = None  # synthetic per-stage decode step time (sleep-padded)
    trace: bool = False  # record per-tick timestamps on every rank (timeline plots)
    step_mode: StepMode = StepMode.AUTO  # one-token decode steps (a string is parsed once, here)
    # draft from the longest earlier occurrence of the context's suffix too (engine/protocol/suffix.py)
    suffix_drafts: bool = True
    suffix_min_match: int = 2  # shortest suffix match that may draft
    suffix_max_len: int = 16  # longest suffix looked up
    suffix_pdm_margin: float = float("inf")  # suffix drafts only where the PDM's top-1 margin is below this
    suffix_cross_request: bool = False  # also draft from the process's earlier requests (a server's)
    # tokens one suffix draft may carry through the stages as one entry (its run, docs/design.md 3.13); 1: none;
    # None: DEFAULT_SUFFIX_RUN where runs can travel, else 1 (the `max_run` property)
    suffix_run: int | None = None
    overlap_stage0: bool = False  # co-located, n >= 2: stage 0's decode step overlaps the driver's draft and verify
    eagle_head: str = "random"  # --mode eagle: EAGLE head directory or "random" (engine/model/eagle_head.py)
    eagle_k: int = EAGLE_K  # --mode eagle: drafts per round
    # branch width W: candidate chains a draft position may start (docs/design.md 3.11); None:
    # DEFAULT_BRANCHES for SPD, else 1 (resolved once, here)
    branches: int | None = None
    branch_when: str = "refill"  # where a branch point may start (engine/protocol/branching.py WHEN)
    transport: str = "auto"  # TRANSPORTS: how ranks message each other (collectives stay on the backend)
    link_delay_us: float = 0.0  # emulated latency added to every message between ranks (0: none; docs/cluster.md)
    # SPD at T=0: who computes the target's argmax of the token leaving the last stage, "last" (that
    # stage, which then holds the head too), "driver", or "auto": last when the driver shares rank 0
    # with stage 0 (its rank is the busiest), driver when it has a rank of its own (docs/design.md 3.5)
    verify_at: str = "auto"
    # T=0 greedy tokens of a head stage from an int8 screen of its LM head, recomputing the few
    # candidate rows in fp32 (kernels/screened_argmax.py); on where supported (a CPU, fp32 weights)
    head_screen: bool = True
    # the PDM's weights and activations: auto = int8 weight rows with bf16 activations for an fp32 run on
    # a CPU with torch's int8 kernel, else bfloat16 on a CPU with bf16 matmul instructions (AVX512-BF16,
    # AMX), else the run's dtype; drafting only, so never the output
    pdm_dtype: str = "auto"
    # the linear weights' memory layout (engine/model/linear.py): auto = on a CPU packed (2+ threads per
    # rank) or mixed (one), col without oneDNN; row elsewhere
    weight_layout: str = "auto"
    # (threads per rank, layout) that `spd bench` measured fastest for this model on this device
    # (engine/runtime/measured_layout.py): what `auto` takes on a CPU for ranks of those threads
    measured_layouts: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if self.stage_ms is not None and (len(self.stage_ms) != self.topology.n or min(self.stage_ms) < 0):
            raise ValueError(f"stage_ms needs {self.topology.n} non-negative values, got {self.stage_ms}")
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.pdm_dtype not in ("auto", "int8") and self.pdm_dtype not in DTYPES:
            raise ValueError(f"PDM dtype must be auto, int8 or one of {sorted(DTYPES)}, got {self.pdm_dtype!r}")
        object.__setattr__(self, "step_mode", StepMode.parse(self.step_mode))
        for threads, layout in self.measured_layouts:
            if threads < 1 or layout not in LAYOUTS:
                raise ValueError(f"a measured layout needs threads >= 1 and one of {LAYOUTS}, got {(threads, layout)}")
        self.resolved_weight_layout  # names a bad layout
        if self.branches is None:
            auto = DEFAULT_BRANCHES if self.mode is Mode.SPD else 1
            object.__setattr__(self, "branches", auto)
        self.branch_policy()  # BranchPolicy names a bad width or policy
        if self.suffix_run is not None and self.suffix_run < 1:
            raise ValueError(f"--suffix-run must be >= 1, got {self.suffix_run}")
        self.chooser()  # SuffixSettings names a bad suffix setting
        if self.branches > 1 and self.mode is not Mode.SPD:
            raise ValueError(f"--branches {self.branches} needs --mode spd (branch chains are SPD drafts)")
        if not self.suffix_pdm_margin > 0:
            raise ValueError(f"suffix PDM margin must be > 0, got {self.suffix_pdm_margin}")
        if self.suffix_run is not None and self.suffix_run > 1:
            self._check_suffix_runs()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        verifies_on_last(self.verify_at, self.topology.colocate)  # names a bad verify_at
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "shm" and (self.backend != "gloo" or not self.device.startswith("cpu")):
            raise ValueError(f"--transport shm carries CPU tensors between ranks of one host: it needs "
                             f"--device cpu and the gloo backend, got {self.device} / {self.backend}")
        if self.topology.num_layers != self.cfg.num_layers:
            raise ValueError(f"stage layers {list(self.topology.stage_layers)} sum to {self.topology.num_layers}, "
                             f"the model has {self.cfg.num_layers} layers")
        if self.mode.one_rank and self.topology.n != 1:
            raise ValueError(f"--mode {self.mode} runs the whole model on one rank: use --stages 1")
        if self.mode.one_rank and self.topology.tp != 1:
            raise ValueError(f"--mode {self.mode} runs the whole model on one rank: use --mode tp for --tp > 1")
        if self.mode is Mode.TP and self.topology.n != 1:
            raise ValueError("--mode tp runs the whole model as one stage over the TP ranks: use --stages 1")
        if self.topology.tp > 1:
            check_tp(self.cfg, self.topology.tp)
        if self.eagle_k < 1:
            raise ValueError(f"--eagle-k must be >= 1, got {self.eagle_k}")
        if self.eagle_head != "random" and not Path(self.eagle_head).is_dir():
            raise ValueError(f"EAGLE head not found: {self.eagle_head}")
        if self.capacity < 2 or self.capacity > self.cfg.max_position:
            raise ValueError(f"KV capacity {self.capacity} must be in [2, max_position={self.cfg.max_position}]")
        if not 0 <= self.link_delay_us < 1e6:
            raise ValueError(f"--link-delay-us must be in [0, 1e6), got {self.link_delay_us}")
        if self.prefill_chunk < 1 or self.timeout_s <= 0:
            raise ValueError("prefill chunk must be >= 1 and the timeout positive")
        if random_preset(self.model) is None and not Path(self.model).is_dir():
            raise ValueError(f"model checkpoint not found: {self.model}")
        if self.pdm != "random" and not Path(self.pdm).is_dir():
            raise ValueError(f"PDM checkpoint not found: {self.pdm}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def pdm_int8(self) -> bool:
        """Whether the PDM's matmuls run over int8 weight rows (kernels/int8_linear.py), bf16 activations:
        asked, or auto for an fp32 run on a CPU where torch has the int8 kernel (docs/design.md 3.5)."""
        if self.pdm_dtype == "auto":
            return self.device.startswith("cpu") and self.dtype == "float32" and int8_kernel_available()
        return self.pdm_dtype == "int8"

    @property
    def pdm_torch_dtype(self) -> torch.dtype:
        """The PDM's activation dtype (`pdm_dtype` resolved for this run's device)."""
        if self.pdm_int8:
            return torch.bfloat16
        if self.pdm_dtype != "auto":
            return DTYPES[self.pdm_dtype]
        if self.device.startswith("cpu") and self.dtype == "float32" and cpu_has_bf16_matmul():
            return torch.bfloat16
        return self.torch_dtype

    @property
    def resolved_weight_layout(self) -> str:
        """This run's linear weights' layout (engine/model/linear.py), resolved for its device and
        its ranks' intra-op threads."""
        threads = self.threads_per_rank()
        return resolve_layout(self.weight_layout, self.device, threads, dict(self.measured_layouts).get(threads))

    @property
    def world_size(self) -> int:
        if self.mode is Mode.SPD:
            return self.topology.world_size
        if self.mode is Mode.EAGLE:
            return 1  # one rank: the target and the draft head
        return dataclasses.replace(self.topology, colocate=True).world_size  # pp/tp/ar: n T stage ranks

    @property
    def verifies_on_last(self) -> bool:
        """Whether the last stage holds the head and computes T=0 verification's argmax (SPD, n >= 2;
        with n = 1 the last stage is the driver's own stage 0)."""
        return self.mode is Mode.SPD and self.topology.n >= 2 and verifies_on_last(self.verify_at, self.topology.colocate)

    def resolved_step_mode(self) -> StepMode:
        """eager, static or graph: auto is graph on CUDA and eager elsewhere."""
        if self.step_mode != StepMode.AUTO:
            return self.step_mode
        return StepMode.GRAPH if self.device.startswith("cuda") else StepMode.EAGER

    def rank_options(self, stage: int | None = None) -> "RankOptions":
        """What a driver or stage worker needs of this run (stage None: the driver)."""
        min_step = self.stage_ms[stage] / 1e3 if self.stage_ms and stage is not None else 0.0
        step_mode = self.resolved_step_mode()
        if stage is not None and self.topology.tp > 1:
            step_mode = StepMode.EAGER  # TP shards run eager steps: their collectives are not captured in graphs
        return RankOptions(self.capacity, self.prefill_chunk, self.timeout_s, self.trace,
                           step_mode, min_step, self.chooser(), self.overlap_stage0, self.branch_policy(),
                           self.verifies_on_last)

    def chooser(self) -> DraftChooser:
        """The draft sources of this run (engine/protocol/drafting.py)."""
        if not self.suffix_drafts:
            return DraftChooser()
        return DraftChooser(SuffixSettings(self.suffix_max_len, self.suffix_min_match, self.max_run),
                            self.suffix_pdm_margin, self.suffix_cross_request)

    @property
    def max_run(self) -> int:
        """Tokens a suffix draft may carry (--suffix-run, or DEFAULT_SUFFIX_RUN where runs can travel)."""
        if self.suffix_run is not None:
            return self.suffix_run
        return DEFAULT_SUFFIX_RUN if self._runs_can_travel() else 1

    def _runs_can_travel(self) -> bool:
        return (self.mode is Mode.SPD and self.suffix_drafts and self.topology.n >= 2 and self.branches == 1
                and self.topology.tp == 1 and self.dtype == "float32")

    def _check_suffix_runs(self) -> None:
        """Where suffix runs (--suffix-run K > 1) can travel: SPD with suffix drafts, n >= 2, one chain, one TP
        rank, an fp32 target."""
        k = f"--suffix-run {self.suffix_run}"
        if self.mode is not Mode.SPD or not self.suffix_drafts:
            raise ValueError(f"{k} carries suffix drafts' runs: it needs --mode spd and --suffix-drafts on")
        if self.topology.n < 2:
            raise ValueError(f"{k} needs n >= 2 stages (at n = 1 a tick verifies its own draft)")
        if self.branches > 1:
            raise ValueError(f"{k} and --branches {self.branches} do not combine: a run is one chain")
        if self.topology.tp > 1:
            raise ValueError(f"{k} runs with --tp 1 only")
        if self.dtype != "float32":  # docs/design.md 3.13: an L-row step rounds otherwise than one-row steps
            raise ValueError(f"{k} needs --dtype float32: in {self.dtype} a run's rows round differently from "
                             f"greedy decoding's one-row steps, and the output could differ from greedy's")
        if self.suffix_run > self.prefill_chunk:
            raise ValueError(f"{k} exceeds the prefill chunk {self.prefill_chunk} (the stages' buffers)")

    def branch_policy(self) -> BranchPolicy:
        return BranchPolicy(self.branches, self.branch_when)

    def plan(self) -> AnchorPlan:
        """The anchor plan: `anchors` when given, else a trained head's own (an SPD run's head reads
        the states its projections were trained on, whatever the split), else the defaults."""
        anchors = self.anchors
        if anchors is None and self.mode is Mode.SPD and self.pdm != "random":
            from spd_engine.engine.model.pdm import read_pdm_config

            anchors = read_pdm_config(self.pdm)[0].anchors
        return AnchorPlan.build(self.topology.bounds, anchors)

    def threads_per_rank(self, ranks_on_host: int | None = None) -> int:
        if self.threads is not None:
            return self.threads
        ranks = ranks_on_host or self.world_size
        return max(1, (os.cpu_count() or 1) // ranks)

    def replace(self, **kw) -> "RunConfig":
        """A copy with fields changed; one that cannot branch or carry suffix runs (not SPD) gets W = 1
        and runs of 1 unless given."""
        if "branches" not in kw and kw.get("mode", self.mode) != "spd":
            kw["branches"] = 1
        if "suffix_run" not in kw and kw.get("mode", self.mode) != "spd":
            kw["suffix_run"] = None  # auto: 1 outside SPD
        return dataclasses.replace(self, **kw)


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
    verify_on_last: bool = False  # SPD: the last stage computes T=0 verification's argmax (RunConfig.verify_at)

    def __post_init__(self) -> None:
        assert self.step_mode != StepMode.AUTO, "resolve the step mode before building a rank"
