"""The settings groups a RunConfig (engine/runtime/run_config.py) is nested into, one per concern:
the target model (ModelSpec), where ranks run and how they talk (ParallelLayout), what drafts
(Drafting), and how a rank runs requests (Runtime). Each checks its own fields; checks that need
two groups are RunConfig's. Model sources: an engine checkpoint directory, or `random:<preset>`
(seeded random weights of a named shape, PRESETS; every rank builds the same tensors
independently, so no weights travel)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import torch

from spd_engine.engine.model.linear import LAYOUTS
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.suffix import SuffixSettings
from spd_engine.engine.protocol.topology import Topology, verifies_on_last

# P2P transports: gloo/NCCL (engine/comm/transport.py DistTransport) or shared-memory rings between
# the CPU ranks of one host (engine/comm/shm_transport.py); auto: shm where it can run, else the backend
TRANSPORTS = ("auto", "gloo", "shm")
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


def random_preset(spec: str) -> ModelConfig | None:
    """The config of a `random:<preset>` model source, None for a checkpoint path."""
    if not spec.startswith("random:"):
        return None
    name = spec.split(":", 1)[1]
    if name not in PRESETS:
        raise ValueError(f"unknown random model preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class ModelSpec:
    """The target model: where its weights come from, its shape, and how its weights are held."""

    source: str  # engine checkpoint dir or random:<preset>
    cfg: ModelConfig
    dtype: str = "float32"
    # T=0 greedy tokens of a head stage from an int8 screen of its LM head, recomputing the few
    # candidate rows in fp32 (kernels/screened_argmax.py); on where supported (a CPU, fp32 weights)
    head_screen: bool = True
    # the linear weights' memory layout (engine/model/linear.py): auto = on a CPU packed (2+ threads per
    # rank) or mixed (one), col without oneDNN; row elsewhere
    weight_layout: str = "auto"
    # (threads per rank, layout) that `spd bench` measured fastest for this model on this device
    # (engine/runtime/measured_layout.py): what `auto` takes on a CPU for ranks of those threads
    measured_layouts: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.weight_layout != "auto" and self.weight_layout not in LAYOUTS:
            raise ValueError(f"weight layout must be auto or one of {LAYOUTS}, got {self.weight_layout!r}")
        for threads, layout in self.measured_layouts:
            if threads < 1 or layout not in LAYOUTS:
                raise ValueError(f"a measured layout needs threads >= 1 and one of {LAYOUTS}, got {(threads, layout)}")
        if random_preset(self.source) is None and not Path(self.source).is_dir():
            raise ValueError(f"model checkpoint not found: {self.source}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ParallelLayout:
    """Where the ranks run and how they talk: the pipeline/TP topology, device, backend and transport."""

    topology: Topology
    device: str = "cpu"
    backend: str = "gloo"
    transport: str = "auto"  # TRANSPORTS: how ranks message each other (collectives stay on the backend)
    link_delay_us: float = 0.0  # emulated latency added to every message between ranks (0: none; docs/cluster.md)
    threads: int | None = None  # torch threads per rank; None: cores // ranks on the host (RunConfig.threads_per_rank)
    # SPD at T=0: who computes the target's argmax of the token leaving the last stage, "last" (that
    # stage, which then holds the head too), "driver", or "auto": last when the driver shares rank 0
    # with stage 0 (its rank is the busiest), driver when it has a rank of its own (docs/design.md 3.5)
    verify_at: str = "auto"
    overlap_stage0: bool = False  # co-located, n >= 2: stage 0's decode step overlaps the driver's draft and verify

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        verifies_on_last(self.verify_at, self.topology.colocate)  # names a bad verify_at
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "shm" and (self.backend != "gloo" or not self.device.startswith("cpu")):
            raise ValueError(f"--transport shm carries CPU tensors between ranks of one host: it needs "
                             f"--device cpu and the gloo backend, got {self.device} / {self.backend}")
        if not 0 <= self.link_delay_us < 1e6:
            raise ValueError(f"--link-delay-us must be in [0, 1e6), got {self.link_delay_us}")


@dataclass(frozen=True)
class Drafting:
    """What drafts: the PDM head, the suffix drafts beside it, branch chains, and the eagle baseline's head."""

    pdm: str = "random"  # PDM checkpoint dir or "random"
    pdm_layers: int = 1
    anchors: tuple[int, ...] | None = None
    # the PDM's weights and activations: auto = int8 weight rows with bf16 activations for an fp32 run on
    # a CPU with torch's int8 kernel, else bfloat16 on a CPU with bf16 matmul instructions (AVX512-BF16,
    # AMX), else the run's dtype; drafting only, so never the output
    pdm_dtype: str = "auto"
    # draft from the longest earlier occurrence of the context's suffix too (engine/protocol/suffix.py)
    suffix_drafts: bool = True
    suffix_min_match: int = 2  # shortest suffix match that may draft
    suffix_max_len: int = 16  # longest suffix looked up
    suffix_pdm_margin: float = float("inf")  # suffix drafts only where the PDM's top-1 margin is below this
    suffix_cross_request: bool = False  # also draft from the process's earlier requests (a server's)
    # tokens one suffix draft may carry through the stages as one entry (its run, docs/design.md 3.13); 1: none;
    # None: DEFAULT_SUFFIX_RUN where runs can travel, else 1 (RunConfig.max_run)
    suffix_run: int | None = None
    # branch width W: candidate chains a draft position may start (docs/design.md 3.11); None:
    # DEFAULT_BRANCHES for SPD, else 1 (resolved once, by RunConfig)
    branches: int | None = None
    branch_when: str = "refill"  # where a branch point may start (engine/protocol/branching.py WHEN)
    eagle_head: str = "random"  # --mode eagle: EAGLE head directory or "random" (engine/model/eagle_head.py)
    eagle_k: int = EAGLE_K  # --mode eagle: drafts per round

    def __post_init__(self) -> None:
        if self.pdm_dtype not in ("auto", "int8") and self.pdm_dtype not in DTYPES:
            raise ValueError(f"PDM dtype must be auto, int8 or one of {sorted(DTYPES)}, got {self.pdm_dtype!r}")
        if self.branches is not None:
            BranchPolicy(self.branches, self.branch_when)  # names a bad width or policy
        if self.suffix_run is not None and self.suffix_run < 1:
            raise ValueError(f"--suffix-run must be >= 1, got {self.suffix_run}")
        if self.suffix_drafts:
            SuffixSettings(self.suffix_max_len, self.suffix_min_match, self.suffix_run or 1)  # names a bad setting
        if not self.suffix_pdm_margin > 0:
            raise ValueError(f"suffix PDM margin must be > 0, got {self.suffix_pdm_margin}")
        if self.eagle_k < 1:
            raise ValueError(f"--eagle-k must be >= 1, got {self.eagle_k}")
        if self.eagle_head != "random" and not Path(self.eagle_head).is_dir():
            raise ValueError(f"EAGLE head not found: {self.eagle_head}")
        if self.pdm != "random" and not Path(self.pdm).is_dir():
            raise ValueError(f"PDM checkpoint not found: {self.pdm}")


@dataclass(frozen=True)
class Runtime:
    """How a rank runs its requests: KV capacity, prefill chunks, timeouts, seeds, step kind, tracing."""

    capacity: int = 2048  # KV slots per sequence
    prefill_chunk: int = 128  # prompt tokens per prefill message
    timeout_s: float = 60.0  # receive timeout inside a request
    seed: int = 0  # random weights' and untrained heads' seed (sampling has its own, per request)
    stage_ms: tuple[float, ...] | None = None  # synthetic per-stage decode step time (sleep-padded)
    trace: bool = False  # record per-tick timestamps on every rank (timeline plots)
    step_mode: StepMode = StepMode.AUTO  # one-token decode steps (a string is parsed once, here)

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_mode", StepMode.parse(self.step_mode))
        if self.prefill_chunk < 1 or self.timeout_s <= 0:
            raise ValueError("prefill chunk must be >= 1 and the timeout positive")
