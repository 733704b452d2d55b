"""Every GPU path of the engine checked on one CUDA device in one run (`spd gpu-check`, `make gpu-check`).

A GPU window is short and has no network, so this is one script with a time guard that writes
OUT/gpu-check.json and OUT/gpu-check.md (docs/gpu-check.md):

- lossless: SPD at n = 2, 4, 8 with every rank a thread of this process on the one device
  (engine/runtime/reference.py: the very driver and stage objects of a distributed run, over the
  in-process transport, so what differs from a multi-GPU run is only the transport), random
  weights of real shapes, eager and CUDA-graph steps, fp32 and bf16. The oracle is greedy
  decoding through the same steps on the same device (the `pp` baseline with the same split,
  step mode and dtype: docs/testing.md, the same computation, so tokens must be bit-equal), with
  the head's own drafts and with oracle drafts that are wrong at fixed positions (accepts and
  rejections both happen). T > 0 keyed sampling twice; branch width 2 (equal up to a near-tie);
- timings, written as `spd-profile/1` JSONs that `spd plan --profile` reads (bench/profiling.py):
  per stage, PDM at K = 1, 2, 4, verification, the AR step, graph against eager, host syncs per
  tick, the anchor-gather kernel against its torch reference, a W-row stage step, and the
  co-located tick against its stages' compute (the per-tick overhead beyond compute as a share
  of a stage);
- training: a few bf16 steps of `spd train` (PDM) and `spd train --method eagle`;
- what one GPU cannot check, listed as not checked.

The dry run (`--dry`) is the same code on the CPU with tiny shapes and the same report keys, in
the default test suite, so the script cannot rot between GPU windows. Every item that is not run
(the time guard, no CUDA, no triton) says so in the report; nothing is filled in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

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


# ---------------------------------------------------------------- helpers

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(err: BaseException) -> str:
    """One line for the report: the exception and where it was raised."""
    tb = traceback.extract_tb(err.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}{where}"


@torch.no_grad()
def _fill_random_(module: torch.nn.Module, seed: int, tied: bool) -> torch.nn.Module:
    """Random weights drawn on the module's device, each tensor from a generator seeded by its
    name (a stage's layers get the same weights as the full model's, a tied head its embedding):
    norms near 1, the rest std 0.02."""
    for name, p in module.named_parameters():
        key = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.02 * noise)
    return module


@contextlib.contextmanager
def device_random_weights() -> Iterator[None]:
    """Random presets built on the run's device. The engine draws a random preset's weights on
    the CPU in fp32 and copies them over (engine/runtime/build.py): for a 4B shape that is minutes of CPU
    per executor, more than the GPU window holds. Inside this context the ranks' stages, the
    driver's head and the untrained PDM are made on the device instead, with the same rule for
    every executor (seeded by name), so an oracle and an SPD run still hold equal weights."""
    import spd_engine.engine.runtime.build as build_mod
    import spd_engine.engine.runtime.roles as roles_mod
    from spd_engine.engine.model.model import StageModel
    from spd_engine.engine.model.pdm import PDM, PDMConfig
    from spd_engine.engine.protocol.anchors import AnchorPlan
    from spd_engine.engine.runtime.run_config import random_preset
    from spd_engine.engine.protocol.topology import stage_bounds

    saved = (build_mod.build_stage_model, roles_mod.build_stage_model, roles_mod.build_pdm)

    def stage(ecfg, layers: range, embedding: bool, head: bool):
        if random_preset(ecfg.model) is None:
            return saved[0](ecfg, layers, embedding, head)
        model = StageModel(ecfg.cfg, layers, embedding=embedding, head=head, device=ecfg.device,
                           dtype=ecfg.torch_dtype)
        return _fill_random_(model, ecfg.seed, ecfg.cfg.tie_embeddings).eval()

    def pdm(ecfg):
        if ecfg.pdm != "random":
            return saved[2](ecfg)
        layers = tuple(ecfg.topology.stage_layers)
        plan = AnchorPlan.build(stage_bounds(list(layers)), ecfg.anchors)
        pcfg = PDMConfig(layers, plan.anchors, ecfg.pdm_layers, None, ecfg.cfg.fingerprint())
        head = PDM(ecfg.cfg, pcfg, device=ecfg.device, dtype=ecfg.torch_dtype)
        return _fill_random_(head, ecfg.seed + 1, False).eval()

    build_mod.build_stage_model = roles_mod.build_stage_model = stage
    roles_mod.build_pdm = pdm
    try:
        yield
    finally:
        build_mod.build_stage_model, roles_mod.build_stage_model, roles_mod.build_pdm = saved


@contextlib.contextmanager
def graph_modes() -> Iterator[list[str]]:
    """The mode of every step graph built inside (engine/model/graphs.py StepGraph): 'cuda graph', or the
    eager fallback with its reason. A graph run whose steps fell back must not pass as graphed."""
    from spd_engine.engine.model.graphs import StepGraph

    modes: list[str] = []
    original = StepGraph.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        modes.append(self.mode)

    StepGraph.__init__ = init
    try:
        yield modes
    finally:
        StepGraph.__init__ = original


def environment(device: str) -> dict:
    """What every figure of the report is labelled with."""
    env = {"device": device, "device_name": "cpu", "driver": None, "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": None, "triton": None, "python": platform.python_version(),
           "host": platform.node(), "cpu_count": os.cpu_count(),
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda"):
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        env.update(device_name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
        env["driver"] = _nvidia_driver()
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version: nvidia-smi's, else the kernel module's (/proc/driver/nvidia/version),
    else None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass  # no nvidia-smi on PATH: the kernel module's version below
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = [w for w in first.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else first.strip()


def label(env: dict) -> str:
    """The one-line label every table carries."""
    return (f"{env['device_name']}, driver {env['driver'] or '-'}, torch {env['torch']}, CUDA {env['cuda'] or '-'}, "
            f"triton {env['triton'] or '-'}, Python {env['python']}")


# ---------------------------------------------------------------- lossless

def _case_config(case: LosslessCase, plan: CheckPlan, mode: str, colocate: bool = False, **kw):
    from spd_engine.engine.runtime.run_config import PRESETS, RunConfig
    from spd_engine.engine.protocol.topology import Topology

    cfg = PRESETS[case.shape]
    if case.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=case.layers)
    topo = Topology.build(cfg.num_layers, case.n, colocate=colocate)
    return RunConfig(model=f"random:{case.shape}", cfg=cfg, topology=topo, mode=mode, device=plan.device,
                     dtype=case.dtype, capacity=plan.capacity, step_mode=case.step_mode, timeout_s=120.0,
                     seed=0, **kw)


def _prompts(plan: CheckPlan, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (plan.prompt_len,), generator=gen).tolist() for _ in range(plan.prompts)]


class ForcedDrafts:
    """Drafts the oracle's token except at every `wrong_every`-th generated index (0: never), where
    a wrong one goes: accepts and rejections both happen (the head's own drafts on random weights
    are mostly wrong)."""

    def __init__(self, ref: list[int], prompt_len: int, vocab: int, wrong_every: int = 3) -> None:
        self.ref, self.P, self.vocab, self.wrong_every = ref, prompt_len, vocab, wrong_every

    def __call__(self, position: int, pdm_draft: int) -> int:
        i = position - self.P
        if not 0 <= i < len(self.ref):
            return pdm_draft
        wrong = self.wrong_every > 0 and i % self.wrong_every == 0
        return (self.ref[i] + 1) % self.vocab if wrong else self.ref[i]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless_case(case: LosslessCase, plan: CheckPlan) -> dict:
    """SPD (own drafts, forced drafts) against greedy through the same steps on the same device."""
    from spd_engine.engine.runtime.reference import ReferenceExecutor

    t0 = time.perf_counter()
    out = {"case": dataclasses.asdict(case), "status": "error", "oracle": "pp baseline, same split/steps/dtype",
           "prompts": plan.prompts, "new_tokens": plan.new_tokens}
    ecfg = _case_config(case, plan, "spd")
    prompts = _prompts(plan, ecfg.cfg.vocab_size)
    with graph_modes() as modes:
        with ReferenceExecutor(_case_config(case, plan, "pp")) as ex:
            refs = [ex.generate(p, plan.new_tokens).tokens for p in prompts]
        own, forced, ticks, accepted = [], [], 0, 0
        with ReferenceExecutor(ecfg) as ex:
            for p, ref in zip(prompts, refs):
                r = ex.generate(p, plan.new_tokens)
                own.append(r.tokens)
                f = ex.generate(p, plan.new_tokens, draft_policy=ForcedDrafts(ref, len(p), ecfg.cfg.vocab_size))
                forced.append(f.tokens)
                ticks += f.ticks
                accepted += f.accepted
    graphed = sum(m == "cuda graph" for m in modes)
    diffs = [_first_diff(got, ref) for got, ref in zip(own + forced, refs + refs)]
    equal = all(d is None for d in diffs)
    out.update(status="pass" if equal else "fail", bit_equal=equal,
               first_difference=[d for d in diffs if d is not None][:1] or None,
               forced_accepted=accepted, forced_ticks=ticks, step_graphs=len(modes), graphed=graphed,
               fallbacks=sorted({m for m in modes if m != "cuda graph"}) if modes else [],
               seconds=round(time.perf_counter() - t0, 2))
    if case.step_mode == "graph" and graphed < len(modes):
        out["status"] = "fail"  # a graph run whose steps ran eagerly did not check the graphs
        out["why"] = f"{len(modes) - graphed} of {len(modes)} step graphs fell back to eager"
    return out


def sampling_checks(plan: CheckPlan) -> dict:
    """T > 0: the same keyed draws give the same tokens twice; branch width 2 at T = 0 equals
    greedy through the same steps, or first differs at a near-tie (docs/testing.md)."""
    from spd_engine.engine.runtime.reference import ReferenceExecutor
    from spd_engine.engine.protocol.sampling import SamplingParams

    case = plan.sampling_case
    ecfg = _case_config(case, plan, "spd")
    prompts = _prompts(plan, ecfg.cfg.vocab_size)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    out: dict = {"case": dataclasses.asdict(case)}
    with ReferenceExecutor(ecfg) as ex:
        first = [ex.generate(p, plan.new_tokens, sampling=sp).tokens for p in prompts]
        second = [ex.generate(p, plan.new_tokens, sampling=sp).tokens for p in prompts]
    out["sampling_twice"] = {"status": "pass" if first == second else "fail", "temperature": 1.0, "top_p": 0.9,
                             "seed": 7, "tokens": sum(map(len, first))}
    with ReferenceExecutor(_case_config(case, plan, "pp")) as ex:
        refs = [ex.generate(p, plan.new_tokens).tokens for p in prompts]
    with ReferenceExecutor(_case_config(case, plan, "spd", branches=2)) as ex:
        got, saves = [], 0
        for p, ref in zip(prompts, refs):
            r = ex.generate(p, plan.new_tokens, draft_policy=ForcedDrafts(ref, len(p), ecfg.cfg.vocab_size))
            got.append(r.tokens)
            saves += r.branch_points
    diffs = [_first_diff(g, r) for g, r in zip(got, refs)]
    branch = {"status": "pass", "width": 2, "branch_points": saves, "first_difference": None}
    for p, g, r, d in zip(prompts, got, refs, diffs):
        if d is None:
            continue
        gap = _logit_gap(ecfg, p, r, d, g[d] if d < len(g) else None)
        bound = 2 * _tie_bound(case.dtype)
        branch.update(first_difference=d, logit_gap=gap, near_tie_bound=bound,
                      status="pass (near-tie)" if gap is not None and gap <= bound else "fail")
        break
    out["branch_width_2"] = branch
    return out


def _tie_bound(dtype: str) -> float:
    """A bound on |logit difference| between two computations of the same logits that differ in
    summation order: fp32 as docs/testing.md measures it; bf16 rounds each product to 8 bits."""
    return 1e-4 if dtype == "float32" else 5e-2


@torch.no_grad()
def _logit_gap(ecfg, prompt: list[int], ref: list[int], k: int, other: int | None) -> float | None:
    """|logit(ref[k]) - logit(other)| at the divergence, from the full model teacher-forced."""
    from spd_engine.engine.runtime.build import build_stage_model

    if other is None:
        return None
    model = build_stage_model(ecfg, range(ecfg.cfg.num_layers), embedding=True, head=True)
    ids = torch.tensor([list(prompt) + list(ref[:k])], device=ecfg.device)
    h, _ = model.forward_layers(model.embed(ids), model.new_cache(1, ids.shape[1]), 0)
    logits = model.logits(h[:, -1])[0].float()
    return abs(float(logits[ref[k]] - logits[other]))


def run_lossless(plan: CheckPlan, dl: Deadline, log: Callable[[str], None]) -> dict:
    cases = []
    with device_random_weights():
        for case in plan.lossless:
            if dl.left() <= 0:
                cases.append({"case": dataclasses.asdict(case), "status": "skipped (time budget)"})
                continue
            try:
                res = lossless_case(case, plan)
            except Exception as err:  # one failing configuration must not hide the others' results
                res = {"case": dataclasses.asdict(case), "status": "error", "error": _error(err)}
            cases.append(res)
            log(f"  lossless {case.shape} n={case.n} {case.step_mode} {case.dtype}: {res['status']}"
                f" ({res.get('seconds', '-')} s)")
            _free(torch.device(plan.device))
        if dl.left() > 0:
            try:
                sampling = sampling_checks(plan)
            except Exception as err:  # reported, and the rest of the run goes on
                sampling = {"status": "error", "error": _error(err)}
        else:
            sampling = {"status": "skipped (time budget)"}
    log(f"  T>0 twice / branch width 2: {sampling.get('sampling_twice', sampling).get('status')} / "
        f"{sampling.get('branch_width_2', sampling).get('status')}")
    return {"cases": cases, "sampling": sampling}


# ---------------------------------------------------------------- timings

def _settings(plan: CheckPlan, pdm_layers: int = 1):
    from spd_engine.bench.profiling import DeviceSettings

    return DeviceSettings(device=plan.device, dtype=plan.timing_dtype, ns=plan.ns, context=plan.context,
                          iters=plan.iters, warmup=plan.warmup, graphs=plan.device.startswith("cuda"),
                          pdm_layers=pdm_layers, seed=0)


def syncs_per_tick(plan: CheckPlan) -> dict:
    """Host syncs per decode tick of the co-located runtime on CUDA: torch's sync debug mode warns
    at every synchronizing call; two requests of different lengths give the per-tick count
    (prefill cancels out). Not measurable on the CPU."""
    if not plan.device.startswith("cuda"):
        return {"status": "not run (CPU: no device synchronisation to count)", "per_tick": None}
    from spd_engine.engine.runtime.reference import ReferenceExecutor

    case = dataclasses.replace(plan.sampling_case, step_mode="graph")
    ecfg = _case_config(case, plan, "spd", colocate=True)
    prompt = _prompts(plan, ecfg.cfg.vocab_size)[0]
    counts = {}
    with device_random_weights(), ReferenceExecutor(ecfg) as ex:
        ex.generate(prompt, 8)  # warm-up: graphs, allocator
        for new in (8, 8 + plan.tick_tokens):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    res = ex.generate(prompt, new)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts[new] = (sum("synchroniz" in str(w.message) for w in caught), res.ticks)
    (s0, t0), (s1, t1) = counts.values()
    if s1 == 0:  # the decode reads ids on the host every tick: no warning at all means none was caught
        return {"status": "error", "error": "no sync warnings were caught (torch's sync debug mode gave none)",
                "per_tick": None}
    return {"status": "measured", "per_tick": (s1 - s0) / max(1, t1 - t0), "n": case.n, "shape": case.shape,
            "how": "torch.cuda sync debug mode warnings, difference of two request lengths"}


def stage_width_ms(cfg, plan: CheckPlan, layers: int, prefix: int = 300) -> dict[int, float]:
    """Median ms of one stage step of `layers` layers carrying W tokens at one position with a
    tree mask (bench/stage_width_time.py's shape of a branch step), on the plan's device."""
    from spd_engine.bench.profiling import randomize_, time_ms
    from spd_engine.bench.stage_width_time import tree_mask
    from spd_engine.engine.model.model import StageModel
    from spd_engine.engine.runtime.run_config import DTYPES

    dev, dt = torch.device(plan.device), DTYPES[plan.timing_dtype]
    stage = randomize_(StageModel(cfg, range(layers), device=plan.device, dtype=dt), 5).eval()
    cache = stage.new_cache(1, prefix + max(plan.widths))
    out = {}
    with torch.no_grad():
        for w in plan.widths:
            h = torch.randn(1, w, cfg.hidden_size, device=dev).to(dt)
            pos = torch.full((1, w), prefix, device=dev)
            mask = tree_mask(prefix, w).to(dev) if w > 1 else None
            out[w] = time_ms(lambda: stage.forward_layers(h, cache, prefix, pos, mask), dev, plan.iters, plan.warmup)
    del stage, cache
    return out


def pdm_k_ms(cfg, plan: CheckPlan, n: int) -> dict[int, dict]:
    """The PDM step (n + 1 rows) at each K, eager and graphed (bench/profiling.py)."""
    from spd_engine.bench.profiling import _pdm_times

    out = {}
    for k in plan.pdm_ks:
        e, g, mode = _pdm_times(cfg, n, _settings(plan, k), 100 + k)
        out[k] = {"eager": e, "graphed": g, "mode": mode}
    return out


def colocated_tick(shape: str, n: int, plan: CheckPlan, raw: dict) -> dict:
    """A co-located SPD request (driver with stage 0 on rank 0, ranks as threads, one device):
    decode ms per tick against its compute. On one device the stages' kernels run one after
    another, so the compute of a tick is the sum of its steps (every stage, the PDM, the head);
    the overhead beyond compute is what the tick costs more, as a share of one stage step: the
    share the runtime adds to a stage on any device. Also the trace's residual (bench/profiling.py:
    the tick less its busiest rank's host-timed work)."""
    from spd_engine.bench.profiling import residual_per_tick_ms, stage_compute_ms
    from spd_engine.engine.runtime.reference import ReferenceExecutor

    mode = "graph" if plan.device.startswith("cuda") else "static"
    case = LosslessCase(shape, None, n, mode, plan.timing_dtype)
    ecfg = _case_config(case, plan, "spd", colocate=True, trace=True)
    ecfg = ecfg.replace(capacity=max(plan.capacity, plan.context + plan.tick_tokens + 64))
    # a prompt that puts the decode near the context the steps were timed at (attention length)
    gen = torch.Generator().manual_seed(99)
    prompt = torch.randint(3, ecfg.cfg.vocab_size, (max(4, plan.context - plan.tick_tokens - 16),),
                           generator=gen).tolist()
    with device_random_weights(), ReferenceExecutor(ecfg) as ex:
        ref = ex.generate(prompt, plan.tick_tokens).tokens  # warm-up; SPD's output is greedy's
        # every draft right: the pipeline stays full, so every tick runs every stage (a rejection's
        # refill ticks would run fewer and flatter the overhead)
        res = ex.generate(prompt, plan.tick_tokens, draft_policy=ForcedDrafts(ref, len(prompt), ecfg.cfg.vocab_size, 0))

    def pick(d: dict) -> float:  # the graphed time where the step was captured, else the eager one
        return d["graphed"] if mode == "graph" and d["graphed"] is not None else d["eager"]

    stage_d = raw["stage_ms"][n]
    stages = stage_d["graphed"] if mode == "graph" and stage_d["graphed"] is not None else stage_d["eager"]
    pdm, verify = pick(raw["pdm_ms"][n]), pick(raw["verify_ms"])
    kind = "graphed" if stages is stage_d["graphed"] else "eager"
    tick = 1e3 * res.decode_s / max(1, res.ticks)
    compute = sum(stages) + pdm + verify
    stage_mean = statistics.mean(stages)
    out = {"shape": shape, "n": n, "step_mode": mode, "ticks": res.ticks, "accepted": res.accepted, "tick_ms": tick,
           "compute_ms": compute, "stage_ms_mean": stage_mean, "steps_timed": kind,
           "overhead_ms": tick - compute, "overhead_share_of_stage": (tick - compute) / stage_mean}
    if res.trace is not None:
        resid = residual_per_tick_ms(res.trace)
        out["trace_residual_ms"] = statistics.median(resid) if resid else None
        out["trace_stage_compute_ms"] = stage_compute_ms([res.trace])
    return out


KERNEL_SHAPES = {"smollm2-135m": (576, 30), "qwen3-4b": (2560, 36), "llama-3.1-8b": (4096, 32)}  # hidden, layers


def anchor_gather(plan: CheckPlan) -> dict:
    """The Triton anchor-gather kernel (kernels/anchor_gather.py) against its torch reference on the
    rows of one steady-state tick at n = 8 (the pending full-depth row and lags 0..n-1, as
    `spd bench-kernel`, which also streams the weights from HBM; here they may sit in L2): the
    answer (relative error) and eager / graphed times. On the CPU, or without triton, only the
    torch reference runs and the kernel is reported as not run."""
    from spd_engine.bench.profiling import events_ms
    from spd_engine.engine.protocol.anchors import AnchorPlan
    from spd_engine.engine.protocol.topology import default_stage_layers, stage_bounds
    from spd_engine.kernels.anchor_gather import anchor_rows, pack_projection_weights

    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    cuda = plan.device.startswith("cuda")
    run_kernel = cuda and has_triton
    dev = torch.device(plan.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {}
    for name in plan.kernel_shapes:
        hidden, layers = KERNEL_SHAPES[name]
        if not cuda:
            hidden = 64  # the dry run: the same code on a small width
        n = 8
        ap = AnchorPlan.build(stage_bounds(default_stage_layers(layers, n)))
        row_types = [ap.type_at_depth(n)] + [ap.type_at_depth(j) for j in range(n)]
        T, R = ap.num_types, len(row_types)
        gen = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(hidden, (a + 1) * hidden, device=dev, generator=gen).div_(((a + 1) * hidden) ** 0.5)
              for a in range(T)]
        packed = pack_projection_weights([w.to(dtype) for w in ws])
        del ws
        ring = torch.randn(2 * R, T, hidden, device=dev, generator=gen).to(dtype)
        slots = torch.randperm(2 * R, device=dev, generator=gen)[:R].to(torch.int32)
        types = torch.tensor(row_types, dtype=torch.int32, device=dev)
        out = torch.empty(R, hidden, dtype=dtype, device=dev)
        ref = anchor_rows(ring, slots, types, packed, impl="torch").float()
        r: dict = {"hidden": hidden, "n": n, "rows": R, "types": T, "dtype": str(dtype).replace("torch.", "")}
        if run_kernel:
            got = anchor_rows(ring, slots, types, packed, impl="triton").float()
            r["rel_err_vs_torch"] = float((got - ref).norm() / ref.norm())
            iters = max(20, plan.iters * 5)
            for impl in ("triton", "torch"):
                call = lambda impl=impl: anchor_rows(ring, slots, types, packed, out=out, impl=impl,  # noqa: E731
                                                     check_indices=False)
                r[f"{'kernel' if impl == 'triton' else 'torch'}_eager_us"] = 1e3 * events_ms(call, iters)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    call()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                r[f"{'kernel' if impl == 'triton' else 'torch'}_graph_us"] = 1e3 * events_ms(graph.replay, iters)
        else:
            from spd_engine.bench.profiling import time_ms

            r["rel_err_vs_torch"] = None
            r["torch_eager_us"] = 1e3 * time_ms(lambda: anchor_rows(ring, slots, types, packed, out=out, impl="torch"),
                                                dev, plan.iters, plan.warmup)
        shapes[name] = r
        del packed, ring
        _free(dev)
    if not run_kernel:
        return {"status": f"not run ({'no CUDA' if not cuda else 'no triton'}; torch reference timed only)",
                "shapes": shapes}
    ok = all(r["rel_err_vs_torch"] < 1e-2 for r in shapes.values())
    return {"status": "pass" if ok else "fail (kernel differs from the torch reference)", "shapes": shapes}


def plans_beside_reference(shape: str, profile: dict, ns: tuple[int, ...]) -> dict:
    """`spd plan` (costmodel/cost_model.py) on the measured profile and on the built-in reference
    profile of the shape where there is one, with the same ASSUMED link and alpha: per n, the
    tokens/s of AR, PP, TP and co-located SPD, and the recommendation."""
    from spd_engine.costmodel.cost_inputs import REFERENCE_PROFILES, AlphaCurve, LinkModel, Profile
    from spd_engine.costmodel.cost_model import Links, plan, recommendation

    link = LinkModel.assume(f"ASSUMED {PLAN_LINK[0]:g} us, {PLAN_LINK[1]:g} GB/s", *PLAN_LINK)
    profiles = {"measured": Profile.from_dict(profile)}
    ref = f"{shape}-h200"
    if ref in REFERENCE_PROFILES:
        profiles["reference " + ref] = Profile.from_dict({**REFERENCE_PROFILES[ref], "name": ref})
    out = {"assumed_link": list(PLAN_LINK), "assumed_alpha": PLAN_ALPHA, "profiles": {}}
    for which, prof in profiles.items():
        result = plan(prof, Links(link), AlphaCurve({0: PLAN_ALPHA}), list(ns), 400, 0)
        by_n: dict[int, dict] = {n: {"ar": result["ar_tok_s"]} for n in ns if n <= prof.num_layers}
        for r in result["rows"]:
            key = r["method"] if r["method"] != "spd" else f"spd_{r['layout']}"
            row = by_n.setdefault(r["n"], {})
            row[key] = max(row.get(key, 0.0), r["tok_s"])
        out["profiles"][which] = {"tok_s_by_n": by_n, "recommendation": recommendation(result)}
    return out


def run_timings(plan: CheckPlan, env: dict, out_dir: Path, dl: Deadline, log: Callable[[str], None]) -> dict:
    from spd_engine.bench.profiling import fully_graphed, measure_shape, profile_json
    from spd_engine.bench.sync_time import host_sync_ms
    from spd_engine.engine.runtime.run_config import PRESETS

    dev = torch.device(plan.device)
    out: dict = {k: None for k in TIMING_KEYS}
    out["host_sync_us"] = 1e3 * host_sync_ms(dev, iters=50, warmup=5)
    out["shapes"], out["pdm_k"], out["stage_width"], out["colocated_tick"], out["profiles"] = {}, {}, {}, {}, {}
    out["plans"] = {}
    dev_name = env["device_name"].replace(" ", "-").lower()
    sync_ms = out["host_sync_us"] / 1e3
    for item in ("syncs", "kernel"):
        if dl.left() <= 0:
            out["syncs_per_tick" if item == "syncs" else "anchor_gather"] = {"status": "skipped (time budget)"}
            continue
        try:
            if item == "syncs":
                out["syncs_per_tick"] = syncs_per_tick(plan)
            else:
                out["anchor_gather"] = anchor_gather(plan)
        except Exception as err:  # reported; the timings go on
            out["syncs_per_tick" if item == "syncs" else "anchor_gather"] = {"status": "error", "error": _error(err)}
    for shape in plan.timing_shapes:
        if dl.left() <= 0:
            out["shapes"][shape] = {"status": "skipped (time budget)"}
            continue
        cfg = PRESETS[shape]
        try:
            raw = measure_shape(cfg, _settings(plan), lambda m: log("  " + m.strip()))
            raw_json = json.loads(json.dumps(raw, default=str))
            out["shapes"][shape] = {"status": "measured", "raw": raw_json}
            files = []
            kinds = [False] + ([True] if fully_graphed(raw) else [])
            main_profile = None
            for graphed in kinds:
                prof = profile_json(shape, cfg, raw, _settings(plan), graphed, dev_name)
                prof["sync_ms"] = sync_ms
                prof["source"]["check"] = label(env)
                path = out_dir / "profiles" / f"{shape}-{'graphs' if graphed else 'eager'}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(prof, indent=1))
                files.append(str(path.relative_to(out_dir)))
                main_profile = prof  # the graphed one where every step was captured
            out["profiles"][shape] = files
            out["plans"][shape] = plans_beside_reference(shape, main_profile, plan.ns)
            n_pdm = 4 if 4 in plan.ns else plan.ns[-1]
            out["pdm_k"][shape] = {"n": n_pdm, "ms": pdm_k_ms(cfg, plan, n_pdm)} if dl.left() > 0 else \
                {"status": "skipped (time budget)"}
            layers = max(1, cfg.num_layers // (4 if 4 in plan.ns else plan.ns[-1]))
            out["stage_width"][shape] = ({"layers": layers, "ms": stage_width_ms(cfg, plan, layers)}
                                         if dl.left() > 0 else {"status": "skipped (time budget)"})
            ticks = {}
            for n in plan.ns:
                if n < 4 and len(plan.ns) > 2:
                    continue  # the tick share is asked at n = 4 and 8
                if dl.left() <= 0:
                    ticks[n] = {"status": "skipped (time budget)"}
                    continue
                ticks[n] = colocated_tick(shape, n, plan, raw)
                log(f"  co-located tick {shape} n={n}: {ticks[n]['tick_ms']:.3f} ms, compute "
                    f"{ticks[n]['compute_ms']:.3f} ms, overhead {ticks[n]['overhead_share_of_stage']:.2f} of a stage")
            out["colocated_tick"][shape] = ticks
        except Exception as err:  # one shape's failure is reported with what the others measured
            out["shapes"][shape] = {"status": "error", "error": _error(err)}
        _free(dev)
    return out


# ---------------------------------------------------------------- training

class _SyntheticTokenizer:
    """Text -> ids folded into the model's vocabulary, for a synthetic corpus (no tokenizer files,
    no network on the GPU host): what `spd train` needs of a corpus is token ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eos_ids, self.special_ids = vocab_size, (2,), frozenset({0, 1, 2})
        self.fingerprint = f"synthetic-bytes-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        return [3 + (b * 131 + i) % (self.vocab_size - 3) for i, b in enumerate(text.encode())]

    def chat_ids(self, text: str) -> list[int]:
        return [1] + self.encode(text) + [2]

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        return [i for m in messages for i in self.chat_ids(m["content"])]


def synthetic_corpus(out: Path, vocab_size: int) -> Path:
    from spd_engine.train.corpus import BuildOptions, build_corpus
    from spd_engine.train.decontaminate import Decontaminator

    tok = _SyntheticTokenizer(vocab_size)
    texts = [{"source": "synthetic", "licence": "CC0-1.0", "kind": "text",
              "text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 12} for i in range(64)]
    build_corpus(out, [texts], tok, Decontaminator(tok.encode), BuildOptions(holdout_fraction=0.0,
                                                                           build_command="spd gpu-check"))
    return out


def train_run(method: str, plan: CheckPlan, work: Path, budget_s: float,
              spd_main: Callable[[list[str]], int] | None = None) -> dict:
    """A few steps of `spd train` in this process (bf16 autocast and target on CUDA; on the CPU
    fp32, which is what the CPU supports fast), from history.json: losses, tokens per second."""
    from spd_engine.engine.runtime.run_config import random_preset

    cfg = random_preset(plan.train_model)
    corpus = work / "corpus"
    if not (corpus / "manifest.json").exists():
        synthetic_corpus(corpus, cfg.vocab_size)
    out = work / f"run-{method}"
    dtype = "bfloat16" if plan.device.startswith("cuda") else "float32"
    n = 4 if cfg.num_layers >= 4 else 2
    # one fill only (the full pipeline): the losses of successive steps are then comparable
    split = ["--stages", str(n), "--fill-weights", ",".join(["0"] * (n - 1) + ["1"])] if method == "pdm" else []
    argv = ["train", "--model", plan.train_model, "--method", method, "--corpus", str(corpus), "--out", str(out),
            *split, "--seq-len", str(plan.train_seq), "--batch", str(plan.train_batch), "--steps",
            str(plan.train_steps), "--save-every", str(plan.train_steps), "--autocast", dtype, "--target-dtype",
            dtype, "--device", plan.device, "--lr", "3e-3"]
    t0 = time.perf_counter()
    if spd_main is not None:  # `spd` itself in this process (tools/gpu_check.py passes it)
        rc, err_tail = spd_main(argv), []
    else:  # the command in a child process that imports spd_engine as this one does (the package
        # layering keeps bench from importing tools)
        from spd_engine.engine.runtime.launch import spd_command

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.getcwd() if p == "" else p for p in sys.path))
        proc = subprocess.run([*spd_command(), *argv], capture_output=True,
                              text=True, env=env, timeout=max(30.0, budget_s))
        rc, err_tail = proc.returncode, proc.stderr.strip().splitlines()[-3:]
    seconds = time.perf_counter() - t0
    hist = json.loads((out / "history.json").read_text()) if (out / "history.json").exists() else []
    losses = [h["loss"] for h in hist]
    finite = bool(losses) and all(isinstance(x, float) and x == x and abs(x) != float("inf") for x in losses)
    third = max(1, len(losses) // 3)
    falling = finite and len(losses) >= 2 and statistics.mean(losses[-third:]) < statistics.mean(losses[:third])
    tokens = hist[-1].get("tokens", 0) if hist else 0
    return {"status": "pass" if rc == 0 and finite and falling else "fail", "rc": rc, "dtype": dtype,
            "stderr_tail": err_tail if rc else [],
            "steps": len(losses), "losses": losses, "finite": finite, "falling": falling, "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "command": "spd " + " ".join(argv[:1] + [a if "/" not in a else Path(a).name for a in argv[1:]])}


def run_training(plan: CheckPlan, work: Path, dl: Deadline, log: Callable[[str], None],
                 spd_main: Callable[[list[str]], int] | None = None) -> dict:
    out = {}
    for method in ("pdm", "eagle"):
        if dl.left() <= 0:
            out[method] = {"status": "skipped (time budget)"}
            continue
        try:
            out[method] = train_run(method, plan, work, dl.left(), spd_main)
        except Exception as err:  # reported, the other method still runs
            out[method] = {"status": "error", "error": _error(err)}
        log(f"  train {method}: {out[method]['status']}")
    return out


# ---------------------------------------------------------------- the run

def summary(report: dict) -> dict:
    """Pass / fail / not run counts over every checked item."""
    statuses = [c["status"] for c in report["lossless"]["cases"]]
    s = report["lossless"]["sampling"]
    statuses += [s.get("sampling_twice", s).get("status", "error"), s.get("branch_width_2", s).get("status", "error")]
    statuses += [v["status"] for v in report["training"].values()]
    t = report["timings"]
    for item in (t["anchor_gather"], t["syncs_per_tick"], *t["shapes"].values()):
        statuses.append((item or {}).get("status", "error"))
    failed = [x for x in statuses if x.startswith(("fail", "error"))]
    skipped = [x for x in statuses if x.startswith(("skipped", "not run"))]
    return {"items": len(statuses), "failed": len(failed), "not_run": len(skipped),
            "passed_or_measured": len(statuses) - len(failed) - len(skipped), "ok": not failed}


def run_check(out_dir: str | Path, dry: bool, log: Callable[[str], None] = print, device: str = "cuda",
              spd_main: Callable[[list[str]], int] | None = None) -> dict:
    """The whole check; writes OUT/gpu-check.json and OUT/gpu-check.md; returns the report.
    `spd_main`: the `spd` command's main, to run `spd train` in this process (else a child)."""
    if not dry:
        if not torch.cuda.is_available():
            raise ValueError("gpu-check needs a CUDA device and torch with CUDA; none is available here "
                             "(`make gpu-check-dry` runs the same checks on the CPU)")
    plan = dry_plan() if dry else gpu_plan(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dl = Deadline(plan.budget_s)
    env = environment(plan.device)
    log(f"# spd gpu-check{' --dry' if dry else ''}: {label(env)}")
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the lossless and timing figures
    threads = torch.get_num_threads()
    if dry:
        torch.set_num_threads(1)  # the default test suite runs beside other work
    report: dict = {"schema": SCHEMA, "mode": "dry (cpu, tiny shapes)" if dry else "gpu",
                    "environment": env, "plan": dataclasses.asdict(plan)}
    shares = dict(plan.shares)
    work = out / "work"
    if work.exists():  # a previous run's corpus and train runs: `spd train` would resume them
        shutil.rmtree(work)
    try:
        dl.start_section(shares["lossless"] * plan.budget_s)
        log("## lossless")
        report["lossless"] = run_lossless(plan, dl, log)
        dl.start_section(shares["timings"] * plan.budget_s)
        log("## timings")
        report["timings"] = run_timings(plan, env, out, dl, log)
        dl.start_section(max(shares["training"] * plan.budget_s, plan.budget_s - dl.elapsed()))
        log("## training")
        report["training"] = run_training(plan, work, dl, log, spd_main)
    finally:
        torch.set_num_threads(threads)
    report["not_checked"] = list(NOT_CHECKED)
    report["summary"] = summary(report)
    report["summary"]["seconds"] = round(dl.elapsed(), 1)
    assert tuple(report) == REPORT_KEYS, tuple(report)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-check.md").write_text(markdown(report))
    log(f"wrote {out}/gpu-check.json and {out}/gpu-check.md: {report['summary']}")
    return report


# ---------------------------------------------------------------- the markdown report

def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else (format(x, fmt) if isinstance(x, (int, float)) else str(x))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# spd gpu-check ({report['mode']})", "", f"Every figure: {label(env)}; {env['date_utc']}.", ""]
    s = report["summary"]
    lines += [f"Items: {s['items']}, passed or measured {s['passed_or_measured']}, failed {s['failed']}, "
              f"not run {s['not_run']}; {s['seconds']} s.", "", "## Lossless (SPD against greedy through the "
              "same steps on the same device)", "", "| shape | layers | n | steps | dtype | status | forced accepted "
              "| graphs captured | s |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["lossless"]["cases"]:
        k = c["case"]
        lines.append(f"| {k['shape']} | {k['layers'] or 'all'} | {k['n']} | {k['step_mode']} | {k['dtype']} | "
                     f"{c['status']}{' ' + c.get('error', c.get('why', '')) if c['status'] != 'pass' else ''} | "
                     f"{_f(c.get('forced_accepted'), 'd')} | "
                     f"{_f(c.get('graphed'), 'd')}/{_f(c.get('step_graphs'), 'd')} "
                     f"| {_f(c.get('seconds'), '.1f')} |")
    smp = report["lossless"]["sampling"]
    lines += ["", f"T > 0 keyed sampling twice: {smp.get('sampling_twice', smp).get('status')}; branch width 2: "
              f"{smp.get('branch_width_2', smp).get('status')}.", "", "## Timings (ms, medians)", ""]
    t = report["timings"]
    lines.append(f"One host sync: {_f(t['host_sync_us'], '.1f')} us; host syncs per decode tick: "
                 f"{_f((t['syncs_per_tick'] or {}).get('per_tick'), '.2f')} "
                 f"({(t['syncs_per_tick'] or {}).get('status')}).")
    lines += ["", "| shape | AR eager | AR graph | verify eager | verify graph | n | max stage eager | max stage graph "
              "| PDM eager | PDM graph |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, v in t["shapes"].items():
        if v.get("status") != "measured":
            lines.append(f"| {shape} | {v.get('status')} {v.get('error', '')} |||||||||")
            continue
        raw = v["raw"]
        for n, st in raw["stage_ms"].items():
            p = raw["pdm_ms"][n]
            lines.append(f"| {shape} | {_f(raw['ar_ms']['eager'])} | {_f(raw['ar_ms']['graphed'])} | "
                         f"{_f(raw['verify_ms']['eager'])} | {_f(raw['verify_ms']['graphed'])} | {n} | "
                         f"{_f(max(st['eager']))} | {_f(max(st['graphed']) if st['graphed'] else None)} | "
                         f"{_f(p['eager'])} | {_f(p['graphed'])} |")
    lines += ["", "PDM step by K (n + 1 rows):", ""]
    for shape, v in t["pdm_k"].items():
        ms = v.get("ms", {})
        lines.append(f"- {shape} n={v.get('n')}: " + ", ".join(
            f"K={k} {_f(d['eager'])} eager / {_f(d['graphed'])} graph" for k, d in ms.items()) or v.get("status", ""))
    lines += ["", "Stage step carrying W tokens (eager):", ""]
    for shape, v in t["stage_width"].items():
        lines.append(f"- {shape}, {v.get('layers')} layers: " + ", ".join(
            f"W={w} {_f(ms)}" for w, ms in v.get("ms", {}).items()))
    ag = t["anchor_gather"] or {}
    lines += ["", f"Anchor gather ({ag.get('status')}):", ""]
    for shape, r in (ag.get("shapes") or {}).items():
        lines.append(f"- {shape} (H={r['hidden']}, {r['rows']} rows, {r['dtype']}): kernel "
                     f"{_f(r.get('kernel_eager_us'), '.1f')} us eager / "
                     f"{_f(r.get('kernel_graph_us'), '.1f')} us graph, "
                     f"torch reference {_f(r.get('torch_eager_us'), '.1f')} / {_f(r.get('torch_graph_us'), '.1f')} us; "
                     f"rel. err. {_f(r.get('rel_err_vs_torch'), '.1e')}")
    cpu_note = (" On the CPU the ranks' threads run on several cores at once, so the sum is no bound there and the "
                "dry run's shares mean nothing." if report["environment"]["device"] == "cpu" else "")
    lines += ["", "Co-located tick against its compute (all stages on one device, so compute = the sum of the "
              "steps)." + cpu_note, "", "| shape | n | steps | tick ms | compute ms | overhead ms | share of a stage |",
              "|---|---|---|---|---|---|---|"]
    for shape, ticks in t["colocated_tick"].items():
        for n, c in ticks.items():
            if "tick_ms" not in c:
                lines.append(f"| {shape} | {n} | {c.get('status')} |||||")
                continue
            lines.append(f"| {shape} | {n} | {c['step_mode']} | {c['tick_ms']:.3f} | {c['compute_ms']:.3f} | "
                         f"{c['overhead_ms']:.3f} | {c['overhead_share_of_stage']:.2f} |")
    lines += ["", "Profiles for `spd plan --profile`: " + ", ".join(
        f for files in t["profiles"].values() for f in files), ""]
    for shape, pl in t["plans"].items():
        lines += [f"`spd plan` on {shape}, ASSUMED link {pl['assumed_link']} (us, GB/s, all-reduce us), ASSUMED alpha "
                  f"{pl['assumed_alpha']}: tokens/s", "", "| profile | n | AR | PP | TP | SPD co-located | SPD separate |",
                  "|---|---|---|---|---|---|---|"]
        for which, res in pl["profiles"].items():
            for n, row in res["tok_s_by_n"].items():
                lines.append(f"| {which} | {n} | {_f(row.get('ar'), '.1f')} | {_f(row.get('pp'), '.1f')} | "
                             f"{_f(row.get('tp'), '.1f')} | {_f(row.get('spd_coloc'), '.1f')} | "
                             f"{_f(row.get('spd_sep'), '.1f')} |")
        lines.append("")
    lines += ["## Training", ""]
    for method, r in report["training"].items():
        losses = r.get("losses") or []
        lines.append(f"- {method}: {r['status']}{' ' + r.get('error', '') if r.get('error') else ''}; "
                     f"{r.get('dtype', '-')}, {r.get('steps', 0)} steps, loss {_f(losses[0] if losses else None)} -> "
                     f"{_f(losses[-1] if losses else None)}, {_f(r.get('tokens_per_s'), '.0f')} tokens/s")
    lines += ["", "## Not checked here", ""] + [f"- {x}" for x in report["not_checked"]]
    return "\n".join(lines) + "\n"
