"""What one `spd gpu-check` run checks: the report's keys, the lossless cases and sizes of the GPU
run and of the CPU dry run, and the wall-clock guard that shares the run's budget between sections."""
from __future__ import annotations

import time
from dataclasses import dataclass

SCHEMA = "spd-gpu-check/1"
# top-level keys of the report, the same in both modes (tests/bench/test_gpu_check.py)
REPORT_KEYS = ("schema", "mode", "environment", "plan", "lossless", "timings", "training", "not_checked",
               "summary")
TIMING_KEYS = ("host_sync_us", "syncs_per_tick", "shapes", "pdm_k", "anchor_gather", "stage_width",
               "colocated_tick", "profiles", "plans")
# what the plans beside each measured profile assume (both labelled ASSUMED in the report)
PLAN_LINK = (3.0, 400.0, 8.0)  # latency us, GB/s, all-reduce us: NVLink-like, `spd profile`'s default
PLAN_ALPHA = 0.7
NOT_CHECKED = (
    "NCCL between ranks (one GPU: ranks here are threads sharing one device and the in-process transport)",
    "tensor parallelism across GPUs (--tp needs one GPU per shard; its collectives are NCCL's)",
    "multi-node runs (links between hosts; `spd netbench` measures them where they exist)",
    "stages overlapping on separate GPUs (here every stage's kernels share one device)",
    "the HTTP server (fastapi is absent on the GPU host)",
    "GGUF checkpoints (the gguf package is absent on the GPU host)",
)


@dataclass(frozen=True)
class LosslessCase:
    shape: str  # a PRESETS name
    layers: int | None  # None: the preset's own count; else the first `layers` layers (real layer shapes)
    n: int
    step_mode: str
    dtype: str


@dataclass(frozen=True)
class CheckPlan:
    """What one run checks; `gpu_plan` and `dry_plan` differ only in sizes and devices."""
    device: str
    lossless: tuple[LosslessCase, ...]
    sampling_case: LosslessCase  # T > 0 twice, and branch width 2
    prompts: int
    prompt_len: int
    new_tokens: int
    capacity: int
    timing_shapes: tuple[str, ...]  # stage / PDM / verify / AR timings and the co-located tick
    timing_dtype: str
    ns: tuple[int, ...]
    context: int
    iters: int
    warmup: int
    pdm_ks: tuple[int, ...]
    widths: tuple[int, ...]
    kernel_shapes: tuple[str, ...]  # KERNEL_SHAPES names
    tick_tokens: int
    train_model: str
    train_steps: int
    train_seq: int
    train_batch: int
    budget_s: float  # the whole run; each section has its share below
    shares: tuple[tuple[str, float], ...]


def gpu_plan(device: str = "cuda") -> CheckPlan:
    # in the order they run: each shape's graphed bf16 n = 4 first, so that a time guard that cuts
    # the list short still leaves every shape checked once
    first = [LosslessCase("smollm2-135m", None, 4, "graph", "bfloat16"),
             LosslessCase("llama-3.2-1b", None, 4, "graph", "bfloat16"),
             # 16 of Qwen3-4B's 36 layers: every matrix has its real shape; fewer layers keep the
             # CPU-side random initialisation inside the window
             LosslessCase("qwen3-4b", 16, 4, "graph", "bfloat16"),
             LosslessCase("smollm2-135m", None, 4, "eager", "float32")]
    rest = [LosslessCase("smollm2-135m", None, n, m, d) for n in (2, 4, 8) for m in ("graph", "eager")
            for d in ("bfloat16", "float32")]
    rest += [LosslessCase("llama-3.2-1b", None, n, "graph", "bfloat16") for n in (2, 8)]
    rest += [LosslessCase("llama-3.2-1b", None, 4, "eager", "float32"),
             LosslessCase("qwen3-4b", 16, 8, "graph", "bfloat16"), LosslessCase("qwen3-4b", 16, 2, "eager", "float32")]
    cases = first + [c for c in rest if c not in first]
    return CheckPlan(
        device=device, lossless=tuple(cases), sampling_case=LosslessCase("smollm2-135m", None, 4, "graph", "bfloat16"),
        prompts=2, prompt_len=24, new_tokens=32, capacity=256,
        timing_shapes=("smollm2-135m", "qwen3-4b"), timing_dtype="bfloat16", ns=(2, 4, 8), context=1024,
        iters=20, warmup=3, pdm_ks=(1, 2, 4), widths=(1, 2, 4), kernel_shapes=("smollm2-135m", "qwen3-4b"),
        tick_tokens=48, train_model="random:smollm2-135m", train_steps=12, train_seq=256, train_batch=4,
        budget_s=240.0, shares=(("lossless", 0.40), ("timings", 0.40), ("training", 0.20)))


def dry_plan() -> CheckPlan:
    cases = [LosslessCase("tiny-llama", None, n, m, "float32") for n in (2, 4) for m in ("static", "eager")]
    cases += [LosslessCase("tiny-qwen3", None, 2, "static", "bfloat16")]
    return CheckPlan(
        device="cpu", lossless=tuple(cases), sampling_case=LosslessCase("tiny-llama", None, 2, "static", "float32"),
        prompts=1, prompt_len=8, new_tokens=10, capacity=128,
        timing_shapes=("tiny-llama",), timing_dtype="float32", ns=(2, 4), context=32, iters=2, warmup=1,
        pdm_ks=(1, 2), widths=(1, 2), kernel_shapes=("smollm2-135m",), tick_tokens=12,
        train_model="random:tiny-llama", train_steps=9, train_seq=16, train_batch=2,
        budget_s=50.0, shares=(("lossless", 0.40), ("timings", 0.40), ("training", 0.20)))


class Deadline:
    """Wall-clock guard: a section runs its items while its own share and the whole run's are left."""

    def __init__(self, total_s: float) -> None:
        self.t0, self.total = time.perf_counter(), total_s
        self.section_end = self.t0 + total_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def start_section(self, share_s: float) -> None:
        self.section_end = min(self.t0 + self.total, time.perf_counter() + share_s)

    def left(self) -> float:
        return self.section_end - time.perf_counter()
