"""How many PDM layers K hide behind a stage: the separate driver's work per tick (PDM of K layers
+ its fixed host work + verification) against the slowest stage's compute, on a compute profile
(by default the built-in H200 reference profiles, docs/design.md 6).

The PDM's dependence on K is an ASSUMPTION (printed with the table): a profile's PDM time was
measured at one K (`measured_k`, 2 for the reference profiles); the rest of it (projections, the
draft head, launches) is taken as fixed, and each PDM layer is charged one mean target layer
(its n + 1 rows cost a decode step's one row on a GPU, which is latency-bound at these sizes).

    spd measure pdm-budget [--reference NAME ...] [--n 2,4,8] [--k-max 8]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from spd_engine.costmodel.cost_inputs import REFERENCE_PROFILES, Profile
from spd_engine.engine.protocol.topology import default_stage_layers
from spd_engine.tools.cli import HelpFormatter

ASSUMPTION = ("ASSUMPTION: PDM(K) = PDM(measured K) + (K - measured K) x one mean target layer; "
              "the driver on a device of its own (the separate-driver layout)")


def pdm_ms_at(profile: Profile, n: int, k: int, measured_k: int, notes: list[str]) -> float:
    """The PDM step at K = k layers, from the profile's step at `measured_k` layers."""
    layer = sum(profile.layer_ms) / profile.num_layers
    return max(0.0, profile.pdm_for(n, notes) + (k - measured_k) * layer)


def stage_ms(profile: Profile, n: int) -> float:
    """The slowest stage of the even split: its layers + the per-stage fixed cost."""
    bounds, out = 0, 0.0
    for count in default_stage_layers(profile.num_layers, n):
        out = max(out, sum(profile.layer_ms[bounds:bounds + count]))
        bounds += count
    return out + profile.stage_fixed_ms


def budget(profile: Profile, n: int, k_max: int, measured_k: int = 2) -> dict:
    """Driver work per tick at K = 1..k_max against the slowest stage; `hidden_k`: the largest K
    whose driver work fits in the stage's time (0: not even K = 1)."""
    notes: list[str] = []
    stage = stage_ms(profile, n)
    work = {k: profile.driver_work_for(n, notes) - profile.pdm_for(n, notes) + pdm_ms_at(profile, n, k, measured_k, notes)
            + profile.verify_ms for k in range(1, k_max + 1)}
    fits = [k for k, w in work.items() if w <= stage]
    return {"profile": profile.name, "n": n, "stage_ms": stage, "driver_ms": work,
            "hidden_k": max(fits) if fits else 0, "notes": notes}


def format_budget(rows: Sequence[dict]) -> str:
    ks = sorted(rows[0]["driver_ms"])
    head = ["profile", "n", "stage ms"] + [f"K={k}" for k in ks] + ["largest K hidden"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join([r["profile"], str(r["n"]), f"{r['stage_ms']:.3f}"] +
                                [f"{r['driver_ms'][k]:.3f}" for k in ks] + [str(r["hidden_k"])]))
    return "\n".join(lines) + "\n" + ASSUMPTION


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure pdm-budget", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--reference", action="append", choices=sorted(REFERENCE_PROFILES),
                   help="built-in profile (repeatable; default: all)")
    p.add_argument("--n", default="2,4,8", help="stage counts")
    p.add_argument("--k-max", type=int, default=8, help="largest K priced")
    p.add_argument("--measured-k", type=int, default=2, help="K the profile's PDM time was measured at")
    args = p.parse_args(argv)
    try:
        ns = [int(x) for x in args.n.split(",")]
    except ValueError:
        print(f"pdm_budget: --n takes comma-separated integers, got {args.n!r}", file=sys.stderr)
        return 2
    if args.k_max < 1 or args.measured_k < 1 or min(ns) < 1:
        print("pdm_budget: --k-max, --measured-k and every n must be >= 1", file=sys.stderr)
        return 2
    names = args.reference or sorted(REFERENCE_PROFILES)
    rows = [budget(Profile.from_dict({"name": name, **REFERENCE_PROFILES[name]}), n, args.k_max, args.measured_k)
            for name in names for n in ns]
    print(format_budget(rows))
    return 0

