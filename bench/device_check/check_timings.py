"""The timings section: host syncs, per-stage / PDM / verify / AR step times written as
`spd-profile/1` JSONs for `spd plan --profile`, the PDM by K, a W-row stage step, the co-located
tick against its compute, and `spd plan` on each measured profile beside the reference one."""
from __future__ import annotations

import dataclasses
import json
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from spd_engine.bench.device_check.check_env import error_line, free, label
from spd_engine.bench.device_check.check_kernel import anchor_gather
from spd_engine.bench.device_check.check_lossless import ForcedDrafts, case_config, prompts_for
from spd_engine.bench.device_check.check_patches import device_random_weights
from spd_engine.bench.device_check.check_plan import PLAN_ALPHA, PLAN_LINK, TIMING_KEYS, CheckPlan, Deadline, LosslessCase


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
    ecfg = case_config(case, plan, "spd", colocate=True)
    prompt = prompts_for(plan, ecfg.model.cfg.vocab_size)[0]
    counts = {}
    with device_random_weights(), ReferenceExecutor(ecfg, lockstep=False) as ex:
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
            # stage and cache are deleted after the loop (freeing device memory): F821 misreads the closure
            out[w] = time_ms(lambda: stage.forward_layers(h, cache, prefix, pos, mask),  # noqa: F821
                             dev, plan.iters, plan.warmup)
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
    ecfg = case_config(case, plan, "spd", colocate=True, trace=True)
    ecfg = ecfg.replace(capacity=max(plan.capacity, plan.context + plan.tick_tokens + 64))
    # a prompt that puts the decode near the context the steps were timed at (attention length)
    gen = torch.Generator().manual_seed(99)
    prompt = torch.randint(3, ecfg.model.cfg.vocab_size, (max(4, plan.context - plan.tick_tokens - 16),),
                           generator=gen).tolist()
    with device_random_weights(), ReferenceExecutor(ecfg, lockstep=False) as ex:
        ref = ex.generate(prompt, plan.tick_tokens).tokens  # warm-up; SPD's output is greedy's
        # every draft right: the pipeline stays full, so every tick runs every stage (a rejection's
        # refill ticks would run fewer and flatter the overhead)
        res = ex.generate(prompt, plan.tick_tokens, draft_policy=ForcedDrafts(ref, len(prompt), ecfg.model.cfg.vocab_size, 0))

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
            out["syncs_per_tick" if item == "syncs" else "anchor_gather"] = {"status": "error", "error": error_line(err)}
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
            out["shapes"][shape] = {"status": "error", "error": error_line(err)}
        free(dev)
    return out
